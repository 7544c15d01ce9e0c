# Two entry points (see README): `make demo` and `make test`. Both create the environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on the dev/CI machines; a GPU cluster sets TORCH_SPEC to its own build.
TORCH_SPEC ?= torch==2.13.0
TARGET ?= artifacts/tiny_target

.PHONY: env demo test test-slow

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: env
	PY=$(PY) TARGET=$(TARGET) bash scripts/demo.sh

test: env
	$(PY) -m pytest -q

test-slow: env
	$(PY) -m pytest -q -m slow
