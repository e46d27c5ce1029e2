"""Faults: a run that is stopped leaves nothing behind, and a stuck agent never hangs the loop.

Stopping (launch.run uses all of this):
  - every process of a run carries MOLT_RUN_ID=<id> in its environment (set in the driver
    before Ray starts, so the Ray node, its workers, the vLLM engine cores and their workers
    inherit it; also in the actors' runtime_env for an external cluster). At the end of a run,
    however it ends, `reap` sends SIGTERM and then SIGKILL to every process still carrying it.
  - a reaper process (`python faults.py reap ID DRIVER_PID`, its own session so a terminal's
    Ctrl-C does not reach it) waits for the driver to end: when the driver dies without
    cleaning up (kill -9, an OOM kill), the reaper reaps the run's processes and exits.
  - SIGINT and SIGTERM in the driver raise `Stopped`: the step in flight is dropped, the
    `finally` blocks shut Ray down and reap, interrupted checkpoints are removed, and main.py
    prints one line and exits with 128 + the signal number.

Never hang (the loop's agents):
  - agent code (Env.reset/step, ChatAgent.run) runs on `AgentThreads`: `async def` code all on one agent
    event loop (a library's module-level async client, e.g. LiteLLM's, binds to its first loop), plain
    `def` code on a thread per call, concurrently (blocking work: time.sleep, blocking HTTP). An `async def`
    that blocks its loop stalls its rollouts, new ones go to another thread's loop, the driver's loop
    keeps serving the engine, and --agent_timeout still fires (naming where).
  - `Watchdog` (a thread) checks that the driver's loop and the agent loops keep turning; one
    that has not run for BLOCKED_S seconds is reported once with its thread's stack.
"""

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("molt")
TAG = "MOLT_RUN_ID"
BLOCKED_S = 5.0       # an event loop silent this long is reported
AGENT_THREADS = 64    # at most this many agent threads (each with its own event loop): one per blocked loop
STALLED_S = 2.0       # a loop that has not ticked (every 0.5 s) for this long gets no new rollouts


# ---------------------------------------------------------------- stopping

class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver. A KeyboardInterrupt, so that agent code's
    `except Exception` does not swallow it and asyncio lets it through."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class RunFailed(RuntimeError):
    """The run stopped on purpose (nothing left to train on): main.py prints its one line, the traceback
    goes to the run's error.log."""


phase = "start-up"  # what the driver is doing, for the one line a stopped run prints
received: int | None = None  # the stop signal, once one came
_loop_task: asyncio.Task | None = None  # the driver's loop while it runs (cancel_on_stop)


def set_phase(now: str):
    global phase
    phase = now


def cancel_on_stop(task: asyncio.Task | None):
    """While `task` (the loop's main task) runs, a stop signal cancels it instead of raising
    Stopped inside whichever task runs at that moment (asyncio.run's clean-up would then stop
    half way, and the loop's `finally` would not run); `guarded` turns it into Stopped."""
    global _loop_task
    _loop_task = task


def _raise_stopped(signum, frame):
    global received
    received = signum
    # once: a second signal while the run cleans up is ignored (the reaper still runs)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _loop_task is not None and not _loop_task.done():
        _loop_task.get_loop().call_soon_threadsafe(_loop_task.cancel)
        return
    raise Stopped(signum)


def catch_stop_signals() -> dict | None:
    """SIGINT/SIGTERM raise Stopped (main thread only). Call again after ray.init, which sets
    its own SIGTERM handler. Returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, _raise_stopped)
    return old


def tagged_pids(value: str) -> list[int]:
    """Pids of live processes whose (initial) environment holds TAG=value."""
    needle, found = f"{TAG}={value}".encode(), []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # gone, a zombie, or not ours to read
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def _still_running(known: dict[int, float] | None) -> list[int]:
    """The pids of `known` ({pid: start time}) that still run as the same, live process; their
    children join `known` (started since the last snapshot, they are the run's too)."""
    import psutil
    alive = []
    for pid, created in list((known or {}).items()):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
                known.update({c.pid: c.create_time() for c in p.children(recursive=True)})
    return alive


def reap(run_id: str, exclude: set[int], grace_s: float = 3.0, limit_s: float = 15.0,
         known: dict[int, float] | None = None) -> list[int]:
    """SIGTERM every process tagged with `run_id` or in `known` (but `exclude`), SIGKILL those still there after
    `grace_s`; repeat until none is left or `limit_s` passed. Returns the pids signalled."""
    signalled: set[int] = set()
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        pids = [p for p in {*tagged_pids(run_id), *_still_running(known)} if p not in exclude]
        if not pids:
            break
        late = time.monotonic() - start > grace_s
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if late or pid in signalled else signal.SIGTERM)
        signalled.update(pids)
        time.sleep(0.2 if late else 0.5)
    return sorted(signalled)


class RunGuard:
    """Tags the run's processes and guarantees they end with it (see the module docstring)."""

    def __init__(self):
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"

    def __enter__(self) -> "RunGuard":
        self.previous = os.environ.get(TAG)
        os.environ[TAG] = self.run_id
        self.reaper = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "reap", self.run_id,
                                        str(os.getpid())], stdin=subprocess.PIPE, start_new_session=True,
                                       env={k: v for k, v in os.environ.items() if k != TAG})
        return self

    def __exit__(self, *exc):
        reap(self.run_id, exclude={os.getpid()})
        self.reaper.stdin.write(b"x")  # a clean end; a killed driver's pipe just closes
        self.reaper.stdin.close()
        try:
            self.reaper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
        if self.previous is None:
            os.environ.pop(TAG, None)
        else:
            os.environ[TAG] = self.previous


def guarded(out: Path, run: Callable[[], Any]) -> Any:
    """`run()` (a whole run writing into `out`) with SIGINT/SIGTERM raising Stopped and inside a
    RunGuard; afterwards no interrupted checkpoint is left in `out` (its writer is reaped by
    then). A Stopped gets a one-line `message`: the signal, the phase, what can be resumed."""
    import logs
    global received
    old_signals, received = catch_stop_signals(), None
    cancel_on_stop(None)
    set_phase("start-up")
    try:
        with RunGuard():
            return run()
    except (KeyboardInterrupt, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError) and received is None:
            raise  # a cancellation, not a stop signal
        # Ray turns a Stopped raised inside ray.get/wait into a plain KeyboardInterrupt
        stopped = e if isinstance(e, Stopped) else Stopped(received or signal.SIGINT)
        ckpts = logs.complete_checkpoints(out)
        stopped.message = (f"{stopped} during {phase}; the step in flight was dropped; "
                           + (f"last complete checkpoint: {ckpts[-1]} (continue with --resume)" if ckpts else
                              "no complete checkpoint to resume from"))
        if stopped is e:
            raise
        raise stopped from None
    finally:
        logs.remove_interrupted_checkpoints(out)
        for s, handler in (old_signals or {}).items():
            signal.signal(s, handler)


def reaper_main(run_id: str, driver: int):
    """The reaper process: wait until the driver says it is done (one byte on our stdin) or
    dies (the pipe closes without it, or we are re-parented), then reap."""
    import psutil
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Ray's DashboardAgent and RuntimeEnvAgent rewrite their environment (no tag in
    # /proc/PID/environ): remember the driver's descendants too, for when it dies.
    known: dict[int, float] = {}
    died = True
    while os.getppid() == driver:
        with contextlib.suppress(psutil.Error):
            known.update({p.pid: p.create_time() for p in psutil.Process(driver).children(recursive=True)})
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready:
            # a clean end: the driver reaped its own run (its other children are not ours)
            died = not os.read(sys.stdin.fileno(), 1)
            break
    reap(run_id, exclude={os.getpid()}, known=known if died else None)


# ---------------------------------------------------------------- never hang

def _settle(future: asyncio.Future, how: str, *value):
    """Give `future` (the caller's) an outcome unless it has one: `how` is "set_result", "set_exception" or "cancel"."""
    if not future.done():
        getattr(future, how)(*value)


class Mailbox:
    """Callbacks posted to an event loop from other threads and run there in batches: one
    wake-up of the loop (a pipe write and a select) per batch, not per call. A 512-rollout
    step crosses threads ~2000 times; one wake-up each cost the driver ~0.1 s per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.armed = loop, collections.deque(), False

    def post(self, fn: Callable, *args):
        self.items.append((fn, args))
        if not self.armed and not self.loop.is_closed():  # closed: a stopped run, nobody is left to tell
            self.armed = True   # appended before this check, so a drain that already began sees it
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self):
        self.armed = False
        while self.items:
            fn, args = self.items.popleft()
            fn(*args)


_mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    return _mailboxes.setdefault(loop, Mailbox(loop))


class AgentThread:
    """A daemon thread running an event loop of its own, for agent code."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.inbox = mailbox(self.loop)
        self.tasks: dict[asyncio.Future, asyncio.Task] = {}  # caller's future -> its task here
        self.rollouts = 0       # rollouts now assigned to this thread
        self.tick = time.monotonic()
        self.reported = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._beat)
        self.loop.run_forever()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    def _beat(self):
        self.tick = time.monotonic()
        self.loop.call_later(0.5, self._beat)

    def blocked_for(self) -> float:
        return time.monotonic() - self.tick

    async def call(self, fn: Callable, *args) -> Any:
        """`await fn(*args)` on this thread's loop, or, for a plain function, `fn(*args)` on a thread of
        its own (blocking code runs concurrently); cancelling the caller cancels it here."""
        here = asyncio.get_running_loop()
        future = here.create_future()
        self.inbox.post(self._start, fn, args, future, mailbox(here))
        try:
            return await future
        except asyncio.CancelledError:
            self.inbox.post(self._cancel, future)
            raise

    def _start(self, fn: Callable, args: tuple, future: asyncio.Future, back: Mailbox):
        async def run():
            # The outcome is posted as the call ends, not from a done callback: one scheduled after
            # the next call on this loop would wait behind it if that call blocks the loop.
            try:
                out = fn(*args) if inspect.iscoroutinefunction(fn) else await self._in_thread(fn, args)
                out = await out if asyncio.iscoroutine(out) or isinstance(out, asyncio.Future) else out
            except asyncio.CancelledError:
                back.post(_settle, future, "cancel")
                raise
            except BaseException as e:
                back.post(_settle, future, "set_exception", e)
                if not isinstance(e, Exception):
                    raise
            else:
                back.post(_settle, future, "set_result", out)
        task = self.tasks[future] = self.loop.create_task(run())
        # cancelled before it started, `run` never ran: say so
        task.add_done_callback(lambda t: (self.tasks.pop(future, None),
                                          t.cancelled() and back.post(_settle, future, "cancel")))

    def _in_thread(self, fn: Callable, args: tuple) -> asyncio.Future:
        """`fn(*args)` on a daemon thread of its own: blocking calls run concurrently, and one that
        hangs does not hold up the interpreter's exit (a pool's worker threads would)."""
        future = self.loop.create_future()

        def work():
            try:
                self.inbox.post(_settle, future, "set_result", fn(*args))
            except BaseException as e:
                self.inbox.post(_settle, future, "set_exception", e)
        threading.Thread(target=work, name=self.thread.name + "-def", daemon=True).start()
        return future

    def _cancel(self, future: asyncio.Future):
        task = self.tasks.pop(future, None)
        if task is not None:
            task.cancel()

    def stack(self) -> str:
        frame = sys._current_frames().get(self.thread.ident)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def close(self):
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)


class AgentThreads:
    """Agent threads: a rollout takes the first whose loop is not blocked, so async agent code shares
    one loop while nothing blocks it (a new thread when every loop is blocked: blocking agents cannot
    starve the others), and keeps it for all its calls (an Env's objects may be bound to its loop)."""

    def __init__(self, n: int = 1):
        self.threads = [AgentThread(f"molt-agent-{i}") for i in range(n)]

    def take(self) -> AgentThread:
        thread = next((t for t in self.threads if t.blocked_for() < STALLED_S), None)
        if thread is None and len(self.threads) < AGENT_THREADS:
            thread = AgentThread(f"molt-agent-{len(self.threads)}")
            self.threads.append(thread)
        thread = thread or min(self.threads, key=lambda t: t.rollouts)  # all blocked, no more threads
        thread.rollouts += 1
        return thread

    def give_back(self, thread: AgentThread):
        thread.rollouts -= 1

    def close(self):
        for t in self.threads:
            t.close()


class Watchdog:
    """A thread that reports a stalled event loop, the driver's or an agent thread's (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, agents: AgentThreads):
        self.loop, self.agents = loop, agents
        self.tick = time.monotonic()
        self.stop = threading.Event()
        self.main_ident = threading.get_ident()
        self.reports: list[str] = []
        self.thread = threading.Thread(target=self._watch, name="molt-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.loop.call_soon(self._beat)
        self.thread.start()
        return self

    def close(self):
        self.stop.set()

    def _beat(self):
        self.tick = time.monotonic()
        if not self.stop.is_set():
            self.loop.call_later(0.5, self._beat)

    def _report(self, what: str, seconds: float, ident: int | None, reported: bool) -> bool:
        """Report `what` (with its thread's stack) once per blocked stretch; returns whether it is blocked."""
        if seconds >= BLOCKED_S and not reported:
            frame = sys._current_frames().get(ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
            text = f"{what} has not run for {seconds:.0f}s (blocking code on it?); it is at:\n{stack}"
            self.reports.append(text)
            log.warning("%s", text)
        return seconds >= BLOCKED_S

    def _watch(self):
        main_reported = False
        while not self.stop.wait(min(1.0, BLOCKED_S / 4)):
            main_reported = self._report("the driver's event loop (rollouts, engine calls, training)",
                                         time.monotonic() - self.tick, self.main_ident, main_reported)
            for t in list(self.agents.threads):
                t.reported = self._report(f"agent thread {t.thread.name}", t.blocked_for(), t.thread.ident, t.reported)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "reap":
        reaper_main(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit("usage: python faults.py reap RUN_ID DRIVER_PID")
