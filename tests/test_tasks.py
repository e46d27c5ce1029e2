"""Terminal tasks in Harbor's format (tasks.py, `--dataset DIR` of task folders): each example task's oracle
(solution/solve.sh) scores 1 and a null agent 0 through the real sandbox and verifier; the agent sees neither the
tests nor any solution, and cannot write the verifier's reward; tasks that need an image build are refused with the
line that needs one; a real program (mini-swe-agent) solves one through the server, token-exact."""

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

import agent as agents
import data
import programs
import tasks
from fakes import check_token_exact, fake

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "tasks"
ENV = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "k"}


def row_of(name: str) -> dict:
    return next(r for r in data.load_rows(str(EXAMPLES)) if Path(r["task"]).name == name)


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.iterdir()))
def test_each_example_task_scores_its_oracle_1_and_a_null_agent_0(name, tmp_path):
    row = row_of(name)
    assert row["prompt"] == (EXAMPLES / name / "instruction.md").read_text()
    oracle = tmp_path / "solve.sh"   # the task's own copy is hidden from its agents
    shutil.copy(EXAMPLES / name / "solution" / "solve.sh", oracle)
    for argv, want in ((["bash", str(oracle)], 1.0), (["true"], 0.0)):
        out, err, failed, verdict = asyncio.run(programs.run_process(argv, row, ENV, 60))
        assert (failed, verdict) == (None, want), (argv, err.tail)


CHEAT = r"""
ls /tests 2>/dev/null && echo SAW-TESTS
ls {tasks} | grep -q . && echo SAW-TASKS
mkdir -p /logs/verifier 2>/dev/null && echo 1 > /logs/verifier/reward.txt && echo WROTE-REWARD
echo '{{"reward": 1}}'
"""


def test_the_agent_sees_no_tests_or_solutions_and_cannot_write_the_reward(tmp_path):
    cheat = tmp_path / "cheat.sh"
    cheat.write_text(CHEAT.format(tasks=EXAMPLES))
    out, err, failed, verdict = asyncio.run(programs.run_process(["bash", str(cheat)], row_of("hello-file"), ENV, 60))
    assert failed is None and verdict == 0.0   # the verifier's, not the program's reward line
    assert b"SAW-" not in out.tail and b"WROTE-REWARD" not in out.tail, out.tail


def task(root: Path, name: str, dockerfile: str, tests: bool = True) -> Path:
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "instruction.md").write_text("do it")
    (folder / "task.toml").write_text('[agent]\ntimeout_sec = 10.0\n[verifier]\nenv = {"TOKEN" = "the tests\'"}\n')
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    (folder / "environment" / "data.txt").write_text("x")
    if tests:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text(
            '[ "$GREETING $TOKEN" = "hi the tests\'" ] && [ -f /srv/work/data.txt ] && [ "$PWD" = /srv/work ] '
            '&& echo 0.5 > /logs/verifier/reward.txt\n')
    return folder


def test_tasks_that_need_an_image_build_are_refused_naming_the_line(tmp_path):
    folder = tmp_path / "tasks"   # the agent's program beside it (the tasks' folder is hidden from agents)
    task(folder, "runs", "FROM ubuntu:24.04\n# a comment\nWORKDIR /srv\nWORKDIR work\nENV GREETING=hi\n"
                           "COPY data.txt /srv/work/\n")
    task(folder, "builds", "FROM ubuntu:24.04\nRUN apt-get install -y jq\n")
    task(folder, "outside", "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data.txt /etc/\n")
    task(folder, "untested", "FROM ubuntu:24.04\n", tests=False)
    with pytest.raises(ValueError) as e:
        data.load_rows(str(folder))
    said = str(e.value)
    assert "3 of 4 tasks cannot run here" in said and "these could: runs" in said
    assert "builds: environment/Dockerfile line 2 (RUN) needs an image build" in said
    assert "outside: environment/Dockerfile copies to /etc/, outside its WORKDIR /app" in said
    assert "untested: no tests/test.sh" in said
    for name in ("builds", "outside", "untested"):
        shutil.rmtree(folder / name)
    row, = data.load_rows(str(folder))
    t = tasks.Task.load(row["task"])
    assert (t.workdir, t.env, t.verifier_env, t.timeouts) == (
        "/srv/work", {"GREETING": "hi"}, {"TOKEN": "the tests'"}, {"agent": 10.0, "verifier": 0.0})
    probe = tmp_path / "probe.sh"   # the agent: its WORKDIR with the task's files, its ENV, not the verifier's
    probe.write_text('[ "$PWD" = /srv/work ] && [ -f data.txt ] && [ "$GREETING" = hi ] && [ -z "$TOKEN" ] || exit 3\n')
    out, err, failed, verdict = asyncio.run(programs.run_process(["bash", str(probe)], row, ENV, 60))
    assert (failed, verdict) == (None, 0.5), err.tail
    import main
    with pytest.raises(ValueError, match="holds Harbor tasks: they run with --agent_cmd, in the program sandbox"):
        main.validate(vars(main.build_parser().parse_args(["--dataset", str(folder), "--agent_cmd", "true",
                                                           "--program_sandbox", "off"])))


def test_mini_swe_agent_solves_a_task_through_the_server(server, loop, tiny_tokenizer, monkeypatch):
    """The shipped mini-swe-agent wrapper on a Harbor task: the policy's tool call writes the file in /app, the
    task's tests/test.sh gives the reward, every request is in the rollout's token-exact segments."""
    from _smollm import smol_tokenizer
    tok = smol_tokenizer()
    monkeypatch.setenv("MINI_STEPS", "3")
    call = '<tool_call>{{"name": "bash", "arguments": {{"command": "{}"}}}}</tool_call>'
    rec = fake(tok, [call.format("echo Hello, world! > hello.txt"), call.format("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    cmd = f"{sys.executable} {ROOT / 'examples' / 'programs' / 'mini_swe_agent.py'}"
    segs = loop.run_until_complete(agents.run_chat_agent(
        programs.program(cmd, 120, env=["MINI_STEPS"])(), row_of("hello-file"), rec, tok, server,
        sampling={"temperature": 1.0, "max_tokens": 64}, max_len=4096))
    assert len(rec.calls) == 2 and segs[0].reward == 1.0
    check_token_exact(segs, rec.calls)
    assert "Create a file named hello.txt" in tok.decode(rec.calls[0][0])
