"""The one asynchronous loop: rollouts stream in, the trainer steps, weights flow back.

    (launch.py: ray.init -> Generator actors (vLLM) + Trainer actors (FSDP2))
    repeat --steps times:
        keep prompt groups generating (a streaming pool, bounded staleness)
        take the first --prompts_per_step groups that finish -> trainer.train_step
        trainer weights -> every engine's update_weights  (no engine restart)
        log one JSON line of metrics
    export the final model, print a summary

Agents run here, in the driver, as asyncio tasks; each rollout calls the generator actors for every turn (one sticky
engine per rollout). With --async_depth 0 the loop is strictly on-policy: no group for step s+1 starts before the
weights of step s are in the engine. With depth K, groups may start up to K policy versions early, and staleness is
bounded where it matters, at consumption: a group whose oldest sampled token is more than K versions older than the
policy it would train (a slow group, or a partial rollout's first tokens) is dropped (`dropped/stale`).

Start-up and shutdown are in launch.py, held-out evaluation in evaluation.py.

    python main.py --steps 20          # see main.py for every flag
"""

import asyncio
import itertools
import json
import logging
import time
import traceback
from collections import Counter
from pathlib import Path

import agent as agents
import data
import evaluation
import faults
import logs
import programs
import trajectory
from generator import Engines
from server import ChatServer

log = logging.getLogger("molt")
MISMATCH_WARN = 1e-2  # k3 between engine and trainer logprobs; fp32 runs sit near 1e-12


class RolloutPool:
    """Keeps prompt groups generating; finished groups wait in `done` in finish order."""

    def __init__(self, cfg: dict, agent_cls: type, rows, generate, tokenizer, server=None,
                 threads: faults.AgentThreads | None = None):
        self.cfg, self.agent_cls, self.rows, self.server, self.threads = cfg, agent_cls, rows, server, threads
        self.generate, self.tokenizer = generate, tokenizer
        self.sampling = {"temperature": cfg["temperature"], "top_p": cfg["top_p"], "max_tokens": cfg["max_new_tokens"]}
        self.done: asyncio.Queue = asyncio.Queue()
        self.started = 0          # groups started so far
        self.pending: set[int] = set()  # rows started and not yet taken by collect (a checkpoint saves them)
        self.next_row = 0         # one past the highest row index started (a checkpoint saves it)
        self.refill = 0           # extra groups allowed to replace dropped ones
        self.tasks: set[asyncio.Task] = set()
        self.drops: Counter = Counter()
        self.filtered = 0         # groups dropped by --filter_groups
        self.logged: set[str] = set()
        self.last_failure = ""    # the latest drop's detail (traceback), for the error that stops a run
        self.dropped: list[dict] = []  # with --dump_rollouts: rollouts dropped since the last dump, with why
        self.failed_in_a_row = 0  # groups, in finish order, with nothing to train (all failed or filtered)
        self.next_rollout = 0

    def fill(self, allowed: int):
        """Start groups until `allowed` (+ refills) have started or the pool is full."""
        while self.started < allowed + self.refill and len(self.tasks) < self.cfg["rollout_in_flight"]:
            i, row = next(self.rows)  # a group's id is its row's index in the prompt source
            self.pending.add(i)
            self.next_row = max(self.next_row, i + 1)
            task = asyncio.create_task(self._group(i, row))
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
            segments = await agents.run_agent(self.cfg, self.agent_cls, row, self.generate.session(), self.tokenizer,
                                       self.server, self.sampling, thread.call if thread else None, branch=True)
        except trajectory.DropRollout as e:   # a timeout names the code that blocks the agent's thread, if any
            stuck = e.reason == "timeout" and thread is not None and thread.blocked_for() > 1.0
            self._drop(e.reason, str(e) + (f"; the agent's code is blocking its thread at:\n{thread.stack()}"
                                           if stuck else ""), group, row)
            return []
        except Exception as e:  # the agent's bug loses only this rollout
            if self.generate.is_engine_error(e):
                raise
            self._drop("error", "".join(traceback.format_exception(e)), group, row)
            return []
        finally:
            if thread is not None:
                self.threads.give_back(thread)
        first = self.next_rollout   # a rollout's segments share an id; its branches (--branches) have their own
        for seg in segments:
            seg.group, seg.rollout_id = group, first + seg.rollout_id
            seg.parent = None if seg.parent is None else first + seg.parent
        self.next_rollout = max(s.rollout_id for s in segments) + 1
        return segments

    def _drop(self, reason: str, detail: str, group: int, row: dict):
        self.drops[reason] += 1
        self.keep_dropped(reason, [{"group": group, "prompt": row.get("prompt"), "detail": detail[-2000:]}])
        self.last_failure = f"({reason}) {detail}"
        key = reason + detail.splitlines()[-1]
        if key not in self.logged:  # each distinct failure is logged once, then counted
            self.logged.add(key)
            log.warning("dropped a rollout (%s):\n%s", reason, detail)

    def keep_dropped(self, reason: str, records: list[dict]):
        if self.cfg.get("dump_rollouts"):
            self.dropped += [{**r, "dropped": reason} for r in records]

    def cancel(self):
        for task in list(self.tasks):
            task.cancel()


async def collect(pool: RolloutPool, cfg: dict, version: int, first_step: bool, policy: int) -> list[dict]:
    """Wait for --prompts_per_step usable groups to train policy version `policy`; empty (all rollouts dropped), stale
    (a token more than --async_depth versions older than `policy`) and, with --filter_groups, all-equal-reward groups
    are replaced by new ones from the pool. Stops the run when the first step's first groups all fail, or
    --max_failed_groups fail in a row. `version`: policy versions trained since this run (or resume) started."""
    P, K = cfg["prompts_per_step"], cfg["async_depth"]
    groups, empty = [], 0
    pool.fill((version + K + 1) * P)
    while len(groups) < P:
        group = await pool.done.get()
        if isinstance(group, BaseException):
            raise group  # an engine failure: stop with its error
        pool.pending.discard(group["group"])
        rewards = [t.reward for t in group["trajectories"]]
        oldest = min((v for t in group["trajectories"] for v in itertools.compress(t.versions, t.mask)), default=None)
        if rewards and oldest is not None and policy - oldest > K:
            # Groups are taken in finish order, so a slow one can arrive any number of versions
            # late: the bound on staleness is enforced here, on the tokens it would train.
            pool.drops["stale"] += len({t.rollout_id for t in group["trajectories"]})  # per rollout
            pool.keep_dropped("stale", [vars(t) for t in group["trajectories"]])
            pool.refill += 1
            if "stale" not in pool.logged:  # not a failure: said once, then counted
                pool.logged.add("stale")
                log.warning("dropped a group that finished with tokens more than --async_depth %d policy versions "
                            "older than the policy it would train (counted in dropped/stale)", K)
        elif not rewards or (cfg["filter_groups"] and len(rewards) > 1 and max(rewards) == min(rewards)):
            # nothing to train in this group (every rollout failed, or no signal): replace it, but
            # only --max_failed_groups times in a row (a task the policy always fails would loop forever)
            pool.refill += 1
            pool.failed_in_a_row += 1
            pool.filtered += bool(rewards)
            if rewards:
                pool.keep_dropped("filtered", [vars(t) for t in group["trajectories"]])
            empty += not rewards
            if empty >= P and first_step and not groups:
                raise faults.RunFailed(f"every rollout of the first {empty} groups failed "
                                   f"(dropped rollouts: {dict(pool.drops)}); the last failure: {pool.last_failure}")
            why = (f"the last group's {len(rewards)} rewards were all {rewards[0]:g} (--filter_groups)" if rewards
                   else f"the last failure: {pool.last_failure}")
            if pool.failed_in_a_row >= cfg["max_failed_groups"]:
                raise faults.RunFailed(f"the last {pool.failed_in_a_row} groups gave nothing to train: every rollout "
                                   "failed or, with --filter_groups, all rewards were equal (--max_failed_groups "
                                   f"{cfg['max_failed_groups']}; dropped rollouts so far: {dict(pool.drops)}, groups "
                                   f"filtered: {pool.filtered}); {why}")
            if pool.failed_in_a_row == cfg["max_failed_groups"] // 2 and rewards:
                log.warning("%d groups in a row had nothing to train; %s. The run stops at --max_failed_groups %d",
                            pool.failed_in_a_row, why, cfg["max_failed_groups"])
        else:
            pool.failed_in_a_row = 0
            groups.append(group)
        pool.fill((version + K + 1) * P)
    return groups


def resumed_rows(source, start: dict):
    """(index, row) from the prompt source, from the loop state `start`: first the rows a checkpointed run had started
    but not yet taken (in flight, or finished and waiting: lost with its process), then those it never started."""
    source, pending = iter(source), set(start.get("rows_pending", ()))
    head = [(i, row) for i, row in enumerate(itertools.islice(source, start["rows_started"])) if i in pending]
    return itertools.chain(head, zip(itertools.count(start["rows_started"]), source))


async def train(cfg: dict, engines: Engines | None, trainer, agent_cls: type, tokenizer, on_step,
                start: dict) -> list[dict]:
    """The loop itself, from the state `start` (fresh or a checkpoint). Returns the per-step metrics."""
    out = Path(cfg["output_dir"])
    rows = resumed_rows(data.prompt_source(cfg, agent_cls), start)
    server = None
    if engines is not None and issubclass(agent_cls, programs.Program):   # its command on an agent node, before rollouts
        await agent_cls.check_node()
    if engines is not None and issubclass(agent_cls, agents.ChatAgent):
        server = ChatServer(tool_parser=cfg["tool_parser"], reasoning_parser=cfg["reasoning_parser"],
                           host=cfg.get("server_host"))
        await server.start()
    replay = sorted(Path(cfg["replay_rollouts"]).glob("step_*.jsonl")) if cfg["replay_rollouts"] else None
    held_out = evaluation.eval_rows(cfg, agent_cls) if cfg["eval_every"] and engines else []
    version = start["version"]  # policy version now in the engine
    history = []
    threads = faults.AgentThreads()  # agent code runs off this loop, on one shared loop (another while it blocks)
    pool = RolloutPool(cfg, agent_cls, rows, engines, tokenizer, server, threads)
    pool.next_row = start["rows_started"]
    watchdog = faults.Watchdog(asyncio.get_running_loop(), threads).start()
    faults.cancel_on_stop(asyncio.current_task())  # a stop signal cancels the loop: every finally runs
    try:
        for step in range(start["step"], cfg["steps"]):
            t_step = time.perf_counter()
            faults.set_phase(f"step {step + 1} (generating)")
            if replay is not None:  # retrain on dumped batches: no engine at all
                trajs = [t for line in replay[step].read_text().splitlines() if "dropped" not in (t := json.loads(line))]
                groups = None
            else:
                groups = await collect(pool, cfg, version - start["version"], first_step=not history, policy=version)
                # Shallow: Ray copies them anyway, and asdict's deep copy was 15% of the driver's time.
                trajs = [dict(vars(t)) for g in groups for t in g["trajectories"]]
            t_gen = time.perf_counter() - t_step

            metrics = {"step": step + 1, **logs.batch_metrics(trajs)}
            if groups:
                metrics["start_version_lag"] = version - min(g["start_version"] for g in groups)
            t_train = time.perf_counter()
            faults.set_phase(f"step {step + 1} (training)")
            metrics.update(await trainer.train_step(trajs))
            train_s = time.perf_counter() - t_train
            per_token = metrics.pop("per_token", {})  # with --dump_rollouts: what the trainer made of each token
            if cfg["dump_rollouts"]:  # the batch, each token's advantage and trainer logprob, then the dropped
                rows = [{**t, **{k: v[i] for k, v in per_token.items()}} for i, t in enumerate(trajs)] + pool.dropped
                dump = Path(cfg["dump_rollouts"]) / f"step_{step:06d}.jsonl"
                dump.write_text("".join(json.dumps(t, default=str) + "\n" for t in rows))
                pool.dropped = []
            version += 1
            faults.set_phase(f"step {step + 1} (weight sync)")
            if engines is not None:
                metrics["weight_sync_s"] = await engines.update_weights(trainer, version)
                busy = await engines.busy_seconds()
            step_s = time.perf_counter() - t_step
            metrics.update({
                "version": version, "wait_rollouts_s": t_gen, "step_s": step_s,
                "trainer_idle_frac": max(0.0, 1.0 - train_s / step_s),
                "tokens_per_s": sum(sum(t["mask"]) for t in trajs) / step_s,
            })
            if engines is not None:
                metrics.update({
                    "generator_idle_frac": max(0.0, 1.0 - busy / step_s),
                    "queue_depth": pool.done.qsize(), "in_flight_groups": len(pool.tasks),
                    "filtered_groups": pool.filtered,
                    **{f"dropped/{k}": v for k, v in pool.drops.items()},
                })
            if held_out and (step + 1) % cfg["eval_every"] == 0:
                faults.set_phase(f"step {step + 1} (eval)")
                metrics.update(await evaluation.evaluate(cfg, engines, agent_cls, tokenizer, held_out, server, threads))
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
                                            "rows_started": pool.next_row, "rows_pending": sorted(pool.pending)},
                                           cfg["keep_checkpoints"])
    finally:
        faults.cancel_on_stop(None)
        pool.cancel()
        watchdog.close()
        threads.close()
        if server is not None:
            await server.stop()
    return history
