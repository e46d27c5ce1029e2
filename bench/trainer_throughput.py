"""Trainer throughput: training tokens/s of padded vs packed micro-batches, and of 1 vs 2
trainer ranks (gloo on CPU, nccl on GPU), all measured in one run on the tiny model with a
realistic spread of trajectory lengths. Results are ratios against the baseline (padded,
1 rank) measured in the same run, so they compare across machines.

    python bench/trainer_throughput.py [--rows 64] [--steps 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def trajectories(n: int, seed: int = 0) -> list[dict]:
    """Lengths spread like agent rollouts: prompts 20-60 tokens, replies 4-200 (long tail)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(20, 60), min(200, int(rng.expovariate(1 / 50)) + 4)
        out.append({"tokens": [rng.randint(5, 21) for _ in range(p + r)], "mask": [0] * p + [1] * r,
                    "logprobs": [0.0] * p + [-2.5] * r, "versions": [-1] * p + [0] * r,
                    "reward": float(rng.random() < 0.5), "group": i // 8, "rollout_id": i})
    return out


def cfg_for(model: str, **over) -> dict:
    import main
    args = ["--model", model, "--mini_batches", "1", "--micro_batch_tokens", "4096", "--samples_per_prompt", "8"]
    for k, v in over.items():
        args += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return main.validate(vars(main.build_parser().parse_args(args)))


def seconds_per_step(cfg: dict, trajs: list[dict], steps: int, rank: int = 0, world: int = 1, port: int = 0) -> float:
    """Seconds per train_step, after one warm-up step."""
    import trainer
    t = trainer.Trainer(cfg, rank, world, "127.0.0.1", port)
    t.train_step(trajs)
    if world > 1:
        torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        t.train_step(trajs)
    return (time.perf_counter() - t0) / steps


def _rank(rank, world, port, cfg, trajs, steps, out):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    s = seconds_per_step(cfg, trajs, steps, rank, world, port)
    if rank == 0:
        Path(out).write_text(str(s))


def run_ranks(cfg: dict, trajs: list[dict], steps: int, world: int) -> float:
    import tempfile
    import torch.multiprocessing as mp
    import parallel
    out = Path(tempfile.mkdtemp()) / "s"
    mp.spawn(_rank, args=(world, parallel.free_port(), cfg, trajs, steps, str(out)), nprocs=world, join=True)
    return float(out.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default="tiny")
    a = ap.parse_args()
    trajs = trajectories(a.rows)
    tokens = sum(len(t["tokens"]) for t in trajs)
    print(f"{a.rows} rows, {tokens} tokens, lengths {min(len(t['tokens']) for t in trajs)}-"
          f"{max(len(t['tokens']) for t in trajs)}; {torch.get_num_threads()} threads")
    runs = {"padded, 1 rank": {}, "packed, 1 rank": {"packing": True},
            "padded, 2 ranks": {"train_workers": 2}, "packed, 2 ranks": {"train_workers": 2, "packing": True}}
    results = {}
    for name, over in runs.items():
        cfg, world = cfg_for(a.model, **over), over.get("train_workers", 1)
        results[name] = seconds_per_step(cfg, trajs, a.steps) if world == 1 else run_ranks(cfg, trajs, a.steps, world)
    base = results["padded, 1 rank"]
    for name, s in results.items():
        print(f"{name:>16}: {tokens / s:9.0f} train tokens/s  ({base / s:.2f}x baseline)")


if __name__ == "__main__":
    main()
