"""Codex CLI and Claude Code as they ship (npm, pinned in examples/programs/package.json; install.sh installs them) as
program agents (--agent_cmd): examples/programs/codex.py and claude_code.py only configure them. Each rollout runs in
the program sandbox against the server: with a fake engine that calls the shell tool each CLI declares (in the hermes
format vLLM's parser reads), the CLI runs the command and the wrapper's check of the folder is the reward; on the real
engine (SmolLM2-135M-Instruct, an 8K window) every request of the rollout is in its token-exact segments."""

import asyncio
import sys
from pathlib import Path

import pytest

import agent as agents
import programs
from fakes import Recorder, check_token_exact, fake

PROGRAMS = Path(__file__).resolve().parents[1] / "examples" / "programs"
TASK = {"prompt": "Create a file named answer.txt that contains the word hello.",
        "label": {"file": "answer.txt", "content": "hello"}}
CALL = '<tool_call>{{"name": "{}", "arguments": {{"{}": "echo {} > answer.txt"}}}}</tool_call>'
# the wrapper, its npm binary, the shell tool it declares and its argument, how a silent command's result comes back
CLIS = {"codex": ("codex.py", "codex", "exec_command", "cmd", "Process exited with code 0"),
        "claude_code": ("claude_code.py", "claude", "Bash", "command", "(Bash completed with no output)")}


def command(name: str) -> str:
    wrapper, binary = CLIS[name][:2]
    if not (PROGRAMS / "node_modules" / ".bin" / binary).is_file():
        pytest.fail(f"the `{binary}` npm package is missing: run `bash install.sh` (it runs npm install)")
    return f"{sys.executable} {PROGRAMS / wrapper}"


def rollout(name: str, generate, tokenizer, server, timeout: float, max_tokens: int):
    return agents.run_chat_agent(programs.program(command(name), timeout)(), TASK, generate, tokenizer, server,
                                 sampling={"temperature": 1.0, "max_tokens": max_tokens}, max_len=8192)


@pytest.mark.parametrize("name", CLIS)
def test_cli_runs_as_it_ships_and_its_work_is_checked(name, server, loop):
    """The CLI, pointed at the server by its environment only, runs the command the policy calls in its rollout's
    folder: writing the word earns 1, writing another word 0. Its first request (the CLI's own prompt and tools, as
    configured) fits a small model's window, and the command's result comes back in the next one."""
    from _smollm import smol_tokenizer
    tok = smol_tokenizer()
    tool, arg, result = CLIS[name][2:]
    recs = [fake(tok, [CALL.format(tool, arg, word), "Done."]) for word in ("hello", "goodbye")]

    async def both():
        return await asyncio.gather(*[rollout(name, rec, tok, server, 120, 64) for rec in recs])
    for rec, segs, reward in zip(recs, loop.run_until_complete(both()), (1.0, 0.0)):
        assert len(rec.calls) == 2 and len(segs) == 1 and segs[0].reward == reward
        assert segs[0].info[f"{CLIS[name][1]}_exit"] == 0
        check_token_exact(segs, rec.calls)
        first = tok.decode(rec.calls[0][0])
        assert "Create a file named answer.txt" in first and f'"name": "{tool}"' in first
        assert len(rec.calls[0][0]) < 2048   # its extra tools and context blocks are off
        assert result in tok.decode(rec.calls[1][0][len(rec.calls[0][0]):])


@pytest.mark.parametrize("name", CLIS)
def test_cli_on_a_harbor_task_is_scored_by_the_tasks_tests(name, server, loop):
    """A task row (--dataset examples/tasks): the wrapper leaves the reward to the task's tests/test.sh."""
    from _smollm import smol_tokenizer
    from test_tasks import row_of
    tok, (tool, arg) = smol_tokenizer(), CLIS[name][2:4]
    rec = fake(tok, ['<tool_call>{{"name": "{}", "arguments": {{"{}": "echo Hello, world! > hello.txt"}}}}</tool_call>'
                     .format(tool, arg), "Done."])
    segs = loop.run_until_complete(agents.run_chat_agent(programs.program(command(name), 120)(), row_of("hello-file"),
                                                         rec, tok, server, sampling={"max_tokens": 64}, max_len=8192))
    assert len(rec.calls) == 2 and segs[0].reward == 1.0
    check_token_exact(segs, rec.calls)


@pytest.fixture(scope="module")
def smollm2(loop):
    """One real engine on SmolLM2-135M-Instruct (8K positions) and its tokenizer, for the module."""
    import data
    import main
    from generator import Generator
    from transformers import AutoTokenizer
    model = data.resolve_model("smollm2", main.cache_dir(), say=lambda m: None)

    async def make():
        return Generator(model, max_len=8192, seed=0)
    gen = loop.run_until_complete(make())
    yield gen, AutoTokenizer.from_pretrained(model)
    gen.shutdown()


@pytest.mark.parametrize("name", CLIS)
def test_cli_trains_token_exactly_on_smollm2(name, smollm2, server, loop):
    """The same on the real engine (SmolLM2-135M-Instruct, which does not solve it): every request of the rollout is
    in its token-exact segments, and the reward is the check's."""
    gen, tok = smollm2
    rec = Recorder(gen.generate)
    segs = loop.run_until_complete(rollout(name, rec, tok, server, 240, 48))
    assert rec.calls and segs[0].info["requests"] == len(rec.calls)
    assert segs[0].reward in (0.0, 1.0) and "Create a file named answer.txt" in tok.decode(rec.calls[0][0])
    check_token_exact(segs, rec.calls)
