"""The program sandbox (sandbox.py), measured: its cost per rollout, and what its rollouts leave behind.

- start+teardown: a `true` program through agent.run_process (with its relay), sandboxed against unconfined (the
  baseline, same run), one rollout at a time: ms per rollout (target under 100 ms);
- leftovers: 64 concurrent sandboxed programs, each writing files and starting three `setsid sleep` children;
  processes (those carrying this run's marker), mounts (/proc/mounts lines) and rollout folders left, against the
  counts before: after their rollouts (and the same programs unconfined), after SIGINT of a driver process running
  them, after its kill -9 (its folders then go at the next start-up: a new process's first rollout, sandbox.sweep).

    flock /tmp/molt.lock python bench/sandbox.py     # no arguments; ~25 s on 2 CPU cores
"""

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import agent  # noqa: E402

N, CONCURRENT = 20, 64
ENV = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "k"}   # a relay per rollout, as in training


def program(mark: str, hold: str) -> list[str]:
    """Files written, three setsid children (not on its pipes: unconfined, they would hold its rollout open)."""
    return ["sh", "-c", f"for i in $(seq 50); do echo $i > file$i; echo $i > /tmp/file$i; done; "
            f"for i in 1 2 3; do setsid sleep {mark} >/dev/null 2>&1 & done; sleep {hold}"]


async def rollouts(mark: str, hold: str, confined: bool = True):
    await asyncio.gather(*[agent.run_process(program(mark, hold), {}, ENV, 600, confined) for _ in range(CONCURRENT)])


async def cost(confined: bool) -> float:
    """ms per rollout of `true`, after one not counted (this process's first: the sweep, bwrap's pages read)."""
    await agent.run_process(["true"], {}, ENV, 30, confined)
    start = time.perf_counter()
    for _ in range(N):
        _, err, failed, _ = await agent.run_process(["true"], {}, ENV, 30, confined)
        assert not failed, (failed, err.tail)
    return (time.perf_counter() - start) / N * 1000


def left(mark: str, mounts: int, wait_s: float = 10) -> tuple[int, int, int]:
    """(processes, mounts, folders) left, after waiting up to `wait_s` for the processes to end."""
    deadline = time.monotonic() + wait_s
    while (procs := [p for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or [])]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:   # the unconfined baseline's setsid children: not to outlive the bench
        p.kill()
    return (len(procs), len(Path("/proc/mounts").read_text().splitlines()) - mounts,
            len(list(Path(tempfile.gettempdir()).glob("molt-program-*"))))


def driven(mark: str, stop) -> subprocess.Popen:
    """A driver process running the rollouts (this file, `mark` as its argument), stopped by `stop` once all run."""
    driver = subprocess.Popen([sys.executable, __file__, mark], stderr=subprocess.DEVNULL)   # SIGINT's traceback
    while sum(p.info["cmdline"] == ["sleep", mark] for p in psutil.process_iter(["cmdline"])) < 3 * CONCURRENT:
        assert driver.poll() is None, "the driver ended before its programs started"
        time.sleep(0.2)
    stop(driver)
    driver.wait()
    return driver


def main():
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="molt-bench-")   # the folders counted: only this bench's
    tempfile.tempdir = None
    mounts = len(Path("/proc/mounts").read_text().splitlines())
    confined, unconfined = asyncio.run(cost(True)), asyncio.run(cost(False))
    print(f"start+teardown per rollout (`true`, {N} each): sandboxed {confined:.1f} ms, unconfined {unconfined:.1f} ms "
          f"({confined / unconfined:.0f}x); target < 100 ms: {'met' if confined < 100 else 'MISSED'}")
    # `sleep` durations of this run's own: how its processes are found
    mark, other = (f"{300 + secrets.randbelow(10**6) / 10**6:.6f}" for _ in range(2))
    start = time.perf_counter()
    asyncio.run(rollouts(mark, "1"))
    seconds, sandboxed = time.perf_counter() - start, left(mark, mounts)
    asyncio.run(rollouts(other, "1", confined=False))
    print(f"{CONCURRENT} concurrent sandboxed programs, after their rollouts ({seconds:.1f} s): processes, mounts, "
          f"folders left {sandboxed} (unconfined: {left(other, mounts, 0)})")
    driven(mark, lambda d: d.send_signal(signal.SIGINT))
    print(f"after SIGINT of their driver: processes, mounts, folders left {left(mark, mounts)}")
    driven(mark, lambda d: d.kill())
    after = left(mark, mounts)
    subprocess.run([sys.executable, "-c", "import agent; agent.check_sandbox()"], cwd=ROOT, check=True)
    print(f"after kill -9 of their driver: processes, mounts, folders left {after}; after the next start-up: "
          f"{left(mark, mounts)}")
    os.rmdir(os.environ["TMPDIR"])


if __name__ == "__main__":
    if len(sys.argv) > 1:   # the driver process of `driven`
        asyncio.run(rollouts(sys.argv[1], "300"))
    else:
        main()
