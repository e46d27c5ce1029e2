"""The one asynchronous loop: rollouts stream in, the trainer steps, weights flow back.

    ray.init -> Generator actor (vLLM) + Trainer actor (FSDP2)
    repeat --steps times:
        keep prompt groups generating (a streaming pool, bounded staleness)
        take the first --prompts_per_step groups that finish -> trainer.train_step
        trainer weights -> every engine's update_weights  (no engine restart)
        log one JSON line of metrics
    export the final model, print a summary

Agents run here, in the driver, as asyncio tasks; each rollout calls the
generator actors for every turn (one sticky engine per rollout). With --async_depth 0 the loop is strictly
on-policy: no group for step s+1 starts before the weights of step s are in
the engine. With depth K, groups may start up to K policy versions early, and
staleness is bounded where it matters, at consumption: a group whose oldest
sampled token is more than K versions older than the policy it would train (a
slow group, or a partial rollout's first tokens) is dropped (`dropped/stale`).

    python main.py --steps 20          # see main.py for every flag
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import agent as agents
import data
import faults
import logs
import trajectory
import vision
from generator import Engines, start_engines
from server import ChatServer
from logs import complete_checkpoints
from trainer import TrainerGroup

log = logging.getLogger("molt")
ROOT = str(Path(__file__).resolve().parent)
MISMATCH_WARN = 1e-2  # k3 between engine and trainer logprobs; fp32 runs sit near 1e-12


def prompt_rows(cfg: dict, agent_cls: type):
    """Endless rows: --dataset (any format, or reasoning-gym:<task>) reshuffled every epoch, or
    the agent's own prompts (data.prompt_source)."""
    yield from data.prompt_source(cfg, agent_cls)


class RolloutPool:
    """Keeps prompt groups generating; finished groups wait in `done` in finish order."""

    def __init__(self, cfg: dict, agent_cls: type, rows, generate, tokenizer, server=None,
                 threads: faults.AgentThreads | None = None):
        self.cfg, self.agent_cls, self.rows, self.server, self.threads = cfg, agent_cls, rows, server, threads
        self.generate, self.tokenizer = generate, tokenizer
        self.done: asyncio.Queue = asyncio.Queue()
        self.started = 0          # groups started so far
        self.refill = 0           # extra groups allowed to replace dropped ones
        self.tasks: set[asyncio.Task] = set()
        self.drops: Counter = Counter()
        self.filtered = 0         # groups dropped by --filter_groups
        self.logged: set[str] = set()
        self.last_failure = ""    # the latest drop's detail (traceback), for the error that stops a run
        self.failed_in_a_row = 0  # groups, in finish order, whose every rollout failed
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
        trajs = [seg for segments in results for seg in segments]
        return {"group": group, "trajectories": trajs, "start_version": version}

    async def _rollout(self, group: int, row: dict) -> list:
        """One rollout as its trajectory segments (an Env gives one; a ChatAgent one per
        prefix rewrite); [] if the agent failed."""
        thread = self.threads.take() if self.threads else None
        try:
            segments = await run_agent(self.cfg, self.agent_cls, row, self.generate.session(), self.tokenizer,
                                       self.server, self.sampling(), thread.call if thread else None)
        except asyncio.TimeoutError:
            stuck = thread is not None and thread.blocked_for() > 1.0  # the agent's code blocks its thread
            self._drop("timeout", f"rollout exceeded --agent_timeout {self.cfg['agent_timeout']}s"
                       + (f"; the agent's code is blocking its thread at:\n{thread.stack()}" if stuck else ""))
            return []
        except trajectory.DropRollout as e:
            self._drop(e.reason, str(e))
            return []
        except Exception as e:  # the agent's bug loses only this rollout
            if self.generate.is_engine_error(e):
                raise
            self._drop("error", "".join(traceback.format_exception(e)))
            return []
        finally:
            if thread is not None:
                self.threads.give_back(thread)
        rollout_id = next(self.rollout_ids)
        for seg in segments:
            seg.group, seg.rollout_id = group, rollout_id
        return segments

    def _drop(self, reason: str, detail: str):
        self.drops[reason] += 1
        self.last_failure = f"({reason}) {detail}"
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


async def run_agent(cfg: dict, agent_cls: type, row: dict, generate, tokenizer, server, sampling: dict,
                    call=None) -> list:
    """One rollout of either agent form, within --agent_timeout; returns its segments. `call`
    runs the agent's own code (an agent thread's `call`; None: in this loop)."""
    images = vision.image_tokens(cfg["model"])  # None for a text model
    if issubclass(agent_cls, agents.ChatAgent):
        run = agents.run_chat_agent(agent_cls(), row, generate, tokenizer, server, sampling=sampling,
                                    max_len=cfg["max_len"], image_tokens=images, call=call)
    else:
        run = agents.run_env(agent_cls(), row, generate, tokenizer, sampling=sampling, max_len=cfg["max_len"],
                             max_turns=cfg["max_turns"], image_tokens=images,
                             max_images=cfg["max_images_per_prompt"], call=call)
    result = await asyncio.wait_for(run, timeout=cfg["agent_timeout"])
    return result if isinstance(result, list) else [result]


def oldest_token(trajectories: list) -> int | None:
    """The policy version of the oldest sampled token of these trajectories (None: none)."""
    firsts = [min(itertools.compress(t.versions, t.mask), default=None) for t in trajectories]
    return min((v for v in firsts if v is not None), default=None)


async def collect(pool: RolloutPool, cfg: dict, version: int, first_step: bool, policy: int) -> list[dict]:
    """Wait for --prompts_per_step usable groups to train policy version `policy`; empty (all
    rollouts dropped), stale (a token more than --async_depth versions older than `policy`)
    and, with --filter_groups, all-equal-reward groups are replaced by new ones from the pool.
    Stops the run when the first step's first groups all fail, or --max_failed_groups fail in
    a row. `version`: policy versions trained since this run (or resume) started."""
    P, K = cfg["prompts_per_step"], cfg["async_depth"]
    groups, empty = [], 0
    pool.fill((version + K + 1) * P)
    while len(groups) < P:
        group = await pool.done.get()
        if isinstance(group, BaseException):
            raise group  # an engine failure: stop with its error
        rewards = [t.reward for t in group["trajectories"]]
        oldest = oldest_token(group["trajectories"])
        if rewards and oldest is not None and policy - oldest > K:
            # Groups are taken in finish order, so a slow one can arrive any number of versions
            # late: the bound on staleness is enforced here, on the tokens it would train.
            pool.drops["stale"] += len({t.rollout_id for t in group["trajectories"]})  # per rollout
            pool.refill += 1
            if "stale" not in pool.logged:  # not a failure: said once, then counted
                pool.logged.add("stale")
                log.warning("dropped a group that finished with tokens more than --async_depth %d policy versions "
                            "older than the policy it would train (counted in dropped/stale)", K)
        elif not rewards:
            empty += 1
            pool.refill += 1
            pool.failed_in_a_row += 1
            if empty >= P and first_step and not groups:
                raise RuntimeError(f"every rollout of the first {empty} groups failed "
                                   f"(dropped rollouts: {dict(pool.drops)}); the last failure: {pool.last_failure}")
            if pool.failed_in_a_row >= cfg["max_failed_groups"]:
                raise RuntimeError(f"every rollout of the last {pool.failed_in_a_row} groups failed (--max_failed_groups "
                                   f"{cfg['max_failed_groups']}; dropped rollouts so far: {dict(pool.drops)}); "
                                   f"the last failure: {pool.last_failure}")
        elif cfg["filter_groups"] and len(rewards) > 1 and max(rewards) == min(rewards):
            pool.failed_in_a_row = 0
            pool.filtered += 1  # no signal in this group: replace it
            pool.refill += 1
        else:
            pool.failed_in_a_row = 0
            groups.append(group)
        pool.fill((version + K + 1) * P)
    return groups


async def evaluate(cfg: dict, client, agent_cls: type, tokenizer, rows: list[dict], server=None,
                   threads: faults.AgentThreads | None = None) -> dict:
    """Mean reward, pass@k (a rollout passes when its reward reaches 1) and the mean of each
    Result.info key (a failed rollout counts 0) on held-out rows."""
    k = cfg["eval_samples"]
    sampling = {"temperature": cfg["eval_temperature"], "max_tokens": cfg["max_new_tokens"]}
    own_threads = threads is None
    threads = threads or faults.AgentThreads()

    async def one(row):
        thread = threads.take()
        try:
            traj = (await run_agent(cfg, agent_cls, row, client.session(), tokenizer, server, sampling,
                                    thread.call))[0]
            return traj.reward, traj.info
        except Exception as e:  # an eval rollout that fails scores 0, like a wrong answer
            if client.is_engine_error(e):
                raise
            return 0.0, {}
        finally:
            threads.give_back(thread)

    own_server = server is None and issubclass(agent_cls, agents.ChatAgent)
    if own_server:  # --eval_only: no training loop has started one
        server = ChatServer()
        await server.start()
    try:
        results = await asyncio.gather(*[one(r) for r in rows for _ in range(k)])
    finally:
        if own_server:
            await server.stop()
        if own_threads:
            threads.close()
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


async def train(cfg: dict, engines: Engines | None, trainer, agent_cls: type, tokenizer, on_step,
                start: dict) -> list[dict]:
    """The loop itself, from the state `start` (fresh or a checkpoint). Returns the per-step metrics."""
    out = Path(cfg["output_dir"])
    client = engines
    rows = itertools.islice(prompt_rows(cfg, agent_cls), start["rows_started"], None)
    server = None
    if client is not None and issubclass(agent_cls, agents.ChatAgent):
        server = ChatServer()  # loopback OpenAI/Anthropic endpoint for the agents' SDKs
        await server.start()
    replay = sorted(Path(cfg["replay_rollouts"]).glob("step_*.jsonl")) if cfg["replay_rollouts"] else None
    held_out = eval_rows(cfg, agent_cls) if cfg["eval_every"] and client else []
    version = start["version"]  # policy version now in the engine
    history = []
    threads = faults.AgentThreads()  # agent code runs off this loop (a blocking step stalls only its thread)
    pool = RolloutPool(cfg, agent_cls, rows, client, tokenizer, server, threads)
    watchdog = faults.Watchdog(asyncio.get_running_loop(), threads).start()
    faults.cancel_on_stop(asyncio.current_task())  # a stop signal cancels the loop: every finally runs
    try:
        for step in range(start["step"], cfg["steps"]):
            t_step = time.perf_counter()
            faults.set_phase(f"step {step + 1} (generating)")
            if replay is not None:  # retrain on dumped batches: no engine at all
                trajs = [json.loads(line) for line in replay[step].read_text().splitlines()]
                groups = None
            else:
                groups = await collect(pool, cfg, version - start["version"], first_step=not history, policy=version)
                # Shallow: Ray copies them anyway, and asdict's deep copy was 15% of the driver's time.
                trajs = [dict(vars(t)) for g in groups for t in g["trajectories"]]
            t_gen = time.perf_counter() - t_step
            if cfg["dump_rollouts"]:
                dump = Path(cfg["dump_rollouts"]) / f"step_{step:06d}.jsonl"
                dump.write_text("".join(json.dumps(t) + "\n" for t in trajs))

            metrics = {"step": step + 1, **logs.batch_metrics(trajs)}
            if groups:
                metrics["start_version_lag"] = version - min(g["start_version"] for g in groups)
            t_train = time.perf_counter()
            faults.set_phase(f"step {step + 1} (training)")
            metrics.update(await trainer.train_step(trajs))
            train_s = time.perf_counter() - t_train
            version += 1
            faults.set_phase(f"step {step + 1} (weight sync)")
            if client is not None:
                metrics["weight_sync_s"] = await engines.update_weights(trainer, version)
                busy = await engines.busy_seconds()
            step_s = time.perf_counter() - t_step
            metrics.update({
                "version": version, "wait_rollouts_s": t_gen, "step_s": step_s,
                "trainer_idle_frac": max(0.0, 1.0 - train_s / step_s),
                "tokens_per_s": sum(sum(t["mask"]) for t in trajs) / step_s,
            })
            if client is not None:
                metrics.update({
                    "generator_idle_frac": max(0.0, 1.0 - busy / step_s),
                    "queue_depth": pool.done.qsize(), "in_flight_groups": len(pool.tasks),
                    "filtered_groups": pool.filtered,
                    **{f"dropped/{k}": v for k, v in pool.drops.items()},
                })
            if held_out and (step + 1) % cfg["eval_every"] == 0:
                faults.set_phase(f"step {step + 1} (eval)")
                metrics.update(await evaluate(cfg, client, agent_cls, tokenizer, held_out, server, threads))
            if metrics.get("mismatch_k3", 0.0) > MISMATCH_WARN and not history:
                log.warning("engine and trainer disagree on the sampled tokens' logprobs (k3 %.2e). Likely causes: "
                            "different dtypes (bf16 engine vs fp32 trainer), an incomplete weight sync "
                            "(--check_weight_sync), tied embeddings not re-packed, or top_p/top_k < 1.",
                            metrics["mismatch_k3"])
            history.append(metrics)
            on_step(metrics)
            if cfg["save_every"] and ((step + 1) % cfg["save_every"] == 0 or step + 1 == cfg["steps"]):
                faults.set_phase(f"step {step + 1} (checkpointing)")
                await logs.save_checkpoint(out, lambda folder: trainer.call("save_checkpoint", folder),
                                           {"step": step + 1, "version": version,
                                            "rows_started": start["rows_started"] + pool.started},
                                           cfg["keep_checkpoints"])
    finally:
        faults.cancel_on_stop(None)
        pool.cancel()
        watchdog.close()
        threads.close()
        if server is not None:
            await server.stop()
    return history


def start_ray(cfg: dict):
    """Start a private local Ray, or join a running cluster (--ray_address auto|HEAD:6379).

    Every Ray worker, on any node, imports this code from the same absolute path (PYTHONPATH
    below): on several machines the project and its Python environment must sit at the same
    path on every node (shared storage, or the same checkout and install.sh on each)."""
    import ray
    paths = [ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]  # absolute: workers run elsewhere
    env = {"PYTHONPATH": os.pathsep.join(str(Path(p).resolve()) for p in paths if p),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
           faults.TAG: os.environ[faults.TAG]}  # on a cluster, the actors' tag comes only from here
    local = {}
    if cfg["ray_address"] is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        # Each trainer rank and engine reserves one CPU in its placement bundle; a small machine
        # declares that many (they share its cores) so that every layout fits.
        local["num_cpus"] = max(os.cpu_count() or 1, cfg["train_workers"] + (cfg["num_engines"] or 0))
    # "local": a new local cluster, never one found in /tmp/ray/ray_current_cluster (a stale file
    # there made ray.init retry a dead GCS for minutes, deaf to Ctrl-C and SIGTERM)
    ray.init(address=cfg["ray_address"] or "local", include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": env}, log_to_driver=cfg["verbose"], **local)
    faults.catch_stop_signals()  # ray.init sets a SIGTERM handler of its own (sys.exit): ours again
    return ray


def run(cfg: dict) -> dict:
    """`run_tagged`, guarded (faults.guarded): SIGINT/SIGTERM raise `faults.Stopped`, and no
    process of the run or interrupted checkpoint outlives it, however it ends."""
    return faults.guarded(Path(cfg["output_dir"]), lambda: run_tagged(cfg))


def run_tagged(cfg: dict) -> dict:
    """Set up Ray, the engine and the trainer, run the loop, export, summarize."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    out = Path(cfg["output_dir"])
    if cfg["overwrite"]:
        logs.clear_records(cfg)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg["eval_only"]:  # an eval of a finished run must not replace the run's config
        (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    agent_cls = agents.load_agent(cfg["agent"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    start = {"step": 0, "version": 0, "rows_started": 0}
    resume_from = complete_checkpoints(out)[-1] if cfg["resume"] and complete_checkpoints(out) else None
    ray = start_ray(cfg)
    try:
        engines = None if cfg["replay_rollouts"] else start_engines(cfg)
        trainer = TrainerGroup(cfg)
        wait_ready(cfg, [*trainer.ready()] + ([a.warm_up.remote() for a in engines.actors] if engines else []))
        say_threads(cfg, trainer, engines)
        if engines is not None:
            asyncio.run(engines.connect(trainer))
        if resume_from is not None:
            start = json.loads((resume_from / "loop.json").read_text())
            ray.get(trainer.call("load_checkpoint", str(resume_from / "trainer")))
            if engines is not None:  # the engines start from the checkpoint's weights
                asyncio.run(engines.update_weights(trainer, start["version"]))
            logs.keep_metrics(out / "metrics.jsonl", start["step"])
            log.warning("resumed from %s (step %d)", resume_from, start["step"])
        setup_s = time.perf_counter() - t0

        if cfg["eval_only"]:
            scores = asyncio.run(evaluate(cfg, engines, agent_cls, tokenizer,
                                          eval_rows(cfg, agent_cls)))
            print(json.dumps(scores))
            return scores
        metrics_file = logs.Sinks(cfg, append=resume_from is not None)  # metrics.jsonl + --logger backends
        bar = logs.progress(cfg, start["step"])

        def on_step(m: dict):
            metrics_file.log(m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", s_per_step=f"{m['step_s']:.2f}",
                            tok_per_s=f"{m['tokens_per_s']:.0f}", mismatch=f"{m.get('mismatch_k3', 0.0):.1e}")

        gc.freeze()  # start-up objects stay: a full collection would stall the rollouts
        try:
            history = asyncio.run(train(cfg, engines, trainer, agent_cls, tokenizer, on_step, start))
        finally:  # a stopped run's records are closed too (W&B/MLflow runs finished, not left open)
            bar.close()
            metrics_file.close()
        faults.set_phase("export")
        final = ray.get(trainer.call("export", cfg["export_hf"])) if cfg["export_hf"] else None
        if engines is not None:
            engines.shutdown()
    finally:
        ray.shutdown()
    if history and not cfg.get("no_plot"):
        logs.plot([out], out / "metrics.png")
    summary = logs.summarize(history, setup_s, time.perf_counter() - t0, out, final)
    print(summary["text"], file=sys.stderr if cfg["quiet"] else sys.stdout)
    return summary


def say_threads(cfg: dict, trainer, engines) -> None:
    """Say on stderr the threads each trainer rank and CPU engine computes with (parallel.cpu_threads)."""
    import ray
    ranks = ray.get([w.torch_threads.remote() for w in trainer.workers])
    cpu_engines = [t for t in ray.get([a.omp_threads.remote() for a in engines.actors]) if t] if engines else []
    how = ("async: trainer and engines compute at once, on shares of the cores" if cfg["async_depth"]
           else "on-policy: each phase takes the cores while the other waits")
    print(f"threads: trainer rank(s) {ranks} (torch)" + (f", engine(s) {cpu_engines} (OpenMP)" if cpu_engines else "")
          + f"; {how}; override with --train_threads / --engine_threads", file=sys.stderr)


def wait_ready(cfg: dict, refs: list):
    """Wait for the actors' start-up (engines: ~15 s each on CPU) behind a progress bar."""
    import ray
    from tqdm import tqdm
    with tqdm(total=len(refs), desc="starting trainer ranks and engines", unit="actor",
              disable=cfg["quiet"] or not sys.stderr.isatty()) as bar:
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            ray.get(ready)  # raises the actor's start-up error, if any
            bar.update(1)
