"""A multi-turn tool task: the model runs Python in a sandbox to answer a question.

Each turn the model either writes a snippet (a ```python fenced block, or
<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>) or gives its final answer as
<answer>N</answer>. A snippet runs in a fresh subprocess (`run_python`) and its output comes back as the next
observation; the reward is 1 for the right final answer within `max_turns`, else 0.

The sandbox, per snippet (`run_python`; it raises SandboxError naming the cause, and never runs a snippet unconfined):
the program sandbox's (sandbox.py, bubblewrap) on a minimal root: the system's programs and libraries and the Python
install without its packages, read-only; its own /tmp and nothing else writable; no network at all; new PID, IPC and
UTS namespaces; a uid of its own (as root; else the caller's, in a user namespace), no capabilities, a session keyring
of its own; MEMORY_MB in a cgroup and per process, NPROC processes, NOFILE open files, 8 MB files, its CPU seconds.
What that guarantees and what it does not, with its cost: docs/agent.md, "The sandbox".

Needs a real chat model (the tiny default vocabulary has no letters):

    python main.py --agent examples/agents/python_tool.py --model PATH/TO/MODEL --max_len 2048
"""

import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile

import sandbox
from agent import Env, Result
from sandbox import SandboxError


TIMEOUT_S = 5.0
MEMORY_MB = 512
MAX_OUTPUT = 4000  # characters of output shown to the model
MAX_CODE = 128 * 1024   # bytes: one command-line argument holds less (MAX_ARG_STRLEN)

SYSTEM = ("You can run Python. To run code, write it in a ```python code block; you will see what "
          "it prints. When you know the answer, reply with <answer>NUMBER</answer> and nothing else.")
NPROC = 64   # processes per sandbox (RLIMIT_NPROC counts a uid's: one uid, or user namespace, per sandbox)
NOFILE = 256   # open files per process (RLIMIT_NOFILE; else each inherits the driver's, e.g. 20000: NPROC x that)
READY = "\0sandbox ready\n"   # written just before the snippet starts (none: set-up failed)
START = 'printf %s "$1" > /tmp/snippet.py && cd /tmp && exec "$2" -I snippet.py'   # the code, into its own /tmp


async def run_python(code: str, timeout: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> str:
    """Run `code` in the sandbox; returns its stdout and stderr (cut to MAX_OUTPUT) and a
    note if it was killed for time. Raises SandboxError if the sandbox cannot start or `code`
    cannot be passed to it (a NUL byte, MAX_CODE bytes or more: it goes on the command line)."""
    if "\0" in code or len(os.fsencode(code)) >= MAX_CODE:
        raise SandboxError(f"the snippet was not run: it has a NUL byte or {MAX_CODE} bytes or more")
    limits = {"MEMORY_MB": memory_mb, "NPROC": NPROC, "RLIMIT_NOFILE": NOFILE, "RLIMIT_AS": memory_mb * 2**20,
              "RLIMIT_FSIZE": 8 << 20, "RLIMIT_NPROC": NPROC}
    argv = ["/bin/sh", "-c", START, "sh", code, os.path.realpath(sys.executable)]
    with tempfile.TemporaryDirectory() as folder:
        async with sandbox.confine(argv, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, folder, timeout,
                                   at="/tmp/home", minimal=True, limits=limits, ready=READY) as (command, env):
            proc = await asyncio.create_subprocess_exec(
                *command, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            out = bytearray()

            async def drain():   # to EOF, whatever comes: a pipe left full would keep proc.wait() waiting
                while chunk := await proc.stdout.read(65536):
                    out.extend(chunk[: max(0, 4 * MAX_OUTPUT + len(READY) - len(out))])  # a bounded prefix

            note, reader = "", asyncio.ensure_future(drain())
            try:
                await asyncio.wait_for(asyncio.shield(reader), timeout)
            except BaseException as e:   # the time limit, or the episode cancelled: end the sandbox
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)   # bwrap: its death ends the PID namespace, and all of it
                if not isinstance(e, asyncio.TimeoutError):
                    raise
                note = f"\n[killed: exceeded the {timeout:g} s time limit]"
            finally:
                await reader
                await proc.wait()
    if not out.startswith(READY.encode()):
        raise SandboxError("the Python sandbox could not start, so the snippet did not run (it needs Linux "
                           "PID, mount and network namespaces: root, or unprivileged user namespaces): "
                           + out.decode(errors="replace").strip()[-600:])
    text = out[len(READY):].decode(errors="replace")
    if len(text) > MAX_OUTPUT:
        text = text[:MAX_OUTPUT] + "\n[output cut]"
    return text + note


def extract_code(reply: str) -> str | None:
    """The last ```python block, or the code of a python tool call; None if neither."""
    fenced = re.findall(r"```(?:python|py)?\s*\n(.*?)```", reply, re.DOTALL)
    if fenced:
        return fenced[-1]
    for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", reply, re.DOTALL):   # the Hermes format
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") == "python" and isinstance(call.get("arguments"), dict):
            return str(call["arguments"].get("code", ""))
    return None


def _question(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(2, 10), rng.randrange(20, 80)
        return f"What is the sum of the decimal digits of {a}**{b}?", sum(map(int, str(a ** b)))
    if kind == 1:
        n = rng.randrange(100, 5000)
        return f"How many prime numbers are smaller than {n}?", sum(
            all(p % d for d in range(2, int(p ** 0.5) + 1)) for p in range(2, n))
    a, b, m = rng.randrange(2, 1000), rng.randrange(10, 100), rng.randrange(7, 1000)
    return f"What is {a}**{b} modulo {m}?", pow(a, b, m)


class PythonTool(Env):
    max_turns = 4

    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            question, answer = _question(rng)
            yield {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                   "label": str(answer)}

    async def reset(self, row):
        self.runs = 0

    async def step(self, state):
        answer = re.search(r"<answer>\s*(.*?)\s*</answer>", state.action, re.DOTALL)
        if answer:
            return Result(reward=float(answer.group(1) == state.label), info={"code_runs": self.runs})
        code = extract_code(state.action)
        if code is None:  # neither code nor an answer: the episode is over
            return Result(reward=0.0, info={"code_runs": self.runs})
        self.runs += 1
        output = await run_python(code)
        return Result(reward=0.0, observation=f"Output:\n{output}", terminated=False,
                      info={"code_runs": self.runs})
