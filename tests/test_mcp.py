"""Tools from MCP servers (--mcp_server): the project's calculator server (tests/mcp_calculator.py) run for real
over stdio, its tools offered through the chat server and its calls run by `programs.MCPAgent`.

The tool round trip runs on SmolLM2's ChatML template (vLLM's hermes parser reads the call) with a fake engine that
samples a scripted call; the tiny model cannot write one, so the real-engine test checks the rest: the tools in the
prompt, a token-exact trace of the engine's own ids, the reward."""

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import psutil
import pytest

import agent as agents
import programs
from _smollm import smol_tokenizer
from fakes import Recorder, check_token_exact, fake
from trajectory import DropRollout

ROOT = Path(__file__).resolve().parents[1]
CALC = f"{sys.executable} {ROOT / 'tests' / 'mcp_calculator.py'}"
SAMPLING = {"temperature": 1.0, "max_tokens": 64}


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def run(cls, row, generate, tokenizer, server, loop, max_len=2048, sampling=SAMPLING):
    return loop.run_until_complete(agents.run_chat_agent(cls(), row, generate, tokenizer, server,
                                                         sampling=sampling, max_len=max_len))


def mcp_agent(cmd: str = CALC, max_turns: int | None = None) -> type:
    return programs.agent_class({"mcp_server": [cmd], "agent": None, "max_turns": max_turns})


def servers() -> list[psutil.Process]:
    """This process's MCP servers now running (not a zombie child another test left, e.g. a vLLM engine core
    whose exit nobody reaped yet: its command line cannot be read)."""
    def command(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:
            return ""
    return [p for p in psutil.Process().children(recursive=True) if "mcp_calculator.py" in command(p)]


@pytest.fixture(scope="module")
def engine(tiny_model, loop):
    """conftest's engine with room for the tool prompt (the tiny tokenizer spells letters as one token each)."""
    from generator import Generator

    async def make():
        return Generator(tiny_model, max_len=1024, seed=0)
    gen = loop.run_until_complete(make())
    yield gen
    gen.shutdown()


def test_calculator_tools_are_listed_as_openai_schemas_and_called():
    async def go():
        async with contextlib.AsyncExitStack() as stack:
            tools = await programs.mcp_tools([CALC.split()], stack)
            assert [t[3]["function"]["name"] for t in tools.values()] == ["add", "divide"]
            assert tools["add"][3] == {"type": "function", "function": {
                "name": "add", "description": "Add two integers.", "parameters": {
                    "type": "object", "title": "addArguments", "required": ["a", "b"],
                    "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}}}}
            return [await programs.call_mcp_tool(tools, *c) for c in (("add", '{"a": 2, "b": 40}'),
                    ("divide", '{"a": 1, "b": 4}'), ("divide", '{"a": 1, "b": 0}'), ("nope", "{}"), ("add", '{"a": "x"}'))]
    add, quarter, div, unknown, bad = asyncio.run(go())
    assert add == ("42", False) and quarter == ("0.25", False)
    assert div == ("Error executing tool divide", True) and unknown == ("Unknown tool: nope", True)
    assert bad[1] and "validation error" in bad[0]
    assert not servers()


def test_each_rollout_s_servers_run_in_a_fresh_folder_of_their_own(tmp_path, monkeypatch):
    """A stateful file tool does not leak between rollouts: each rollout's servers start in a fresh temporary folder
    (removed after), not the driver's; a file the command names relative to the driver's folder is still found."""
    (tmp_path / "memo.py").write_text(
        "import os\nfrom mcp.server.mcpserver import MCPServer\nserver = MCPServer('memo')\n\n\n@server.tool()\n"
        "def remember(text: str) -> str:\n    \"\"\"Keep text in ./memo; return the folder and what it held.\"\"\"\n"
        "    held = open('memo').read() if os.path.exists('memo') else ''\n    open('memo', 'w').write(text)\n"
        "    return os.getcwd() + ' ' + held\n\n\nserver.run('stdio')\n")
    monkeypatch.chdir(tmp_path)
    servers = mcp_agent(f"{sys.executable} memo.py").servers   # relative to the driver's folder

    async def rollout(text: str) -> str:
        async with contextlib.AsyncExitStack() as stack:
            return (await programs.call_mcp_tool(await programs.mcp_tools(servers, stack), "remember",
                                               json.dumps({"text": text})))[0]
    seen = [asyncio.run(rollout(text)).split(" ") for text in ("first", "second")]
    assert [held for _, held in seen] == ["", ""], seen   # the second rollout does not see the first's memo
    folders = [Path(folder) for folder, _ in seen]
    assert folders[0] != folders[1] and tmp_path not in folders and not any(f.exists() for f in folders)
    assert all(f.name.startswith("molt-mcp-") for f in folders) and not (tmp_path / "memo").exists()


def test_a_tool_call_runs_on_the_server_and_its_result_comes_back_token_exactly(server, loop, monkeypatch):
    """SmolLM2's template: the model calls add, then divide by zero (the tool's error is what it reads), then
    answers; one MCP server per rollout, with the run's tag, alive during the rollout and gone after."""
    tok = smol_tokenizer()
    monkeypatch.setenv("MOLT_RUN_ID", "mcp-test-tag")
    seen = []

    async def look(ids, sampling):
        seen.append([(p.pid, p.environ().get("MOLT_RUN_ID")) for p in servers()])
        return await rec(ids, sampling)
    rec = fake(tok, ["Let me add. " + call("add", a=2, b=40), call("divide", a=1, b=0), "42"])
    cls = mcp_agent()
    segs = run(cls, {"prompt": "What is 2 + 40?", "label": "42"}, look, tok, server, loop)
    calls = rec.calls
    assert len(calls) == 3 and len(segs) == 1 and segs[0].finish_reasons == ["tool_calls", "tool_calls", "stop"]
    check_token_exact(segs, calls)
    text = tok.decode(segs[0].tokens)
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n<tools>\n")
    assert '"name": "divide"' in text and '"required": ["a", "b"]' in text   # the tools as the server listed them
    assert call("add", a=2, b=40) + "<|im_end|>\n<|im_start|>tool\n42<|im_end|>" in text
    assert "<|im_start|>tool\nError executing tool divide<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n42<|im_end|>")
    assert segs[0].reward == 1.0 and segs[0].info["tool_calls"] == 2 and segs[0].info["tool_errors"] == 1
    assert len(seen) == 3 and len({s[0] for s in seen}) == 1 and seen[0][0][1] == "mcp-test-tag"
    assert not servers()


def test_the_turn_limit_and_a_wrong_answer_score_zero(server, loop):
    tok = smol_tokenizer()
    rec = fake(tok, [call("add", a=1, b=1), "2" + call("add", a=1, b=1)])   # "2", but still calling at the limit
    segs = run(mcp_agent(max_turns=2), {"prompt": "1 + 1?", "label": "2"}, rec, tok, server, loop)
    assert len(rec.calls) == 2 and segs[0].reward == 0.0 and segs[0].info["tool_calls"] == 2
    rec = fake(tok, ["3"])
    segs = run(mcp_agent(max_turns=2), {"prompt": "1 + 1?", "label": "2"}, rec, tok, server, loop)
    assert len(rec.calls) == 1 and segs[0].reward == 0.0 and segs[0].info["tool_calls"] == 0


def test_mcp_agent_on_the_real_engine_is_token_exact(engine, server, loop, tiny_tokenizer):
    """The tiny model through the real engine: the tools are in its prompt (its template has no tool support: the
    server describes them in a system message), the trace is the engine's own ids, the reward the label's match."""
    tok = tiny_tokenizer
    rec = Recorder(engine.generate)
    row = {"prompt": "3?7=", "label": "7"}
    segs = run(mcp_agent(), row, rec, tok, server, loop, max_len=1024,
               sampling={"temperature": 1.0, "max_tokens": 4})
    assert len(rec.calls) == 1 and len(segs) == 1
    check_token_exact(segs, rec.calls)
    prompt = tok.decode(rec.calls[0][0])
    assert prompt.startswith("<|system|>") and prompt.endswith("<|user|>3?7=<|end|><|assistant|>")
    assert prompt.count("<|unk|>") > 100   # the tools' JSON, letters unknown to the tiny vocabulary
    reply = tok.decode(rec.calls[0][1]["token_ids"], skip_special_tokens=True)
    assert segs[0].reward == float(reply == "7" and rec.calls[0][1]["finish_reason"] == "stop")
    assert not servers()


def test_a_server_that_dies_drops_the_rollout_with_its_stderr(tmp_path, server, loop):
    tok = smol_tokenizer()
    dying = tmp_path / "dying.py"
    dying.write_text((ROOT / "tests" / "mcp_calculator.py").read_text().replace(
        "return a + b", "import os, sys; print('the server fell over', file=sys.stderr, flush=True); os._exit(3)"))
    cls = mcp_agent(f"{sys.executable} {dying}")
    with pytest.raises(DropRollout) as e:
        run(cls, {"prompt": "1 + 1?", "label": "2"}, fake(tok, [call("add", a=1, b=1)]), tok, server, loop)
    assert e.value.reason == "mcp_server" and str(e.value).startswith("the server fell over\n")
    assert str(e.value).endswith(f"dying.py: Connection closed")


def test_a_timed_out_rollout_ends_its_server(server, loop, tiny_model):
    tok = smol_tokenizer()

    alive = []

    async def stuck(ids, sampling):   # the server is up: the agent has listed its tools
        alive.extend(servers())
        await asyncio.sleep(600)
    cls = mcp_agent()
    cfg = {"model": tiny_model, "max_len": 2048, "agent_timeout": 5.0}
    with pytest.raises(DropRollout) as e:
        loop.run_until_complete(agents.run_agent(cfg, cls, {"prompt": "1?"}, stuck, tok, server, SAMPLING))
    assert e.value.reason == "timeout" and len(alive) == 1
    for _ in range(100):   # its shutdown runs on (stdin closed, then the process group killed)
        if not servers():
            break
        loop.run_until_complete(asyncio.sleep(0.1))
    assert not servers()


def test_mcp_server_flags_are_checked_before_anything_starts(tmp_path, tiny_model, capsys, monkeypatch):
    import launch
    import main
    monkeypatch.setattr(launch, "run", lambda cfg: pytest.fail("launch.run reached"))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1?", "label": "1"}) + "\n")
    base = ["--model", tiny_model, "--dataset", str(data), "--output_dir", str(tmp_path / "out")]
    crash = f"{sys.executable} -c 'import sys; sys.exit(\"no such config\")'"
    digit = str(ROOT / "examples" / "agents" / "max_digit.py")
    for argv, words in ((["--mcp_server", "no-such-server --x"], "--mcp_server no-such-server --x: [Errno 2]"),
                        (["--mcp_server", " "], "--mcp_server is empty"), (["--mcp_server", crash], "no such config\n--mcp_server"),
                        (["--mcp_server", CALC, "--mcp_server", CALC], "two servers have a tool named 'add'"),
                        (["--mcp_server", CALC, "--agent_cmd", "true"], "choose one"),
                        (["--mcp_server", CALC, "--agent", digit], "must subclass programs.MCPAgent"),
                        (["--mcp_server", CALC, "--max_turns", "0"], "--max_turns must be >= 1")):
        with pytest.raises(SystemExit):
            main.main([*base, *argv])
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main(["--model", tiny_model, "--mcp_server", CALC, "--output_dir", str(tmp_path / "out")])
    assert "pass --dataset" in capsys.readouterr().err
    assert not servers()
