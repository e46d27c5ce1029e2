#!/usr/bin/env bash
# The GPU path end to end, for a person on a machine with one or more NVIDIA GPUs (not run by CI;
# not run on the CPU machine this project is developed on). From the repository root:
#
#   bash bench/gpu_check.sh              # all four parts; SKIP_INSTALL=1 skips the install
#
#   1. install   MOLT_GPU=1 bash install.sh (vllm 0.33.0 and the CUDA torch it pins)
#   2. tests     python -m pytest -q tests (the same CPU-sized tests, now on CUDA/NCCL)
#   3. default   python main.py (fp32, CUDA graphs: --enforce_eager defaults off on GPU)
#   4. bf16      --param_dtype bfloat16 --weight_sync broadcast (NCCL, trainer GPU -> engine GPU);
#                needs two GPUs (NCCL cannot pair two processes on one GPU): on one GPU it runs
#                with --weight_sync ray and says so
#
# Prints one table: part, exit status, seconds, reward (first 10 -> last 10 steps), mean
# engine/trainer logprob gap. Logs and runs go to $OUT (default runs/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -lt 1 ]; then echo "no NVIDIA GPU found (nvidia-smi -L): this script is for GPU machines"; exit 1; fi
ROWS=()

part() {  # part NAME RUN_DIR COMMAND...: run, time, record one table row
  local name=$1 dir=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee "$OUT/$name.log"
  "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  local stats="-"
  if [ -n "$dir" ] && [ -f "$dir/metrics.jsonl" ]; then
    stats=$("$PY" - "$dir/metrics.jsonl" <<'EOF'
import json, sys
m = [json.loads(l) for l in open(sys.argv[1])]
r = [x["reward_mean"] for x in m]
gap = [x["mismatch_abs"] for x in m if "mismatch_abs" in x]
print(f"{sum(r[:10]) / len(r[:10]):.3f} -> {sum(r[-10:]) / len(r[-10:]):.3f} | {sum(gap) / max(len(gap), 1):.2e}")
EOF
)
  fi
  ROWS+=("| $name | $rc | $((SECONDS - t0)) | $stats |")
}

if [ "${SKIP_INSTALL:-0}" != "1" ]; then
  part install "" env MOLT_GPU=1 bash install.sh
fi
part tests "" "$PY" -m pytest -q tests
rm -rf "$OUT/default" "$OUT/bf16"
part default "$OUT/default" "$PY" main.py --output_dir "$OUT/default" --quiet
SYNC=broadcast
if [ "$GPUS" -lt 2 ]; then SYNC=ray; echo "one GPU: the bf16 run uses --weight_sync ray (NCCL broadcast needs 2 GPUs)"; fi
part "bf16-$SYNC" "$OUT/bf16" "$PY" main.py --output_dir "$OUT/bf16" --quiet --param_dtype bfloat16 \
  --weight_sync "$SYNC" --no-enforce_eager

echo
echo "GPUs: $GPUS ($(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs))"
echo "| part | exit | seconds | reward first -> last | mean logprob gap |"
echo "|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo "logs: $OUT/*.log"
