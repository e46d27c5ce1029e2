"""Faults: stopping never leaks a process or a half checkpoint, bad agents never hang the run,
and no run overwrites another's records. The run tests start `python main.py` as a user
would (a subprocess) and find the run's processes by an environment tag (MOLT_TEST_TAG,
inherited by everything the driver starts), not by name."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

import fakes
import faults
import agent as agents
from agent import Env, Result
import logs
import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--prompts_per_step", "2", "--samples_per_prompt", "2", "--max_new_tokens", "2", "--mini_batches", "1",
        "--no_plot", "--quiet", "--export_hf", "none"]


def tagged(tag: str) -> list[str]:
    """Live processes whose environment holds MOLT_TEST_TAG=tag, as 'pid cmdline'."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"MOLT_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {cmdline[:120]}")
        except OSError:
            pass
    return found


def wait_until(condition, what: str, timeout: float = 150.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.2)


def nothing_left(tag: str, timeout: float = 20.0) -> list[str]:
    """Wait (bounded: "within a few seconds") for every tagged process to end; returns those
    still alive. (Without the reaper, Ray's own clean-up left processes alive for longer.)"""
    deadline = time.monotonic() + timeout
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return tagged(tag)


RUNS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_leftover_runs():
    """A failing test must not leave its run behind (the next tests would share the CPUs)."""
    yield
    for proc in RUNS:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    RUNS.clear()


class Run:
    """`python main.py ARGS` in its own process group (so SIGINT to the group is a terminal's
    Ctrl-C), tagged, stderr to a file."""

    def __init__(self, tmp_path: Path, args: list[str]):
        self.tag = uuid.uuid4().hex
        self.err_path = tmp_path / f"stderr-{self.tag}.txt"
        env = {**os.environ, "MOLT_TEST_TAG": self.tag}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *args], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=self.err_path.open("w"),
                                     start_new_session=True)
        RUNS.append(self.proc)

    def wait(self, timeout: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"the run did not end within {timeout:.0f}s; stderr:\n{self.stderr()[-3000:]}")

    def stderr(self) -> str:
        return self.err_path.read_text()


def metric_lines(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []


# ---------------------------------------------------------------- no hang

BAD_AGENT = '''
import asyncio, itertools, time
from agent import Env, Result

class WorksOnceThenBreaks(Env):
    """Step 1's four rollouts work; after that each call raises, blocks its thread or hangs."""
    calls = itertools.count()

    @classmethod
    def prompts(cls, seed):
        while True:
            yield {"prompt": "3?7=", "label": "7"}

    async def step(self, state):
        n = next(self.calls)
        if n < 4:
            return Result(reward=float(n % 2))
        if n % 3 == 1:                 # first (call 4): one loop is shared until something blocks it
            raise ValueError(f"agent bug at call {n}")
        if n % 3 == 2:
            time.sleep(600)            # blocking code in an async step
        await asyncio.Event().wait()   # hangs forever
'''


def test_agents_that_break_after_step_one_stop_the_run(tiny_model, tmp_path):
    """Raising, blocking (time.sleep in step) and hanging agents, from step 2 on: the run stops
    after --max_failed_groups failed groups with the counts and the last traceback; the blocked
    agent is dropped by --agent_timeout (its thread, not the loop, is stuck) with its stack, and
    the watchdog reports the blocked agent thread. (Five 2-rollout groups, three rounds of 3 s
    timeouts: the block lasts past the watchdog's 5 s.)"""
    agent = tmp_path / "bad.py"
    agent.write_text(BAD_AGENT)
    out = tmp_path / "run"
    run = Run(tmp_path, ["--model", tiny_model, "--agent", str(agent), "--steps", "3", "--output_dir", str(out),
                         "--agent_timeout", "3", "--max_failed_groups", "5", *TINY])
    rc = run.wait()
    err = run.stderr()
    assert rc == 1, err[-3000:]
    assert [m["step"] for m in metric_lines(out)] == [1], err[-3000:]
    assert "molt: the run stopped: the last 5 groups gave nothing to train: every rollout failed" in err, err[-3000:]
    # stopped on purpose: one line, not the framework's traceback, which is in the run's error.log
    assert 'launch.py", line' not in err and 'launch.py", line' in (out / "error.log").read_text()
    assert f"(traceback: {out / 'error.log'})" in err
    assert "(--max_failed_groups 5;" in err and "the last failure:" in err
    assert "'error':" in err and "'timeout':" in err            # the counts, by reason
    assert "ValueError: agent bug at call" in err                # the raising agent's traceback
    assert "the agent's code is blocking its thread at:" in err and "time.sleep(600)" in err
    assert "has not run for" in err and "agent thread molt-agent-" in err   # the watchdog's report (>= 5 s)
    assert not nothing_left(run.tag)


def test_agent_thread_keeps_the_loop_free_and_watchdog_names_the_blocker(monkeypatch):
    """Unit: a step that blocks runs on an agent thread (the loop's timeout fires); a loop that
    is blocked is reported with the stack of the code blocking it."""
    monkeypatch.setattr(faults, "BLOCKED_S", 0.5)
    monkeypatch.setattr(faults, "STALLED_S", 1.0)

    async def blocking_step():
        time.sleep(3.0)
        return "done"

    def block_the_loop_here():
        time.sleep(1.5)

    async def main_():
        threads = faults.AgentThreads(2)
        dog = faults.Watchdog(asyncio.get_running_loop(), threads).start()
        thread = threads.take()
        with pytest.raises(asyncio.TimeoutError):   # inline, the sleep would finish first
            await asyncio.wait_for(thread.call(blocking_step), 0.2)
        while thread.blocked_for() < faults.STALLED_S:   # until the loop is seen stalled (its sleep lasts 3 s)
            await asyncio.sleep(0.05)
        assert threads.take() is not thread         # a blocked thread gets no new rollouts
        block_the_loop_here()
        await asyncio.sleep(1.2)
        dog.close()
        threads.close()
        return dog.reports

    reports = asyncio.run(main_())
    assert any("driver's event loop" in r and "block_the_loop_here" in r for r in reports), reports
    assert any("agent thread" in r and "blocking_step" in r for r in reports), reports


def test_a_timeout_error_raised_by_agent_code_is_its_error_not_agent_timeout(tiny_model, tiny_tokenizer):
    """Only the rollout's own --agent_timeout counts as dropped/timeout; a TimeoutError the agent's
    code raises (its HTTP client, its database) is an agent error like any other."""
    import loop

    class RaisesTimeout(Env):
        async def step(self, state):
            raise TimeoutError("the agent's database timed out")

    class Hangs(Env):
        async def step(self, state):
            await asyncio.Event().wait()

    class Engine:
        def session(self):
            return fakes.FakeEngine(tiny_tokenizer, ["3"])

        def is_engine_error(self, e):
            return False
    cfg = {"model": tiny_model, "max_len": 64, "max_turns": 1, "max_images_per_prompt": None, "agent_timeout": 0.05,
           "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4}
    for cls, reason, said in ((RaisesTimeout, "error", "TimeoutError: the agent's database timed out"),
                              (Hangs, "timeout", "rollout exceeded --agent_timeout 0.05s")):
        pool = loop.RolloutPool(cfg, cls, iter([]), Engine(), tiny_tokenizer)
        assert asyncio.run(pool._rollout(0, {"prompt": "1?2="})) == []
        assert pool.drops == {reason: 1} and said in pool.last_failure


CLIENT = httpx.AsyncClient()   # module level, as LiteLLM keeps its one process-wide client


def test_a_module_level_async_client_serves_every_rollout():
    """Rollouts taken as the loop takes them all share one agent event loop while nothing blocks it,
    so a library's module-level async client (bound to the loop that first used it) works for all."""
    from aiohttp import web

    async def hello(request):
        await asyncio.sleep(0.01)   # requests overlap: the client's pool is shared while they run
        return web.json_response({"ok": 1})

    async def rollout(url):
        return [(await CLIENT.get(url)).json() for _ in range(3)]

    async def main_():
        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        threads = faults.AgentThreads()

        async def one():
            thread = threads.take()
            try:
                return await asyncio.wait_for(thread.call(rollout, url), 60)
            finally:
                threads.give_back(thread)
        try:
            return await asyncio.gather(*[one() for _ in range(32)], return_exceptions=True)
        finally:
            threads.close()
            await runner.cleanup()
    assert asyncio.run(main_()) == [[{"ok": 1}] * 3] * 32


class BlockingSteps(Env):
    """Blocking code written as plain functions: each step waits at a barrier that only N steps
    running at once can pass (run one at a time, as they were, the barrier breaks)."""
    barrier: threading.Barrier
    loops: list

    async def reset(self, row):
        self.loops.append(threading.current_thread().name)   # async code: on the shared agent loop

    def step(self, state):
        self.barrier.wait(timeout=20)
        time.sleep(0.01)   # blocking work, after the barrier
        return Result(reward=1.0, observation="1", terminated=state.turn == 2)


def test_blocking_agent_code_runs_concurrently_and_async_code_shares_one_loop(tiny_tokenizer):
    n = 8
    BlockingSteps.barrier, BlockingSteps.loops = threading.Barrier(n), []

    async def main_():
        threads = faults.AgentThreads()

        async def one():
            thread = threads.take()   # taken in one burst, as the pool takes them
            try:
                return await agents.run_env(BlockingSteps(), {"prompt": "1?2="}, fakes.fake(tiny_tokenizer, ["3"] * 3),
                                            tiny_tokenizer, sampling={"max_tokens": 4}, max_len=64,
                                            max_turns=3, call=thread.call)
            finally:
                threads.give_back(thread)
        try:
            return await asyncio.gather(*[one() for _ in range(n)])
        finally:
            threads.close()
    trajs = asyncio.run(main_())
    assert [t.info["turns"] for t in trajs] == [3.0] * n      # every turn's N steps passed the barrier together
    assert BlockingSteps.loops == ["molt-agent-0"] * n         # async code on the one shared loop


def test_a_finished_call_is_delivered_while_the_next_call_blocks_the_agent_loop():
    """Rollouts share one agent loop: a call that has finished reaches its caller even when the
    call behind it on that loop blocks it (its outcome must not wait for the loop's next turn)."""
    thread, gate, release = faults.AgentThread("molt-agent-test"), threading.Event(), threading.Event()

    async def blocking(event):   # an async def that blocks its loop (a plain def would get a thread of its own)
        return event.wait(10)

    async def at_once(fn):   # finishes in its first step: nothing to wait for
        return fn()

    async def main():
        held = asyncio.ensure_future(thread.call(blocking, gate))     # holds the loop while A and B queue
        a = asyncio.ensure_future(thread.call(at_once, lambda: "a"))
        error = asyncio.ensure_future(thread.call(at_once, lambda: {}["missing"]))
        b = asyncio.ensure_future(thread.call(blocking, release))     # blocks the loop until A is delivered
        await asyncio.sleep(0)                                        # all four posted
        gate.set()
        assert await a == "a"
        with pytest.raises(KeyError):                                 # an error is delivered as promptly
            await error
        release.set()
        return await held, await b

    try:
        assert asyncio.run(main()) == (True, True)   # B was released by A's delivery, not by its timeout
    finally:
        thread.close()


def test_a_call_cancelled_after_its_agent_loop_closed_ends_cancelled_not_as_an_error():
    """Ctrl-C: the loop's `finally` closes the agent threads while the cancelled rollouts unwind. A
    rollout whose agent loop has closed ends cancelled, not with "Event loop is closed" (which the
    pool counted and logged as a dropped rollout)."""
    thread = faults.AgentThread("molt-agent-test")

    async def main_():
        call = asyncio.ensure_future(thread.call(asyncio.sleep, 60))
        while not thread.tasks:   # started on the agent loop
            await asyncio.sleep(0.01)
        thread.close()
        thread.thread.join(10)
        assert thread.loop.is_closed()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    asyncio.run(main_())


def test_agent_thread_calls_run_there_and_bring_back_results_errors_and_cancellation():
    """Calls cross threads in batches (faults.Mailbox): every caller gets its own result or
    exception, the code runs on the agent thread, and cancelling a caller cancels its task there."""
    threads = faults.AgentThreads(3)
    cancelled = threading.Event()

    async def where(k):
        await asyncio.sleep(0.001 * (k % 7))
        if k % 50 == 13:
            raise KeyError(k)
        return k, threading.current_thread().name

    async def forever():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main_():
        calls = [threads.threads[k % 3].call(where, k) for k in range(600)]
        out = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(threads.threads[0].call(forever), 0.1)
        return out

    out = asyncio.run(main_())
    assert cancelled.wait(2.0)                             # the timeout reached the agent thread's task
    threads.close()
    for k, o in enumerate(out):
        if k % 50 == 13:
            assert isinstance(o, KeyError) and o.args == (k,)
        else:
            assert o == (k, f"molt-agent-{k % 3}")         # its own answer, computed on its thread


# ---------------------------------------------------------------- records

def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.replace("\n", " ")


def test_earlier_records_are_never_overwritten_and_resume_needs_a_complete_checkpoint(capsys, tiny_model, tmp_path,
                                                                                    monkeypatch):
    import launch
    monkeypatch.setattr(launch, "run", lambda cfg: pytest.fail("launch.run reached"))  # refused before Ray
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    err = _refused(capsys, ["--model", tiny_model, "--output_dir", str(out)])
    assert "holds an earlier run's records" in err and "metrics.jsonl" in err and "--overwrite" in err
    (out / "checkpoints" / "step_000003.tmp").mkdir(parents=True)   # interrupted mid-write
    err = _refused(capsys, ["--model", tiny_model, "--output_dir", str(out), "--resume"])
    assert "--resume: no complete checkpoint" in err and "step_000003.tmp" in err and "--overwrite" in err
    err = _refused(capsys, ["--model", tiny_model, "--output_dir", str(out), "--resume", "--overwrite"])
    assert "choose one" in err
    export = tmp_path / "export"   # an earlier export elsewhere counts too
    export.mkdir()
    (export / "config.json").write_text("{}")
    err = _refused(capsys, ["--model", tiny_model, "--output_dir", str(tmp_path / "new"), "--export_hf", str(export)])
    assert str(export) in err


# ---------------------------------------------------------------- stopping

def test_reaper_cleans_up_after_a_killed_driver(tmp_path):
    """Unit: a driver holding a RunGuard is SIGKILLed; the reaper ends the processes it started."""
    tag = uuid.uuid4().hex
    driver = tmp_path / "driver.py"
    # The second child lost the run's tag, as Ray's agents do (setproctitle zeroes the start of
    # their environment): the reaper knows it as the driver's descendant.
    driver.write_text(f"import os, subprocess, sys, time\nsys.path.insert(0, {str(ROOT)!r})\nimport faults\n"
                      "with faults.RunGuard():\n"
                      "    sleep = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
                      "    subprocess.Popen(sleep)\n"
                      "    subprocess.Popen(sleep, env={k: v for k, v in os.environ.items() if k != faults.TAG})\n"
                      "    time.sleep(2.5)  # the reaper snapshots the driver's descendants every second\n"
                      "    print('ready', flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(driver)], env={**os.environ, "MOLT_TEST_TAG": tag},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    assert len(tagged(tag)) == 4          # driver, its two children, the reaper
    proc.kill()
    proc.wait()
    assert not nothing_left(tag)


def test_a_stop_signal_cancels_the_loop_so_every_finally_runs(tmp_path):
    """Unit: SIGTERM while the loop runs: the loop's task and its children end through their
    `finally` blocks, the run ends with Stopped(SIGTERM) carrying its one-line message, an
    interrupted checkpoint folder is removed and the signal handlers are restored. (That no
    asyncio clean-up noise follows the message is checked by the real-run test below.)"""
    cleaned = []

    async def rollout():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("rollout")

    async def loop_():
        faults.cancel_on_stop(asyncio.current_task())
        child = asyncio.create_task(rollout())
        try:
            faults.set_phase("step 1 (generating)")
            (tmp_path / "checkpoints" / "step_000001.tmp").mkdir(parents=True)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            await child
        finally:
            child.cancel()
            cleaned.append("loop")

    with pytest.raises(faults.Stopped) as e:
        faults.guarded(tmp_path, lambda: asyncio.run(loop_()))
    assert e.value.signum == signal.SIGTERM and "rollout" in cleaned and "loop" in cleaned
    assert e.value.message.startswith("stopped by SIGTERM during step 1 (generating)")
    assert not list((tmp_path / "checkpoints").iterdir())
    assert signal.getsignal(signal.SIGTERM) is not faults._raise_stopped   # handlers restored


def test_signals_and_kill_leave_nothing_behind_and_resume_continues(tiny_model, tmp_path, capsys, monkeypatch):
    """SIGTERM during start-up (vLLM workers up), kill -9 of the driver while training, Ctrl-C
    while a resumed run trains: each time no process of the run survives; SIGTERM/SIGINT end
    with one line and 128 + signal, leaving only complete checkpoints; a fresh run needs
    --overwrite over the remains; --resume after the kill -9 starts cleanly, metrics continuous."""
    out = tmp_path / "run"
    common = ["--model", tiny_model, "--output_dir", str(out), *TINY, "--save_every", "1"]

    # 1. SIGTERM to the driver while the engine starts (`timeout 60 python main.py` once left a
    # VLLM::Worker spinning, re-parented to PID 1).
    run = Run(tmp_path, [*common, "--steps", "50"])
    # the engine core is up: spawned, it is VLLM::EngineCore; forked (CPU, one rank), a second ray::Generator
    wait_until(lambda: sum("VLLM::" in p or "ray::Generator" in p for p in tagged(run.tag)) >= 2, "vLLM engine core",
               proc=run.proc)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.stderr()[-3000:]
    assert run.stderr().strip().splitlines()[-1].startswith("molt: stopped by SIGTERM during start-up")
    assert not nothing_left(run.tag)

    # 2. An earlier run's records stay unless --overwrite; kill -9 of the driver while it trains.
    (out / "metrics.jsonl").write_text('{"step": 1, "earlier_run": true}\n')
    import launch
    monkeypatch.setattr(launch, "run", lambda cfg: pytest.fail("launch.run reached"))
    assert "--overwrite" in _refused(capsys, [*common, "--steps", "50"])
    run = Run(tmp_path, [*common, "--steps", "50", "--overwrite"])
    wait_until(lambda: len(metric_lines(out)) >= 2, "second step", proc=run.proc)  # step 1's checkpoint is done
    run.proc.kill()
    run.proc.wait()
    assert not nothing_left(run.tag)       # the reaper ended Ray, the engine core and its workers
    assert not any("earlier_run" in m for m in metric_lines(out))

    # 3. The next --resume starts cleanly; Ctrl-C (SIGINT to the process group) once it has
    # trained a step: one line, 130, only complete checkpoints, metrics continuous.
    resumed_at = json.loads((logs.complete_checkpoints(out)[-1] / "loop.json").read_text())["step"]
    run = Run(tmp_path, [*common, "--steps", "50", "--resume"])
    wait_until(lambda: "resumed from" in run.stderr() and metric_lines(out)[-1]["step"] > resumed_at,
               "a step after the resume", proc=run.proc)  # the message comes after old lines are cut
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.wait(60) == 128 + signal.SIGINT, run.stderr()[-3000:]
    last = run.stderr().strip().splitlines()[-1]
    assert last.startswith("molt: stopped by SIGINT during step") and "last complete checkpoint" in last, last
    assert not nothing_left(run.tag)
    steps = [m["step"] for m in metric_lines(out)]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] > resumed_at
    assert not list((out / "checkpoints").glob("*.tmp")) and logs.complete_checkpoints(out)


def test_reap_takes_the_children_a_known_process_started_after_the_snapshot():
    """Ray's agents drop the run's tag from their environment, so the reaper knows them from a
    once-a-second snapshot of the driver's descendants; a child one of them starts after the
    last snapshot is the run's too, and must not outlive the reap."""
    import psutil
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                               "print(c.pid, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    known = {parent.pid: psutil.Process(parent.pid).create_time()}   # the snapshot: the parent only
    try:
        faults.reap("no-such-run", exclude=set(), grace_s=0.5, limit_s=5.0, known=known)
        parent.wait(5)
        deadline = time.monotonic() + 5
        while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child outlived the reap"
            time.sleep(0.1)
    finally:
        for pid in (parent.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
