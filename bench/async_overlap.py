"""Does the async loop overlap generation with training? Sync vs async, one run.

Runs the same workload twice through the real loop (Ray + vLLM + FSDP2 trainer):
strict on-policy (`--async_depth 0`) and async (`--async_depth 1 --partial_rollout`).
From the sync run it takes the generation time (waiting for rollouts) and the
training time (train step + weight sync) per step; the ideal async step time is
max(generation, training). Prints the ratios; the physical limit of the last one
is 1.0. The trainer and the engine each get one of the two cores (--train_threads 1).

    python bench/async_overlap.py [--steps 14] [--warmup 4]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import main  # noqa: E402

WORKLOAD = ["--prompts_per_step", "16", "--samples_per_prompt", "8", "--max_new_tokens", "3",
            "--mini_batches", "4", "--train_threads", "1", "--quiet", "--export_hf", "none"]


def run(extra: list[str], steps: int, out: Path) -> list[dict]:
    main.main([*WORKLOAD, "--steps", str(steps), "--output_dir", str(out), *extra])
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def mean(xs):
    return sum(xs) / len(xs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the means")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_async_"))
    sync = run([], args.steps, tmp / "sync")[args.warmup:]
    asyn = run(["--async_depth", "1", "--partial_rollout"], args.steps, tmp / "async")[args.warmup:]
    gen = mean([m["wait_rollouts_s"] for m in sync])
    train = mean([m["step_s"] - m["wait_rollouts_s"] for m in sync])
    sync_step, async_step = mean([m["step_s"] for m in sync]), mean([m["step_s"] for m in asyn])
    print(f"sync step:  {sync_step:.3f} s  (generation {gen:.3f} s + training/sync {train:.3f} s)")
    print(f"async step: {async_step:.3f} s  (staleness {mean([m['staleness'] for m in asyn]):.2f})")
    print(f"async / sync step:                    {async_step / sync_step:.3f}")
    print(f"async step / max(generation, train):  {async_step / max(gen, train):.3f}   (limit 1.0, aim <= 1.15)")
