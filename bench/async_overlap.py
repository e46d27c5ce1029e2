"""Does the async loop overlap generation with training? Sync vs async, one run.

Runs each workload twice through the real loop (Ray + vLLM + FSDP2 trainer): strict
on-policy (`--async_depth 0`) and async (`--async_depth 1 --partial_rollout`). From the
sync run it takes the generation time (waiting for rollouts) and the training time
(train step + weight sync) per step; the ideal async step time is max(generation,
training). Two workloads: `short` (3 new tokens: per-step fixed costs weigh most) and
`long` (48 new tokens: generation dominates, so the ratio measures the overlap itself).
The trainer and the engine each get one of the two cores (--train_threads 1).

    python bench/async_overlap.py [--workload short|long|both] [--steps 14] [--warmup 4]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import main  # noqa: E402

COMMON = ["--prompts_per_step", "16", "--samples_per_prompt", "8", "--mini_batches", "4",
          "--train_threads", "1", "--quiet", "--export_hf", "none", "--no_plot"]
WORKLOADS = {"short": ["--max_new_tokens", "3"], "long": ["--max_new_tokens", "48"]}


def run(extra: list[str], steps: int, out: Path) -> list[dict]:
    main.main([*COMMON, "--steps", str(steps), "--output_dir", str(out), *extra])
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def mean(rows, key):
    return sum(m[key] for m in rows) / len(rows)


def bench(name: str, steps: int, warmup: int, tmp: Path):
    sync = run(WORKLOADS[name], steps, tmp / f"{name}_sync")[warmup:]
    asyn = run([*WORKLOADS[name], "--async_depth", "1", "--partial_rollout"], steps, tmp / f"{name}_async")[warmup:]
    gen, sync_step, async_step = mean(sync, "wait_rollouts_s"), mean(sync, "step_s"), mean(asyn, "step_s")
    train = sync_step - gen   # train step + weight sync
    print(f"== {name}: {' '.join(WORKLOADS[name])}, {len(sync)} steps after {warmup}")
    print(f"sync step:  {sync_step:.3f} s  (generation {gen:.3f} s + training/sync {train:.3f} s, "
          f"{mean(sync, 'action_tokens'):.0f} action tokens)")
    print(f"async step: {async_step:.3f} s  (staleness {mean(asyn, 'staleness'):.2f}; trainer waiting "
          f"{mean(asyn, 'wait_rollouts_s'):.3f} s; idle: trainer {mean(asyn, 'trainer_idle_frac'):.2f}, "
          f"engine {mean(asyn, 'generator_idle_frac'):.2f})")
    print(f"async / sync step:                    {async_step / sync_step:.3f}")
    print(f"async step / max(generation, train):  {async_step / max(gen, train):.3f}   (limit 1.0, aim <= 1.15)")
    # Where the rest goes: both phases share 2 cores, so each runs slower while the other runs.
    print(f"async step / (generation + train):    {async_step / (gen + train):.3f}   (1.0 = no overlap at all)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the means")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_async_"))
    for name in WORKLOADS if args.workload == "both" else [args.workload]:
        bench(name, args.steps, args.warmup, tmp)
