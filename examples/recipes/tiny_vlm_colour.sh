#!/usr/bin/env bash
# RL-train a tiny random-init vision-language model (Qwen2.5-VL layout, ~0.6M parameters, built
# offline under $MOLT_CACHE) to name the colour of a picture (examples/agents/vision_colour.py):
# images go through vLLM and the trainer, token-exact. On a CPU machine without torchvision the
# CPU-machine shim in examples/vlm_shims is put on PYTHONPATH (it does nothing where torchvision
# works). Extra flags are passed through, e.g.
#   bash examples/recipes/tiny_vlm_colour.sh --steps 20 --freeze_vision
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/examples/vlm_shims${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" main.py \
  --model tiny-vlm \
  --agent examples/agents/vision_colour.py \
  --max_new_tokens 1 \
  --steps 60 \
  --output_dir runs/tiny_vlm_colour \
  "$@"
