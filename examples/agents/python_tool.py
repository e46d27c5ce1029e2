"""A multi-turn tool task: the model runs Python in a sandbox to answer a question.

Each turn the model either writes a snippet (a ```python fenced block, or
<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>) or gives
its final answer as <answer>N</answer>. A snippet runs in a fresh subprocess
(`run_python`) and its output comes back as the next observation; the reward is
1 for the right final answer within `max_turns`, else 0.

The sandbox, per snippet (`run_python`; it raises SandboxError naming the cause, and never
runs a snippet unconfined, where Linux namespaces or util-linux `unshare` are missing): new PID,
mount, network, IPC and UTS namespaces; a launcher (PID 1) joins the sandbox's cgroups, chroots
into a 16 MB tmpfs of read-only binds (/usr, the Python install less site-packages, a few /dev
nodes) and forks the snippet under a uid of its own (as root; else in a user namespace), with no
capabilities, no_new_privs, a fresh session keyring and rlimits. What that guarantees and what it
does not, with its cost: docs/agent.md, "The sandbox".

Needs a real chat model (the tiny default vocabulary has no letters):

    python main.py --agent examples/agents/python_tool.py --model PATH/TO/MODEL --max_len 2048
"""

import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import sys
import tempfile
import warnings
from pathlib import Path

from agent import Env, Result
from faults import TAG


TIMEOUT_S = 5.0
MEMORY_MB = 512
MAX_OUTPUT = 4000  # characters of output shown to the model
MAX_CODE = 128 * 1024   # bytes: one command-line argument holds less (MAX_ARG_STRLEN)

SYSTEM = ("You can run Python. To run code, write it in a ```python code block; you will see what "
          "it prints. When you know the answer, reply with <answer>NUMBER</answer> and nothing else.")
UIDS = 2**31   # the snippet runs as UIDS + a random number (when the trainer is root)
NPROC = 64   # processes per sandbox (RLIMIT_NPROC counts a uid's: one uid, or user namespace, per sandbox)
NOFILE = 256   # open files per process (RLIMIT_NOFILE; else each inherits the driver's, e.g. 20000: NPROC x that)
KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219}   # the keyctl syscall's number (else: refused)
READY = b"\0sandbox ready\n"   # written just before the snippet starts (none: set-up failed)

# The launcher: PID 1 of the new namespaces (argv: root folder, code, memory bytes, CPU
# seconds). Its exit takes every process of the PID namespace with it.
LAUNCHER = r"""
import ctypes, os, resource, signal, sys
root, code, memory, cpu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGALRM, lambda *_: os._exit(137))   # a handler: PID 1 ignores default-action signals
signal.alarm(cpu + 1)   # the wall-clock bound holds without the driver (killed, or gone)
# into the sandbox's cgroups (memory, processes: for all it will start); the OOM killer takes it first
for path, value in [(group + "/cgroup.procs", "0") for group in GROUPS] + [("/proc/self/oom_score_adj", "1000")]:
    with open(path, "w") as f:
        f.write(value)
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
KEEP = NOSUID | NODEV | 8 | 1024 | 2048 | 4096   # + noexec, noatime, nodiratime, relatime (locked in a user namespace)

def mount(src, dst, fstype, flags, opts=None):
    arg = lambda s: s.encode() if s else None
    if libc.mount(arg(src), arg(dst), arg(fstype), flags, arg(opts)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {src} on {dst}: {os.strerror(ctypes.get_errno())}")

def bind(path, writable=False):
    inside = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        return os.symlink(os.readlink(path), inside)
    if os.path.isdir(path):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        open(inside, "w").close()
    mount(path, inside, None, BIND | REC)
    if not writable:
        mount(None, inside, None, REMOUNT | BIND | RDONLY | (os.statvfs(path).f_flag & KEEP))

mount(None, "/", None, REC | PRIVATE)
mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=16m,mode=755")
prefix = sys.base_prefix
site = os.path.join(prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
for path in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/ld.so.cache", prefix):
    if os.path.lexists(path) and not os.path.exists(root + path):
        bind(path)
if os.path.isdir(site):   # installed packages (and whatever a package ships) stay out of sight
    mount("tmpfs", root + site, "tmpfs", RDONLY | NOSUID | NODEV, "size=4k")
for dev in ("null", "zero", "urandom", "random"):
    bind("/dev/" + dev, writable=True)
os.makedirs(root + "/tmp", mode=0o1777)
os.chmod(root + "/tmp", 0o1777)
with open(root + "/tmp/snippet.py", "w") as f:
    f.write(code)
os.chroot(root)
os.chdir("/tmp")
child = os.fork()
if child == 0:
    try:
        os.setsid()   # its own process group: kill(0) from the snippet stays inside
        limits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 8 << 20),
                  (resource.RLIMIT_NPROC, NPROC), (resource.RLIMIT_NOFILE, NOFILE)]
        for limit, value in limits:
            resource.setrlimit(limit, (value, value))
        for cap in range(64):   # an empty bounding set: nothing regains a capability at exec
            if libc.prctl(24, cap, 0, 0, 0) != 0:   # PR_CAPBSET_DROP; EINVAL past the last capability
                if ctypes.get_errno() != 22 or cap == 0:
                    raise OSError(ctypes.get_errno(), f"cannot drop capability {cap}")
                break
        if not in_userns:
            os.setgroups([])
            os.setgid(UID)
            os.setuid(UID)
        if libc.syscall(KEYCTL, 1, None) < 0:   # KEYCTL_JOIN_SESSION_KEYRING: a new, empty one
            raise OSError(ctypes.get_errno(), "cannot give the snippet a session keyring of its own")
        if libc.prctl(38, 1, 0, 0, 0) != 0:   # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "cannot set no_new_privs")
        os.write(1, READY)   # set up: what follows is the snippet's
        os.execve(sys.executable, [sys.executable, "-I", "snippet.py"], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                  "HOME": "/tmp", **{k: v for k, v in os.environ.items() if k == TAG}})   # the run's tag
    except BaseException as e:
        os.write(1, f"sandbox set-up failed: {e!r}\n".encode())
    os._exit(127)
_, status = os.waitpid(child, 0)
if os.WIFSIGNALED(status):   # e.g. SIGKILL from the OOM killer: the memory limit
    os.write(1, f"\n[killed by {signal.Signals(os.WTERMSIG(status)).name}]".encode())
os._exit(os.waitstatus_to_exitcode(status) & 255)
"""


class SandboxError(RuntimeError):
    """The sandbox could not be set up: the snippet did not run."""


def sandbox_command(timeout: float, memory_mb: int, root: str, code: str, groups: list[str] = ()) -> list[str]:
    """`unshare` and the launcher (a non-root caller: in a user namespace, as root there to mount)."""
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    uid = UIDS + secrets.randbelow(2**30)   # its own uid: user keyring and process count not shared
    launcher = (f"UID, READY, in_userns, TAG, GROUPS, NPROC, NOFILE, KEYCTL = {uid}, {READY!r}, {bool(userns)}, "
                f"{TAG!r}, {groups!r}, {NPROC}, {NOFILE}, {KEYCTL.get(os.uname().machine, -1)}\n" + LAUNCHER)
    return ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc", "--uts", *userns,
            os.path.realpath(sys.executable), "-I", "-c", launcher, root, code, str(memory_mb * 2**20),
            str(int(timeout) + 1)]


def sandbox_cgroups(memory_mb: int) -> list[str]:
    """New memory and pids cgroups for one sandbox, under this process's own (cgroup v2, or v1's two
    hierarchies); [] where it may not make them (then rlimits alone bound it: see the docstring)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():   # "id:controllers:path"
        _, names, path = line.split(":", 2)
        own.update(dict.fromkeys(names.split(","), path))
    name, memory = f"molt-sandbox-{os.getpid()}-{secrets.token_hex(8)}", memory_mb * 2**20
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):   # v2: one folder, both limits
        limits = {f"/sys/fs/cgroup{own.get('')}/{name}": {"memory.max": memory, "pids.max": NPROC + 1}}
    else:   # the memory limit counts shared memory (memfd, tmpfs) too; + 1: the launcher
        limits = {f"/sys/fs/cgroup/memory{own.get('memory')}/{name}": {"memory.limit_in_bytes": memory},
                  f"/sys/fs/cgroup/pids{own.get('pids')}/{name}": {"pids.max": NPROC + 1}}
    made = []
    try:
        for folder, values in limits.items():
            for stale in Path(folder).parent.glob("molt-sandbox-*"):   # left by a driver that was killed
                if not Path("/proc", stale.name.split("-")[2]).exists():
                    with contextlib.suppress(OSError):
                        stale.rmdir()
            os.mkdir(folder)
            made.append(folder)
            for file, value in values.items():
                Path(folder, file).write_text(str(value))
        return made
    except OSError as e:
        for folder in made:
            os.rmdir(folder)
        warnings.warn(f"the Python sandbox gets no cgroup ({e}): its memory is capped per process only")
        return []


async def remove_cgroups(groups: list[str]):
    for folder in groups:
        for _ in range(200):   # a killed namespace's processes take a moment to leave
            with contextlib.suppress(OSError):
                os.rmdir(folder)
                break
            await asyncio.sleep(0.01)


async def run_python(code: str, timeout: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> str:
    """Run `code` in the sandbox; returns its stdout and stderr (cut to MAX_OUTPUT) and a
    note if it was killed for time. Raises SandboxError if the sandbox cannot start or `code`
    cannot be passed to it (a NUL byte, MAX_CODE bytes or more: it goes on the command line)."""
    if "\0" in code or len(os.fsencode(code)) >= MAX_CODE:
        raise SandboxError(f"the snippet was not run: it has a NUL byte or {MAX_CODE} bytes or more")
    groups, tag = sandbox_cgroups(memory_mb), {k: v for k, v in os.environ.items() if k == TAG}   # for the reaper
    with tempfile.TemporaryDirectory() as root:   # only a mount point: the tmpfs lives in the namespace
        try:
            proc = await asyncio.create_subprocess_exec(
                *sandbox_command(timeout, memory_mb, root, code, groups),
                env={"PATH": os.defpath, "LANG": "C.UTF-8", **tag}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except FileNotFoundError as e:
            await remove_cgroups(groups)
            raise SandboxError(f"the Python sandbox needs util-linux `unshare` ({e})") from None
        out = bytearray()

        async def drain():   # to EOF, whatever comes: a pipe left full would keep proc.wait() waiting
            while chunk := await proc.stdout.read(65536):
                out.extend(chunk[: max(0, 4 * MAX_OUTPUT + len(READY) - len(out))])  # a bounded prefix

        note, reader = "", asyncio.ensure_future(drain())
        try:
            await asyncio.wait_for(asyncio.shield(reader), timeout)
        except BaseException as e:   # the time limit, or the episode cancelled: end the namespace
            with contextlib.suppress(ProcessLookupError):
                proc.kill()   # unshare: its death kills the launcher, and the launcher's every process
            if not isinstance(e, asyncio.TimeoutError):
                raise
            note = f"\n[killed: exceeded the {timeout:g} s time limit]"
        finally:   # after EOF unshare ends by itself (a kill then would race asyncio's own wait)
            await reader
            await proc.wait()
            await remove_cgroups(groups)
    if not out.startswith(READY):
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
