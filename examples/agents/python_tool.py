"""A multi-turn tool task: the model runs Python in a sandbox to answer a question.

Each turn the model either writes a snippet (a ```python fenced block, or
<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>) or gives
its final answer as <answer>N</answer>. A snippet runs in a fresh subprocess
(`run_python`) and its output comes back as the next observation; the reward is
1 for the right final answer within `max_turns`, else 0.

The sandbox, per snippet: `python -I` in an empty temporary directory with a
bare environment (no proxies, no PYTHON* variables); a wall-clock limit
(TIMEOUT_S, the whole process group is killed) and CPU-time and address-space
limits (setrlimit); no network: the child moves into a new network namespace
(unshare(CLONE_NEWNET), or with a user namespace where unprivileged), which has
no interfaces up, and `socket.socket` refuses to open sockets as a second line
where namespaces are not allowed. It is a guard against accidents, not a
security boundary for hostile code.

Needs a real chat model (the tiny default vocabulary has no letters):

    python main.py --agent examples/agents/python_tool.py --model PATH/TO/MODEL --max_len 2048
"""

import asyncio
import os
import random
import re
import signal
import sys
import tempfile
from pathlib import Path

from agent import Env, Result
from server import parse_tool_calls

TIMEOUT_S = 5.0
MEMORY_MB = 512
MAX_OUTPUT = 4000  # characters of output shown to the model

SYSTEM = ("You can run Python. To run code, write it in a ```python code block; you will see what "
          "it prints. When you know the answer, reply with <answer>NUMBER</answer> and nothing else.")

# Runs in the child (argv: memory bytes, CPU seconds) before the snippet: leave the
# network, cap memory and CPU time, refuse sockets. Limits are set here, not in a
# preexec_fn: Python code between fork and exec can deadlock in a threaded parent.
PRELUDE = r"""
import ctypes, resource, socket, sys
_libc = ctypes.CDLL(None, use_errno=True)
if _libc.unshare(0x40000000) != 0:                # CLONE_NEWNET (needs root)
    _libc.unshare(0x10000000 | 0x40000000)        # + CLONE_NEWUSER (unprivileged, where allowed)
for _limit, _value in ((resource.RLIMIT_AS, int(sys.argv[1])), (resource.RLIMIT_CPU, int(sys.argv[2]))):
    resource.setrlimit(_limit, (_value, _value))
class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise OSError("network access is disabled in this sandbox")
socket.socket = _NoSocket
sys.argv = ["snippet.py"]
del ctypes, resource, socket, _libc, _limit, _value, _NoSocket
exec(compile(open("snippet.py").read(), "snippet.py", "exec"), {"__name__": "__main__"})
"""


async def run_python(code: str, timeout: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> str:
    """Run `code` in the sandbox; returns its stdout and stderr (cut to MAX_OUTPUT) and a
    note if it was killed for time."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "snippet.py").write_text(code)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", PRELUDE, str(memory_mb * 2**20), str(int(timeout) + 1),
            cwd=tmp, env={"PATH": os.defpath, "LANG": "C.UTF-8"}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        out = bytearray()

        async def drain():
            while chunk := await proc.stdout.read(65536):
                out.extend(chunk[: max(0, 4 * MAX_OUTPUT - len(out))])  # keep reading, store a bounded prefix

        note = ""
        try:
            await asyncio.wait_for(drain(), timeout)
        except asyncio.TimeoutError:
            note = f"\n[killed: exceeded the {timeout:g} s time limit]"
        finally:
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the snippet's children too
                except ProcessLookupError:
                    pass
            await proc.wait()
    text = out.decode(errors="replace")
    if len(text) > MAX_OUTPUT:
        text = text[:MAX_OUTPUT] + "\n[output cut]"
    return text + note


def extract_code(reply: str) -> str | None:
    """The last ```python block, or the code of a python tool call; None if neither."""
    fenced = re.findall(r"```(?:python|py)?\s*\n(.*?)```", reply, re.DOTALL)
    if fenced:
        return fenced[-1]
    _, calls = parse_tool_calls(reply)
    for call in calls:
        if call["name"] == "python" and isinstance(call["arguments"], dict):
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
