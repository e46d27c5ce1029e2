"""Held-out evaluation: mean reward, pass@k and each Result.info key on rows no step trains on
(--eval_dataset, or the agent's prompts from another seed). loop.train calls it every --eval_every
steps; `python main.py --eval_only` runs it once on a run's weights.
"""

import asyncio
import contextlib
import itertools

import agent as agents
import data
import faults
from server import ChatServer


async def evaluate(cfg: dict, client, agent_cls: type, tokenizer, rows: list[dict], server=None,
                   threads: faults.AgentThreads | None = None) -> dict:
    """Mean reward, pass@k (a rollout passes when its reward reaches 1) and the mean of each
    Result.info key (a failed rollout counts 0) on held-out rows."""
    k = cfg["eval_samples"]
    sampling = {"temperature": cfg["eval_temperature"], "max_tokens": cfg["max_new_tokens"]}

    async def one(row):
        thread = threads.take()
        try:
            traj = (await agents.run_agent(cfg, agent_cls, row, client.session(), tokenizer, server, sampling,
                                           thread.call))[0]
            return traj.reward, traj.info
        except Exception as e:  # an eval rollout that fails scores 0, like a wrong answer
            if client.is_engine_error(e):
                raise
            return 0.0, {}
        finally:
            threads.give_back(thread)

    async with contextlib.AsyncExitStack() as started:   # what this call starts, it stops
        if threads is None:
            threads = faults.AgentThreads()
            started.callback(threads.close)
        if server is None and issubclass(agent_cls, agents.ChatAgent):  # --eval_only: no loop has started one
            server = ChatServer(tool_parser=cfg["tool_parser"], reasoning_parser=cfg["reasoning_parser"],
                               host=cfg.get("server_host"))
            await server.start()
            started.push_async_callback(server.stop)
        results = await asyncio.gather(*[one(r) for r in rows for _ in range(k)])
    rewards = [reward for reward, _ in results]
    by_row = [rewards[i * k:(i + 1) * k] for i in range(len(rows))]
    keys = sorted({key for _, info in results for key in info})
    return {"eval/reward_mean": sum(rewards) / len(rewards),
            f"eval/pass@{k}": sum(max(r) >= 1.0 for r in by_row) / len(by_row),
            **{f"eval/info/{key}": sum(info.get(key, 0.0) for _, info in results) / len(results) for key in keys}}


def eval_rows(cfg: dict, agent_cls: type) -> list[dict]:
    if cfg["eval_dataset"]:
        return data.dataset_rows(cfg, cfg["eval_dataset"])
    return list(itertools.islice(agent_cls.prompts(cfg["seed"] + 1_000_003), cfg["eval_prompts"]))
