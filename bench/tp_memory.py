"""Peak memory of one TP train step: the vocab-parallel LM head (what the trainer does) against
the replicated computation it replaced (every TP rank gathers the full [B, T, V] logits and
takes log_softmax over them), measured in one run on a small Qwen3 with a real-size vocabulary.

Each variant runs in two fresh gloo ranks (--tp_size 2); a rank's figure is its peak resident
memory during the train step (`ru_maxrss`) above its resident memory just before it. The
ratio after/before is what compares across machines.

    python bench/tp_memory.py [--vocab 151936] [--rows 8] [--len 256]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_model(path: Path, vocab: int) -> str:
    """The tiny model's tokenizer and a 2-layer Qwen3 whose vocabulary is `vocab` (Qwen's 151,936
    by default): the LM head, not the layers, decides the logits' memory."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    import main
    import trainer
    tiny = trainer.build_tiny_model(str(main.cache_dir() / trainer.TINY_CACHE))
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    return str(path)


def trajectories(rows: int, length: int) -> list[dict]:
    """`rows` rows of `length` tokens, half prompt, half reply (token ids the tokenizer knows)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        tokens = torch.randint(5, 21, (length,), generator=g).tolist()
        p = length // 2
        out.append({"tokens": tokens, "mask": [0] * p + [1] * (length - p), "logprobs": [0.0] * p + [-2.5] * (length - p),
                    "versions": [-1] * p + [0] * (length - p), "reward": float(i % 2), "group": i // 4,
                    "rollout_id": i})
    return out


def replicated_logprobs(logits, targets, vocab, group, entropy=False):
    """The computation before vocab-parallel scoring: gather every rank's slice into the full
    [b, n, V] logits (differentiably), then log_softmax over all of them on every rank."""
    import torch.distributed.nn.functional as dnn
    import losses
    full = torch.cat(dnn.all_gather(logits.contiguous(), group=group), dim=-1)[..., :vocab]
    return losses.token_logprobs(full, targets), (losses.entropy(full) if entropy else None)


def _rank(rank, world, port, cfg, trajs, variant, out):
    torch.set_num_threads(1)
    import parallel
    import trainer
    if variant == "replicated":
        parallel.vocab_parallel_logprobs = replicated_logprobs
    t = trainer.Trainer(cfg, rank, world, "127.0.0.1", port)
    t.train_step(trajs)           # optimizer state, allocator pools: all allocated once
    torch.distributed.barrier()
    before = psutil.Process().memory_info().rss
    metrics = t.train_step(trajs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(f"{out}.{rank}").write_text(f"{max(0, peak - before)} {metrics['policy_loss']!r}")
    torch.distributed.destroy_process_group()


def run(cfg: dict, trajs: list[dict], variant: str) -> tuple[list[int], float]:
    """(step peak above the pre-step memory per rank in bytes, policy loss) of one variant."""
    import torch.multiprocessing as mp
    import parallel
    out = Path(tempfile.mkdtemp()) / variant
    mp.spawn(_rank, args=(2, parallel.free_port(), cfg, trajs, variant, str(out)), nprocs=2, join=True)
    parts = [Path(f"{out}.{r}").read_text().split() for r in range(2)]
    return [int(p[0]) for p in parts], float(parts[0][1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    a = ap.parse_args()
    import main as molt
    model = build_model(Path(tempfile.mkdtemp()) / "qwen3-big-vocab", a.vocab)
    cfg = molt.validate(vars(molt.build_parser().parse_args([
        "--model", model, "--train_workers", "2", "--tp_size", "2", "--mini_batches", "1",
        "--micro_batch_size", str(a.rows), "--samples_per_prompt", "4", "--max_len", str(a.len)])))
    trajs = trajectories(a.rows, a.len)
    tokens, gib = a.rows * a.len, 2**30
    print(f"TP 2 train step: {a.rows} rows x {a.len} tokens = {tokens} tokens, vocabulary {a.vocab}; "
          f"full fp32 logits = {tokens * a.vocab * 4 / gib:.2f} GiB per copy")
    results = {v: run(cfg, trajs, v) for v in ("replicated", "vocab-parallel")}
    for v, (peaks, loss) in results.items():
        print(f"{v:>15}: step peak above resident, per rank: "
              f"{', '.join(f'{p / gib:.2f}' for p in peaks)} GiB  (policy loss {loss:.6f})")
    before, after = (max(results[v][0]) for v in ("replicated", "vocab-parallel"))
    print(f"vocab-parallel / replicated peak: {after / before:.2f}; same loss: "
          f"{abs(results['replicated'][1] - results['vocab-parallel'][1]) < 1e-4}")


if __name__ == "__main__":
    main()
