"""Agents as programs (--agent_cmd): a process per rollout, its contract, its failures, its keys.

The real harnesses (Python on the stock OpenAI SDK streamed, bash with curl, Node.js on the `openai`
npm package) run against one real vLLM engine on the tiny model (one engine and one event loop for
the module) and train token-exactly; the contract's edges use a fake engine; one real run through
main.py counts drops and evaluates programs, one is killed with -9 and leaves no program behind."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agent as agents
import programs
from fakes import Recorder, check_token_exact, fake
from trajectory import DropRollout

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "examples" / "programs"
SAMPLING = {"temperature": 1.0, "max_tokens": 4}


def rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of the running-max task (examples/agents/chat_openai.py's prompts)."""
    src = agents.load_agent(str(ROOT / "examples" / "agents" / "chat_openai.py")).prompts(seed)
    return [next(src) for _ in range(n)]


def run_program(cmd: str, row: dict, generate, tokenizer, server, loop, timeout: float = 60.0, max_len: int = 128,
                **options):
    """One rollout of `cmd` (`options`: programs.program's); `confined=False` for the contract's tests that look at it
    from this side (its pids, files it writes here): the sandbox's own tests are tests/test_sandbox.py."""
    sampling = SAMPLING if max_len <= 128 else {**SAMPLING, "max_tokens": 64}
    return loop.run_until_complete(agents.run_chat_agent(programs.program(cmd, timeout, **options)(), row,
                                                         generate, tokenizer, server, sampling=sampling, max_len=max_len))


# ----------------------------------------------------------- real harnesses, real engine

HARNESSES = {"python": (f"{sys.executable} {PROGRAMS / 'running_max.py'}", 2),
             "bash": (str(PROGRAMS / "running_max.sh"), 1),
             "node": (f"node {PROGRAMS / 'running_max.mjs'}", 2)}


@pytest.mark.parametrize("name", HARNESSES)
def test_harnesses_train_token_exactly(name, engine, server, loop, tiny_tokenizer):
    """Each program's requests are one token-exact trace of the engine's own ids (streamed in Python
    and Node), and the reward it prints is the rollout's; concurrent rollouts do not mix."""
    cmd, turns = HARNESSES[name]
    if name == "node" and not (PROGRAMS / "node_modules" / "openai").is_dir():
        pytest.fail("the `openai` npm package is missing: run `bash install.sh` (it runs npm install)")
    batch = rows(3, seed=hash(name) % 100)
    recs = [Recorder(engine.generate) for _ in batch]

    async def all_of_them():
        return await asyncio.gather(*[agents.run_chat_agent(programs.program(cmd, 60)(), row, rec, tiny_tokenizer,
                                                            server, sampling=SAMPLING, max_len=128)
                                      for row, rec in zip(batch, recs)])
    for row, rec, segs in zip(batch, recs, loop.run_until_complete(all_of_them())):
        assert len(segs) == 1 and len(rec.calls) == turns
        check_token_exact(segs, rec.calls)
        assert tiny_tokenizer.decode(segs[0].tokens).startswith(f"<|user|>{row['prompt']}<|end|><|assistant|>")
        replies = [tiny_tokenizer.decode(out["token_ids"], skip_special_tokens=True) for _, out in rec.calls]
        finished = rec.calls[-1][1]["finish_reason"] == "stop"
        if turns == 2:
            assert f"<|user|>{row['label']['follow_up']}<|end|><|assistant|>" in tiny_tokenizer.decode(segs[0].tokens)
            assert segs[0].reward == float(replies[1] == row["label"]["answer"] and finished)
            assert segs[0].info["first_right"] == float(replies[0] == row["label"]["first"])
        else:
            assert segs[0].reward == float(replies[0] == row["label"]["first"] and finished)
    assert not server.sessions


MINI = f"{sys.executable} {PROGRAMS / 'mini_swe_agent.py'}"
TASK = {"prompt": "Create a file named answer.txt that contains the word hello.",
        "label": {"file": "answer.txt", "content": "hello"}}


def test_mini_swe_agent_runs_as_it_ships_and_its_work_is_checked(server, loop, monkeypatch):
    """mini-swe-agent's `mini` CLI, pointed at the server by environment variables only, runs the commands the
    policy calls (vLLM's hermes parser) in the rollout's folder: a policy that does the task gets reward 1."""
    from _smollm import smol_tokenizer
    tok = smol_tokenizer()
    monkeypatch.setenv("MINI_STEPS", "3")
    call = '<tool_call>{{"name": "bash", "arguments": {{"command": "{}"}}}}</tool_call>'
    rec = fake(tok, [call.format("echo hello > answer.txt"), call.format("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    segs = run_program(MINI, TASK, rec, tok, server, loop, timeout=120, max_len=4096, env=["MINI_STEPS"])
    assert len(rec.calls) == 2 and segs[0].reward == 1.0 and segs[0].info["mini_exit"] == 0
    check_token_exact(segs, rec.calls)
    assert "Create a file named answer.txt" in tok.decode(rec.calls[0][0])
    assert '"returncode": 0' in tok.decode(rec.calls[1][0][len(rec.calls[0][0]):])   # the command's result came back


def test_mini_swe_agent_trains_token_exactly_on_smollm2(server, loop, monkeypatch):
    """The same on the real engine (SmolLM2-135M-Instruct, which does not solve it): every request of the
    rollout is in its token-exact segments, and the reward is the check's."""
    import data
    import main
    from generator import Generator
    from transformers import AutoTokenizer
    model = data.resolve_model("smollm2", main.cache_dir(), say=lambda m: None)
    tok = AutoTokenizer.from_pretrained(model)
    monkeypatch.setenv("MINI_STEPS", "2")

    async def make():
        return Generator(model, max_len=4096, seed=0)
    gen = loop.run_until_complete(make())
    try:
        rec = Recorder(gen.generate)
        segs = loop.run_until_complete(agents.run_chat_agent(
            programs.program(MINI, 240, env=["MINI_STEPS"])(), TASK, rec, tok, server, sampling={"temperature": 1.0, "max_tokens": 48},
            max_len=4096))
    finally:
        gen.shutdown()
    assert len(rec.calls) == 2 and segs[0].info["requests"] == 2 and segs[0].reward in (0.0, 1.0)
    check_token_exact(segs, rec.calls)


# ----------------------------------------------------------- the contract, fake engine

def script(tmp_path: Path, name: str, body: str) -> str:
    """A Python program from its body (the row is `row`); returns its command."""
    path = tmp_path / f"{name}.py"
    path.write_text("import json, os, sys, time, urllib.request\nrow = json.loads(sys.stdin.readline() or '{}')\n"
                    + body)
    return f"{sys.executable} {path}"


ASK = ("def ask():\n    req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', "
       "json.dumps({'messages': [{'role': 'user', 'content': row['prompt']}]}).encode(), "
       "{'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
       "    return json.load(urllib.request.urlopen(req))['choices'][0]['message']['content']\n")


def test_a_program_gets_its_row_key_and_own_folder_and_group(tmp_path, server, loop, tiny_tokenizer):
    """The row on stdin, the server's URLs and a fresh key per rollout in the environment (the same key in
    both APIs' variables), its own process group in a fresh folder removed after; `info` is logged."""
    report = tmp_path / "report"
    report.mkdir()
    cmd = script(tmp_path, "contract", ASK + (
        "said = ask()\nopen(os.path.join(row['report'], row['prompt']), 'w').write(json.dumps({"
        "'row': row, 'env': {k: v for k, v in os.environ.items() if k.startswith(('OPENAI', 'ANTHROPIC', 'MOLT'))}, "
        "'cwd': os.getcwd(), 'files': os.listdir('.'), 'group': os.getpgid(0) == os.getpid()}))\n"
        "print('some log line')\nprint(json.dumps({'reward': 0.5, 'info': {'said': len(said), 'ok': True}}))\n"))
    got = []
    for prompt in ("1?2=", "3?4="):
        rec = fake(tiny_tokenizer, ["7"])
        row = {"prompt": prompt, "label": None, "report": str(report), "extra": [1, {"x": "y"}]}
        got.append((row, run_program(cmd, row, rec, tiny_tokenizer, server, loop, confined=False), rec))
    seen = [json.loads((report / row["prompt"]).read_text()) for row, _, _ in got]
    for (row, segs, rec), r in zip(got, seen):
        assert r["row"] == row and r["files"] == [] and r["group"]
        assert not Path(r["cwd"]).exists() and Path(r["cwd"]).parent.name.startswith("molt-program-")
        env = r["env"]
        assert env["OPENAI_BASE_URL"].startswith(server.url + "/s/") and env["OPENAI_BASE_URL"].endswith("/v1")
        assert env["ANTHROPIC_BASE_URL"] + "/v1" == env["OPENAI_BASE_URL"]
        assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] and len(env["OPENAI_API_KEY"]) >= 32
        assert segs[0].reward == 0.5 and segs[0].info["said"] == 1.0 and segs[0].info["ok"] == 1.0
        check_token_exact(segs, rec.calls)
    assert seen[0]["env"]["OPENAI_API_KEY"] != seen[1]["env"]["OPENAI_API_KEY"]
    assert seen[0]["env"]["OPENAI_BASE_URL"] != seen[1]["env"]["OPENAI_BASE_URL"]


BAD = {  # body -> (reason, words of the message)
    "sys.stderr.write('boom\\n'); sys.exit(3)": ("exit", "exited with 3"),
    "print('hello')": ("no_reward", "printed no reward"),
    "print('{\"reward\": 1')": ("no_reward", "printed no reward"),
    "print('{\"reward\": 1}'); print('bye')": ("no_reward", "a reward line came earlier"),
    "print('{\"reward\": 1}'); print('{\"reward\": 0}')": ("bad_reward", "2 reward lines"),
    "print('{\"reward\": NaN}')": ("bad_reward", "finite"),
    "print('{\"reward\": Infinity}')": ("bad_reward", "finite"),
    "print('{\"reward\": \"1\"}')": ("bad_reward", "finite"),
    "print('{\"reward\": true}')": ("bad_reward", "finite"),
    "print('{\"reward\": 1, \"info\": {\"a\": \"x\"}}')": ("bad_reward", "info"),
    "os.kill(os.getpid(), 9)": ("exit", "exited with -9"),
    "print('{\"reward\": ' + '[' * 100000 + ']' * 100000 + '}')": ("no_reward", "printed no reward"),   # too deep
    "print('[' * 100000 + '\"reward\"' + ']' * 100000)": ("no_reward", "printed no reward"),
}


def test_a_failing_program_is_a_drop_with_its_reason_and_stderr(tmp_path, server, loop, tiny_tokenizer):
    for i, (body, (reason, words)) in enumerate(BAD.items()):
        cmd = script(tmp_path, f"bad{i}", ASK + "ask()\nsys.stderr.write('the tail\\n')\n" + body + "\n")
        with pytest.raises(DropRollout) as e:
            run_program(cmd, {"prompt": "1?2="}, fake(tiny_tokenizer, ["7"]), tiny_tokenizer, server, loop, confined=False)
        assert e.value.reason == reason and words in str(e.value), (body, e.value.reason, str(e.value))
        assert "the tail" in str(e.value) and str(e.value).splitlines()[-1].startswith("--agent_cmd ")
    assert not server.sessions
    # a program that asks nothing has nothing to train on: dropped as an error, with what it said (no traceback)
    with pytest.raises(DropRollout) as e:
        run_program(script(tmp_path, "silent", "sys.stderr.write('400 tools are not supported\\n')\n"
                           "print('{\"reward\": 1}')\n"), {"prompt": "1"}, fake(tiny_tokenizer, []),
                    tiny_tokenizer, server, loop)
    assert e.value.reason == "error" and str(e.value).startswith("400 tools are not supported\n--agent_cmd ")
    assert "made no model request" in str(e.value)
    # one whose every request the server refused: the drop names those answers (issue 46 item 9)
    refused = script(tmp_path, "refused", "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + "
                     "'/chat/completions', b'{\"messages\": []}', {'Authorization': 'Bearer ' + "
                     "os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\ntry:\n"
                     "    urllib.request.urlopen(req)\nexcept OSError:\n    pass\nprint('{\"reward\": 1}')\n")
    with pytest.raises(DropRollout) as e:
        run_program(refused, {"prompt": "1"}, fake(tiny_tokenizer, []), tiny_tokenizer, server, loop, confined=False)
    assert e.value.reason == "error" and "; the server answered 400 " in str(e.value), str(e.value)


def test_a_hanging_or_flooding_program_is_killed_with_its_whole_group(tmp_path, server, loop, tiny_tokenizer,
                                                                      monkeypatch):
    """Past its timeout the program and every process of its group are killed (a child that ignores
    SIGTERM too); a flood of output is cut at MAX_OUTPUT, never a hang or unbounded memory."""
    pids = tmp_path / "pids"
    hang = script(tmp_path, "hang", (
        "import subprocess, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\nsys.stderr.write('waiting\\n')\n"
        "sys.stderr.flush()\ntime.sleep(600)\n"))
    t0 = time.monotonic()
    with pytest.raises(DropRollout) as e:
        run_program(hang, {"prompt": "1"}, fake(tiny_tokenizer, []), tiny_tokenizer, server, loop, timeout=2.0,
                    confined=False)
    assert e.value.reason == "timeout" and "waiting" in str(e.value) and time.monotonic() - t0 < 30
    for pid in map(int, pids.read_text().split()):
        wait_gone(pid, 5)
    monkeypatch.setattr(programs, "MAX_OUTPUT", 2**20)
    flood = script(tmp_path, "flood", "while True:\n    sys.stdout.write('x' * 4096 + '\\n')\n")
    with pytest.raises(DropRollout) as e:
        run_program(flood, {"prompt": "1"}, fake(tiny_tokenizer, []), tiny_tokenizer, server, loop, timeout=60)
    assert e.value.reason == "flood" and "1 MiB" in str(e.value)


def test_a_remote_program_s_failure_is_its_rollout_s_drop_not_the_run_s_end(tmp_path, server, loop, tiny_tokenizer,
                                                                            tiny_model, monkeypatch):
    """--agent_resources: a command missing on the agent node is dropped/exit and a worker killed under the program
    dropped/node (Ray's errors there are not the engine's); the command is checked at start-up; one Ray function
    serves every rollout (not one exported per rollout)."""
    import ray
    from generator import Engines
    from loop import RolloutPool

    class Engine:   # what the pool asks of Engines; the same test of an engine error
        def session(self):
            return fake(tiny_tokenizer, ["7"])
        is_engine_error = staticmethod(Engines.is_engine_error)
    ray.init(address="local", num_cpus=1, resources={"agent_node": 1}, include_dashboard=False,   # never a stale
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})   # ray_current_cluster's; its worker imports programs.py
    registered, remote = [], ray.remote
    monkeypatch.setattr(ray, "remote", lambda *a, **k: registered.append(a) or remote(*a, **k))
    cfg = {"model": tiny_model, "max_len": 128, "agent_timeout": 60, "temperature": 1.0, "top_p": 1.0,
           "max_new_tokens": 4, "samples_per_prompt": 1}
    killer = script(tmp_path, "killer", "import signal\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(60)\n")
    good = script(tmp_path, "good", ASK + "print(json.dumps({'reward': float(ask() == '7')}))\n")
    try:
        for cmd, drops, said in (("no-such-program-xyz --x", {"exit": 1}, "FileNotFoundError: [Errno 2] No such file"),
                                 (killer, {"node": 1}, "its Ray task failed: WorkerCrashedError"), (good, {}, "")):
            pool = RolloutPool(cfg, programs.program(cmd, 60, {"agent_node": 0.5}, confined=False), iter([]), Engine(),
                               tiny_tokenizer, server)
            segments = loop.run_until_complete(pool._rollout(0, {"prompt": "1?2="}))
            assert pool.drops == drops and said in pool.last_failure, (cmd, pool.drops, pool.last_failure)
            assert len(segments) == (not drops) and "Traceback" not in pool.last_failure
        assert len(registered) <= 1, registered   # at most the first rollout's
        with pytest.raises(ValueError, match="'no-such-program-xyz' is not an executable file on PATH of the node"):
            loop.run_until_complete(programs.program("no-such-program-xyz", 60, {"agent_node": 0.5}).check_node())
        loop.run_until_complete(programs.program(good, 60, {"agent_node": 0.5}).check_node())
    finally:
        ray.shutdown()


def test_agent_cmd_flags_are_checked_before_anything_starts(tmp_path, tiny_model, capsys, monkeypatch):
    import launch
    import main
    monkeypatch.setattr(launch, "run", lambda cfg: pytest.fail("launch.run reached"))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    base = ["--model", tiny_model, "--dataset", str(data), "--output_dir", str(tmp_path / "out")]
    for argv, words in (([], "is empty"), (["  "], "is empty"), (["no-such-program --x"], "'no-such-program' is not"),
                        ([str(tmp_path / "nothing.sh")], "is not an executable")):
        with pytest.raises(SystemExit):
            main.main([*base, "--agent_cmd", *argv] if argv else [*base, "--agent_cmd", ""])
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main([*base, "--agent_cmd", "true", "--agent", str(ROOT / "examples" / "agents" / "max_digit.py")])
    assert "choose one" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--agent_resources places --agent_cmd programs: pass --agent_cmd"):
        main.validate(vars(main.build_parser().parse_args([*base, "--agent_resources", '{"sandbox": 1}'])))
    with pytest.raises(SystemExit):
        main.main(["--model", tiny_model, "--agent_cmd", "true", "--output_dir", str(tmp_path / "out")])
    assert "pass --dataset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main([*base, "--agent_cmd", "true", "--eval_every", "2"])
    assert "needs --eval_dataset" in capsys.readouterr().err


# ----------------------------------------------------------- through main.py: drops, eval, kill -9

def test_programs_train_and_evaluate_through_main_and_drops_are_counted(tmp_path, tiny_model):
    """A run whose program fails twice: those rollouts are dropped/exit, their stderr logged once;
    the rest train; --eval_every runs the program too (eval/info/first_right is its info)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(16)))
    flaky = tmp_path / "flaky.sh"   # the first two rollouts fail, the others play running_max.py
    flaky.write_text(f"if mkdir {tmp_path}/one 2>/dev/null || mkdir {tmp_path}/two 2>/dev/null; then\n"
                     f"  echo flaky failure >&2; exit 2\nfi\nexec {sys.executable} {PROGRAMS / 'running_max.py'}\n")
    flaky = f"bash {flaky}"
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "--model", tiny_model, "--agent_cmd", flaky,
                           "--dataset", str(data), "--output_dir", str(out), "--steps", "2", "--prompts_per_step", "2",
                           "--samples_per_prompt", "4", "--max_len", "64", "--eval_every", "2", "--eval_prompts", "2",
                           "--eval_dataset", str(data), "--quiet", "--no_plot", "--export_hf", "none",
                           "--program_sandbox", "off"],   # flaky.sh counts its failures in tmp_path
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and metrics[-1]["dropped/exit"] == 2
    assert "eval/info/first_right" in metrics[-1] and "eval/reward_mean" in metrics[-1]
    assert proc.stderr.count("flaky failure") == 1 and "exited with 2" in proc.stderr


def test_kill_9_of_the_driver_leaves_no_program_behind(tmp_path, tiny_model):
    """Programs run in their own sessions (a terminal's Ctrl-C does not reach them): the run's tag they
    inherit lets the reaper end them when the driver is killed."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = script(tmp_path, "sleeper", f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
                 "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--model", tiny_model, "--agent_cmd", cmd,
                             "--dataset", str(data), "--output_dir", str(tmp_path / "run"), "--steps", "2",
                             "--prompts_per_step", "1", "--samples_per_prompt", "2", "--mini_batches", "1", "--quiet",
                             "--program_sandbox", "off"],   # the sleepers write their pids here (sandboxed: test_sandbox)
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while len(list(pids.iterdir())) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    started = [int(p.name) for p in pids.iterdir()]
    assert all(f"MOLT_RUN_ID=".encode() in Path(f"/proc/{pid}/environ").read_bytes() for pid in started)
    proc.kill()
    proc.wait()
    for pid in started:
        wait_gone(pid, 60)


def wait_gone(pid: int, seconds: float):
    """Until process `pid` is gone (or a zombie: dead, its parent not yet told)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            stat, cmdline = Path(f"/proc/{pid}/stat").read_text(), Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return
        assert time.monotonic() < deadline, f"process {pid} still runs after {seconds}s: {stat[:200]!r}, {cmdline!r}"
        time.sleep(0.05)
