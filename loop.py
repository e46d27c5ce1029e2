"""The one asynchronous loop: rollouts stream in, the trainer steps, weights flow back.

    ray.init -> Generator actor (vLLM) + Trainer actor (FSDP2)
    repeat --steps times:
        keep prompt groups generating (a streaming pool, bounded staleness)
        take the first --prompts_per_step groups that finish -> trainer.train_step
        trainer.weights_blob -> generator.update_weights  (no engine restart)
        log one JSON line of metrics
    export the final model, print a summary

Agents run here, in the driver, as asyncio tasks; each rollout calls the
generator actor for every turn. With --async_depth 0 the loop is strictly
on-policy: no group for step s+1 starts before the weights of step s are in
the engine. With depth K, groups may start up to K policy versions early.

    python main.py --steps 20          # see main.py for every flag
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import agent as agents
from generator import Generator
from trainer import TrainerGroup

log = logging.getLogger("molt")
ROOT = str(Path(__file__).resolve().parent)


def prompt_rows(cfg: dict, agent_cls: type):
    """Endless rows: the --dataset file reshuffled every epoch, or the agent's own prompts."""
    if not cfg["dataset"]:
        yield from agent_cls.prompts(cfg["seed"])
        return
    rows = agents.read_dataset(cfg["dataset"], cfg["input_key"], cfg["label_key"])
    rng = random.Random(cfg["seed"])
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for i in order:
            yield rows[i]


class RolloutPool:
    """Keeps prompt groups generating; finished groups wait in `done` in finish order."""

    def __init__(self, cfg: dict, agent_cls: type, rows, generate, tokenizer):
        self.cfg, self.agent_cls, self.rows = cfg, agent_cls, rows
        self.generate, self.tokenizer = generate, tokenizer
        self.done: asyncio.Queue = asyncio.Queue()
        self.started = 0          # groups started so far
        self.refill = 0           # extra groups allowed to replace dropped ones
        self.tasks: set[asyncio.Task] = set()
        self.drops: Counter = Counter()
        self.logged: set[str] = set()
        self.rollout_ids = itertools.count()

    def fill(self, allowed: int):
        """Start groups until `allowed` (+ refills) have started or the pool is full."""
        while (self.started < allowed + self.refill
               and len(self.tasks) < self.cfg["rollout_in_flight"]):
            row = next(self.rows)
            task = asyncio.create_task(self._group(self.started, row))
            self.tasks.add(task)
            task.add_done_callback(self._finished)
            self.started += 1

    def _finished(self, task: asyncio.Task):
        self.tasks.discard(task)
        if not task.cancelled():
            self.done.put_nowait(task.result() if task.exception() is None else task.exception())

    async def _group(self, group: int, row: dict):
        version = await self.generate.version()
        results = await asyncio.gather(*[self._rollout(group, row) for _ in range(self.cfg["samples_per_prompt"])])
        trajs = [t for t in results if t is not None]
        return {"group": group, "trajectories": trajs, "start_version": version}

    async def _rollout(self, group: int, row: dict):
        try:
            env = self.agent_cls()
            traj = await asyncio.wait_for(
                agents.run_env(env, row, self.generate, self.tokenizer, sampling=self.sampling(),
                               max_len=self.cfg["max_len"], max_turns=self.cfg["max_turns"]),
                timeout=self.cfg["agent_timeout"])
        except asyncio.TimeoutError:
            self._drop("timeout", f"rollout exceeded --agent_timeout {self.cfg['agent_timeout']}s")
            return None
        except Exception as e:  # the agent's bug loses only this rollout
            if self.generate.is_engine_error(e):
                raise
            self._drop("error", "".join(traceback.format_exception(e)))
            return None
        traj.group, traj.rollout_id = group, next(self.rollout_ids)
        return traj

    def _drop(self, reason: str, detail: str):
        self.drops[reason] += 1
        key = reason + detail.splitlines()[-1]
        if key not in self.logged:  # each distinct failure is logged once, then counted
            self.logged.add(key)
            log.warning("dropped a rollout (%s):\n%s", reason, detail)

    def sampling(self) -> dict:
        return {"temperature": self.cfg["temperature"], "top_p": self.cfg["top_p"],
                "max_tokens": self.cfg["max_new_tokens"]}

    def cancel(self):
        for task in list(self.tasks):
            task.cancel()


class EngineClient:
    """What agents call: one vLLM generator actor behind an async function."""

    def __init__(self, actor):
        self.actor = actor

    async def __call__(self, prompt_ids: list[int], sampling: dict) -> dict:
        return await self.actor.generate.remote(prompt_ids, sampling)

    async def version(self) -> int:
        return await self.actor.get_version.remote()

    @staticmethod
    def is_engine_error(e: Exception) -> bool:
        import ray
        return isinstance(e, ray.exceptions.RayError)


def batch_metrics(groups: list[dict], step: int) -> dict:
    trajs = [t for g in groups for t in g["trajectories"]]
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / len(rewards)
    info_keys = sorted({k for t in trajs for k in t.info})
    return {
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        "score_mean": sum(t.score for t in trajs) / len(trajs),
        "response_len": sum(t.num_sampled for t in trajs) / len(trajs),
        "rollouts": len(trajs),
        "start_version_lag": step - min(g["start_version"] for g in groups),
        **{f"info/{k}": sum(t.info.get(k, 0.0) for t in trajs) / len(trajs) for k in info_keys},
    }


async def train(cfg: dict, generator, trainer, agent_cls: type, tokenizer, on_step) -> list[dict]:
    """The loop itself. Returns the per-step metrics."""
    import ray

    P, K = cfg["prompts_per_step"], cfg["async_depth"]
    client = EngineClient(generator)
    pool = RolloutPool(cfg, agent_cls, prompt_rows(cfg, agent_cls), client, tokenizer)
    history = []
    version = 0  # policy version now in the engine
    try:
        for step in range(cfg["steps"]):
            t_step = time.perf_counter()
            groups, empty = [], 0
            pool.fill((version + K + 1) * P)
            while len(groups) < P:
                group = await pool.done.get()
                if isinstance(group, BaseException):
                    raise group  # an engine failure: stop with its error
                if not group["trajectories"]:
                    empty += 1
                    pool.refill += 1
                    if empty >= P and not history and not groups:
                        raise RuntimeError(f"every rollout of the first {empty} groups failed "
                                           f"({dict(pool.drops)}); see the tracebacks above")
                else:
                    groups.append(group)
                pool.fill((version + K + 1) * P)
            t_gen = time.perf_counter() - t_step

            trajs = [asdict(t) for g in groups for t in g["trajectories"]]
            metrics = {"step": step + 1, **batch_metrics(groups, version)}
            metrics.update(await trainer.train_step(trajs))
            t_sync = time.perf_counter()
            sync_s = await generator.update_weights.remote(trainer.weights_blob(), version + 1)
            version += 1
            busy = await generator.take_busy_seconds.remote()
            step_s = time.perf_counter() - t_step
            metrics.update({
                "version": version, "wait_rollouts_s": t_gen, "weight_sync_s": sync_s,
                "sync_total_s": time.perf_counter() - t_sync, "step_s": step_s,
                "generator_idle_frac": max(0.0, 1.0 - busy / step_s),
                "queue_depth": pool.done.qsize(), "in_flight_groups": len(pool.tasks),
                "tokens_per_s": sum(t["mask"].count(1) for t in trajs) / step_s,
                **{f"dropped/{k}": v for k, v in pool.drops.items()},
            })
            history.append(metrics)
            on_step(metrics)
    finally:
        pool.cancel()
    del ray
    return history


def start_ray(cfg: dict):
    import ray
    env = {"PYTHONPATH": os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1")}
    if cfg["ray_address"] is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
    ray.init(address=cfg["ray_address"], include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": env}, log_to_driver=cfg["verbose"])
    return ray


def run(cfg: dict) -> dict:
    """Set up Ray, the engine and the trainer, run the loop, export, summarize."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    agent_cls = agents.load_agent(cfg["agent"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    ray = start_ray(cfg)
    try:
        generator = ray.remote(Generator).options(num_cpus=0, max_concurrency=10_000).remote(
            cfg["model"], dtype=cfg["param_dtype"], max_len=cfg["max_len"], seed=cfg["seed"],
            gpu_memory_utilization=cfg["gpu_memory_utilization"])
        trainer = TrainerGroup(cfg)
        ray.get([generator.get_version.remote(), *trainer.ready()])
        setup_s = time.perf_counter() - t0

        metrics_file = (out / "metrics.jsonl").open("a")
        bar = progress(cfg)

        def on_step(m: dict):
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", s_per_step=f"{m['step_s']:.2f}",
                            mismatch=f"{m.get('mismatch_k3', 0.0):.1e}")

        history = asyncio.run(train(cfg, generator, trainer, agent_cls, tokenizer, on_step))
        bar.close()
        metrics_file.close()
        final = ray.get(trainer.call("export", str(out / "final")))
        ray.get(generator.shutdown.remote())
    finally:
        ray.shutdown()
    summary = summarize(history, setup_s, time.perf_counter() - t0, out, final)
    print(summary["text"], file=sys.stderr if cfg["quiet"] else sys.stdout)
    return summary


def progress(cfg: dict):
    from tqdm import tqdm
    return tqdm(total=cfg["steps"], desc="train", unit="step", dynamic_ncols=True,
                disable=cfg["quiet"] or not sys.stderr.isatty())


def summarize(history: list[dict], setup_s: float, total_s: float, out: Path, final: str) -> dict:
    k = max(1, min(10, len(history) // 4))
    first = sum(m["reward_mean"] for m in history[:k]) / k
    last = sum(m["reward_mean"] for m in history[-k:]) / k
    mismatch = sum(m.get("mismatch_abs", 0.0) for m in history) / len(history)
    text = (f"done: {len(history)} steps in {total_s:.0f}s (setup {setup_s:.0f}s)\n"
            f"reward: {first:.3f} (mean of first {k} steps) -> {last:.3f} (mean of last {k})\n"
            f"engine/trainer logprob mismatch: mean |diff| {mismatch:.2e}\n"
            f"metrics: {out / 'metrics.jsonl'}\nmodel:   {final}")
    return {"first_reward": first, "last_reward": last, "steps": len(history),
            "total_s": total_s, "setup_s": setup_s, "mismatch_abs": mismatch, "text": text}
