"""What a rollout costs as a program (--agent_cmd) against the same agent as an in-process ChatAgent.

The same two-turn running max, once as examples/agents/chat_openai.py (a ChatAgent, in the driver) and once
as examples/programs/running_max.py (the stock OpenAI SDK in a process of its own), both through the real
loopback server and run_chat_agent; the engine is a stub that answers at once, so what is timed is the
agent's side: process start, interpreter and SDK import, requests, reward line. The framework's own part
of a program rollout (spawn, the row on stdin, pipes read, reward line parsed, group killed, folder removed)
is timed with `sh` reading its row and echoing a reward (sh starts in about a millisecond), through
Program.run alone. Each line also reports the longest stall of the driver's event loop (a 5 ms ticker)
while --in_flight rollouts run at once.

    python bench/programs.py [--rollouts 64] [--in_flight 16]
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import agent as agents  # noqa: E402
from server import ChatServer  # noqa: E402

TRIVIAL = "sh -c 'read row; echo \"{\\\"reward\\\": 1}\"'"   # no request: timed through Program.run alone


async def stub(ids, sampling):
    return {"token_ids": [5, 0], "logprobs": [-0.1, -0.1], "version": 0, "finish_reason": "stop"}


async def timed(make, rows, in_flight: int) -> tuple[float, float]:
    """(seconds per rollout, the longest event-loop stall in ms) running `make(row)` for each row."""
    stall, gate, t0 = [0.0], asyncio.Semaphore(in_flight), time.perf_counter()

    async def tick():
        while True:
            last = time.perf_counter()
            await asyncio.sleep(0.005)
            stall[0] = max(stall[0], time.perf_counter() - last - 0.005)

    async def one(row):
        async with gate:
            return await make(row)
    ticker = asyncio.create_task(tick())
    await asyncio.gather(*[one(r) for r in rows])
    ticker.cancel()
    return (time.perf_counter() - t0) / len(rows), stall[0] * 1e3


async def main(n: int, in_flight: int):
    from transformers import AutoTokenizer
    import trainer
    tok = AutoTokenizer.from_pretrained(trainer.build_tiny_model(str(Path.home() / ".cache" / "molt" / "tiny-qwen3-chars-v1")))
    server = ChatServer()
    await server.start()
    chat_cls = agents.load_agent(str(ROOT / "examples" / "agents" / "chat_openai.py"))
    rows = [r for r, _ in zip(chat_cls.prompts(0), range(n))]
    sampling = {"temperature": 1.0, "max_tokens": 4}

    def through_server(cls):
        return lambda row: agents.run_chat_agent(cls(), row, stub, tok, server, sampling=sampling, max_len=64)
    program = agents.program(f"{sys.executable} {ROOT / 'examples' / 'programs' / 'running_max.py'}", 120)
    trivial = agents.program(TRIVIAL, 120)

    async def bare(row):   # the framework's part: spawn, row on stdin, pipes read, reward line parsed, group killed
        ctx = agents.ChatContext("http://x/v1", "http://x", "k" * 32, "policy", row["prompt"], [], None, row, sampling)
        return await trivial().run(ctx)
    results = {}
    for name, make, k in (("ChatAgent (in process)", through_server(chat_cls), in_flight),
                          ("program: Python + OpenAI SDK", through_server(program), in_flight),
                          ("program: framework part, one at a time", bare, 1),
                          (f"program: framework part, {in_flight} at once", bare, in_flight)):
        await timed(make, rows[:4], k)   # warm: imports, page cache
        results[name] = await timed(make, rows, k)
    await server.stop()
    base = results["ChatAgent (in process)"][0]
    print(f"{n} rollouts of the two-turn running max, stub engine, up to {in_flight} at once")
    for name, (per, stall) in results.items():
        print(f"  {name:45s} {per * 1e3:8.2f} ms/rollout  {per / base:7.1f}x  longest loop stall {stall:6.1f} ms")
    print("  (the framework's own part per program rollout: the 'one at a time' line; budget 20 ms)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--in_flight", type=int, default=16)
    a = p.parse_args()
    asyncio.run(main(a.rollouts, a.in_flight))
