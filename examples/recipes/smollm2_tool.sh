#!/usr/bin/env bash
# RL-train SmolLM2-135M-Instruct (on CPU) to use a Python tool: "What is 964 * 494?" -> a ```python
# block -> the sandbox's output in the next turn -> the answer (examples/recipes/smollm2_tool.py).
# Reward = the right product. The 128 held-out problems are written once under $MOLT_CACHE and never
# trained on; evaluation samples like training does. End to end, with the initial and final
# evaluations and the no-tool ablation: python bench/agent_learns.py. Extra flags pass through, e.g.
#   bash examples/recipes/smollm2_tool.sh --steps 4 --output_dir /tmp/try
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA="${MOLT_CACHE:-$HOME/.cache/molt}/smollm2_tool"
PYTHONPATH=. "${PYTHON:-python}" examples/recipes/smollm2_tool.py "$DATA"   # agent.py imports from here
exec "${PYTHON:-python}" main.py \
  --model smollm2 \
  --agent examples/recipes/smollm2_tool.py \
  --prompts_per_step 8 --samples_per_prompt 4 \
  --max_new_tokens 40 --max_len 512 --temperature 1.0 \
  --eval_dataset "$DATA/heldout.jsonl" --eval_temperature 1.0 --eval_every 4 \
  --lr 1e-5 --mini_batches 2 --micro_batch_size 16 \
  --param_dtype auto --train_threads 2 \
  --steps 8 \
  --output_dir runs/smollm2_tool \
  "$@"
