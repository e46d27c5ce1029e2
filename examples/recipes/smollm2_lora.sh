#!/usr/bin/env bash
# smollm2_arith.sh with LoRA: rank-16 peft adapters on every attention and MLP projection of SmolLM2-135M-Instruct,
# the base frozen; each weight update sends only the adapter into the running vLLM engine. The final export
# writes runs/smollm2_lora/final/adapter (peft) and the merged model in runs/smollm2_lora/final. LoRA takes a
# larger learning rate than full fine-tuning (1e-5 there). Extra flags are passed through, e.g.
#   bash examples/recipes/smollm2_lora.sh --steps 10 --lora_rank 8
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" main.py \
  --model smollm2 \
  --agent examples/recipes/smollm2_agent.py \
  --dataset "reasoning-gym:chain_sum:min_terms=2,max_terms=2,max_digits=1" \
  --prompts_per_step 8 --samples_per_prompt 4 \
  --max_new_tokens 24 --max_len 128 --temperature 0.7 \
  --lora_rank 16 --lora_alpha 32 \
  --lr 2e-4 --mini_batches 2 --micro_batch_size 16 \
  --param_dtype auto \
  --steps 30 \
  --output_dir runs/smollm2_lora \
  "$@"
