"""The program sandbox (sandbox.py, --program_sandbox on: the default): what a reward-seeking program, run through
the real programs.py and server.py (a fake engine), can no longer do. Each case is one a red-team did on the unconfined
programs (issue 47): write into the project checkout, read the driver's secrets, read another process's key from
/proc/*/environ, leave setsid or `env -i` children behind (after its rollout, or after kill -9 of the driver),
reach anything on the network but its own server."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import agent as agents
import programs
import sandbox
from fakes import check_token_exact, fake

ROOT = Path(__file__).resolve().parents[1]

ESCAPE = textwrap.dedent("""\
    import json, os, re, resource, socket, subprocess, sys, urllib.request
    row = json.loads(sys.stdin.readline())
    info = {}
    for i, path in enumerate(row["targets"]):   # the checkout, and a folder of the driver's /tmp
        try:
            open(path, "w").write("escaped")
            info[f"wrote{i}"] = 1
        except OSError:
            info[f"wrote{i}"] = 0
    info["secret"] = float("MOLT_TEST_SECRET" in os.environ)
    info["urls"] = float(os.environ["ANTHROPIC_BASE_URL"] + "/v1" == os.environ["OPENAI_BASE_URL"])   # each its own
    info["passed"] = float(os.environ.get("MOLT_TEST_PASSED") == "yes")
    keys = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            keys |= set(re.findall(rb"OPENAI_API_KEY=([^\\0]*)", open(f"/proc/{pid}/environ", "rb").read()))
        except OSError:
            pass
    info["other_keys"] = len(keys - {os.environ["OPENAI_API_KEY"].encode()})
    s = socket.socket()
    s.settimeout(5)
    info["other_port"] = float(s.connect_ex(("127.0.0.1", row["port"])) == 0)
    info["uid"], info["nofile"] = os.getuid(), resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    info["nproc"] = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    sleep = [sys.executable, "-c", "import time; time.sleep(300)", row["marker"]]
    subprocess.Popen(["setsid", *sleep], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.Popen(["env", "-i", "setsid", *sleep], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "1?2="}]}).encode(), {"Authorization": "Bearer "
        + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    said = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
    print(json.dumps({"reward": float(said == "7"), "info": info}))
""")


def marked(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if marker in (p.info["cmdline"] or []):
            found.append(p)
    return found


def survivors(marker: str, seconds: float) -> list[list[str]]:
    """The command lines of processes still carrying `marker` after waiting up to `seconds` for them to end."""
    deadline = time.monotonic() + seconds
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p.cmdline() for p in left]


def test_a_sandboxed_program_cannot_escape_its_rollout(tmp_path, server, loop, tiny_tokenizer, monkeypatch):
    program = tmp_path / "escape.py"
    program.write_text(ESCAPE)
    targets = [ROOT / f"escaped-{secrets.token_hex(4)}.txt", tmp_path / "escaped.txt"]
    marker = f"molt-test-{secrets.token_hex(4)}"
    monkeypatch.setenv("MOLT_TEST_SECRET", "the driver's")
    monkeypatch.setenv("MOLT_TEST_PASSED", "yes")
    (longer := tmp_path / ("t" * 64)).mkdir()   # the rollout's folder and its relay's socket in a long TMPDIR
    monkeypatch.setattr(tempfile, "tempdir", str(longer))
    listener = socket.create_server(("127.0.0.1", 0))   # a service of the driver's (Ray's dashboard, say)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              env={**os.environ, "OPENAI_API_KEY": "another-rollout-s-key"})
    row = {"prompt": "1?2=", "targets": [str(t) for t in targets], "port": listener.getsockname()[1], "marker": marker}
    try:
        rec = fake(tiny_tokenizer, ["7"])
        segs = loop.run_until_complete(agents.run_chat_agent(
            programs.program(f"{sys.executable} {program}", 60, env=["MOLT_TEST_PASSED"])(), row, rec, tiny_tokenizer,
            server, sampling={"temperature": 1.0, "max_tokens": 4}, max_len=128))
        left = survivors(marker, 10)
    finally:
        victim.kill()
        listener.close()
        for t in targets:
            t.unlink(missing_ok=True)
        for p in marked(marker):
            p.kill()
    info = segs[0].info
    assert segs[0].reward == 1.0 and len(rec.calls) == 1   # its own server, through the relay, token-exact
    check_token_exact(segs, rec.calls)
    assert (info["wrote0"], info["wrote1"]) == (0, 0) and not any(t.exists() for t in targets)
    assert info["urls"] == 1 and info["secret"] == 0 and info["passed"] == 1   # an allow-list, and what --program_env names
    assert info["other_keys"] == 0 and info["other_port"] == 0
    assert info["nofile"] == sandbox.NOFILE
    if os.geteuid() == 0:   # a uid of its own, its processes counted apart
        assert info["uid"] >= sandbox.UIDS and info["nproc"] == sandbox.NPROC
    assert not left   # its setsid and `env -i` children ended with the rollout


DRIVER = textwrap.dedent("""\
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    import programs
    program = ["sh", "-c", f"setsid sleep 300 & env -i setsid {sys.executable} -c 'import time; time.sleep(300)' "
               f"{sys.argv[2]} & exec {sys.executable} -c 'import time; time.sleep(300)' {sys.argv[2]}"]
    env = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "k"}
    asyncio.run(programs.run_process(program, {}, env, 300))
""")


def test_kill_9_of_the_driver_ends_its_sandboxes_and_the_next_start_up_its_folders():
    """No reaper here: the sandbox itself ends with its driver (bwrap --die-with-parent, then the PID namespace); the
    folder it cannot remove goes at the next start-up, and a live driver's folder stays."""
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))   # the drivers' folders, and only theirs, here (short: a socket's path)
    env = {**os.environ, "TMPDIR": str(tmp)}
    killed, live = (f"molt-test-{secrets.token_hex(4)}" for _ in range(2))
    drivers = {}
    (tmp / "molt-program-1-4194305-elsewhere").mkdir()   # another PID namespace's: its pid not looked up, kept
    try:
        for marker in (live, killed):
            drivers[marker] = subprocess.Popen([sys.executable, "-c", DRIVER, str(ROOT), marker], cwd=tmp, env=env)
            deadline = time.monotonic() + 60
            while len(marked(marker)) < 2:
                assert drivers[marker].poll() is None and time.monotonic() < deadline, "the program did not start"
                time.sleep(0.1)
            if marker == live:
                kept = set(tmp.iterdir())
        drivers[killed].kill()
        drivers[killed].wait()
        assert not survivors(killed, 10) and marked(live)
        assert len(set(tmp.iterdir()) - kept) == 1   # the killed driver's folder, left
        subprocess.run([sys.executable, "-c", "import programs; programs.check_sandbox()"], cwd=ROOT, env=env, check=True)
        assert set(tmp.iterdir()) == kept   # the next start-up removed it (and its own), not the live one's
    finally:
        for driver in drivers.values():
            driver.kill()
        for p in marked(killed) + marked(live):
            p.kill()
        shutil.rmtree(tmp)


def test_sandbox_flags_fail_fast(tmp_path, tiny_model, capsys, monkeypatch):
    import main
    with pytest.raises(ValueError, match="--program_env MOLT_NOT_SET: not set here"):
        programs.program("true", 10, env=["MOLT_NOT_SET"])
    assert programs.program("true", 10, env=["A=b=c"]).env == {"A": "b=c"}
    monkeypatch.chdir(ROOT)   # a file named from here is found from the program's own folder too
    assert programs.program("python examples/programs/running_max.py", 10).argv == [
        "python", str(ROOT / "examples" / "programs" / "running_max.py")]
    monkeypatch.setattr(sandbox, "bwrap", lambda: "/no/such/bwrap")
    with pytest.raises(ValueError, match="--program_sandbox on: .*no/such/bwrap"):
        programs.program("true", 10)
    programs.program("true", 10, confined=False)   # off: nothing to check
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1"}\n')
    main.validate(vars(main.build_parser().parse_args(["--model", tiny_model, "--dataset", str(data), "--agent_cmd",
                                                       "true", "--program_sandbox", "off"])))
    assert "--program_sandbox off: each program runs as this user" in capsys.readouterr().err
