"""CLI coding agents against the server (server.py, dialects.py; issue 47 goal 2): requests shaped as Codex CLI
0.169 (Responses API) and Claude Code 2.1 (Messages API) send them, field for field, raw over HTTP as they do.

The server answers them as the real APIs answer for a model without a thinking mode: the fields it sets aside are
named in `x-molt-ignored` and leave the trained tokens exactly those of the same request without them; a template
with a thinking switch (Qwen3's `enable_thinking`) gets the request's reasoning/thinking; what would change the
sample and cannot be honoured stays a 400. The fake engine (tests/fakes.py) on SmolLM2's real tokenizer."""

import copy
import json

import aiohttp
import pytest

import server as srv
from _smollm import smol_tokenizer
from fakes import check_token_exact, fake

SAMPLING = {"temperature": 1.0, "max_tokens": 64}
SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
         "required": ["command"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(loop):
    s = srv.ChatServer()
    loop.run_until_complete(s.start())
    yield s
    loop.run_until_complete(s.stop())


def codex_body(stream: bool, effort: str) -> tuple[dict, dict]:
    """(what Codex sends, the same request without the fields it adds)."""
    plain = {"model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions/>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "3?7="}]}],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a command", "parameters": SHELL}],
        "tool_choice": "auto", "parallel_tool_calls": False, "stream": stream}
    codex = {**copy.deepcopy(plain), "reasoning": {"effort": effort, "summary": "auto"}, "store": False,
             "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199a213-81c0-7800-8aa1-bbab2a035a53",
             "client_metadata": {"originator": "codex_cli_rs"}}
    codex["tools"][0]["strict"] = False
    return codex, plain


def claude_body(stream: bool, thinking: dict) -> tuple[dict, dict]:
    """(what Claude Code sends, the same request without the fields it adds)."""
    ephemeral = {"cache_control": {"type": "ephemeral"}}
    plain = {"model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "stream": stream,
             "system": [{"type": "text", "text": "You are Claude Code."}],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder/>"},
                                                       {"type": "text", "text": "3?7="}]},
                          {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}],   # 2.1.332's
             "tools": [{"name": "Bash", "description": "Runs a command", "input_schema": SHELL}]}
    claude = copy.deepcopy(plain)
    claude["system"][0].update(ephemeral)
    claude["messages"][0]["content"][1].update(ephemeral)
    claude.update(thinking=thinking, output_config={"effort": "medium"}, metadata={"user_id": "user_abc_session_1"},
                  context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    return claude, plain


def events(raw: str) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


async def post(server, tok, url_of, path: str, body: dict, headers: dict) -> tuple[int, dict, object, list]:
    """(status, headers, the reply's JSON or events, the session's segments) of `body` in a fresh session."""
    rec = fake(tok, ["7 is it."])
    s = server.open_session(rec, tok, sampling=SAMPLING, max_len=2048)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}", "x-api-key": s.key, **headers}) as h:
        async with h.post(url_of(s) + path, json=body) as r:
            got = (r.status, dict(r.headers), events(await r.text()) if body["stream"] else await r.json())
    segments = server.close_session(s.id)
    if got[0] == 200:
        check_token_exact(segments, rec.calls)
    return *got, segments


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("effort", ["none", "high"])
def test_a_codex_request_is_served_its_extra_fields_named(server, loop, stream, effort):
    tok = smol_tokenizer()
    codex, plain = codex_body(stream, effort)
    headers = {"OpenAI-Beta": "responses=experimental", "originator": "codex_cli_rs"}

    async def go():
        async with aiohttp.ClientSession() as h:   # the model check, with its query string
            s = server.open_session(fake(tok, []), tok, sampling=SAMPLING, max_len=2048)
            async with h.get(f"{s.base_url}/models?client_version=0.169.0", headers={"Authorization": f"Bearer {s.key}"}) as r:
                models = (r.status, await r.json())
            server.close_session(s.id)
        return models, *[await post(server, tok, lambda s: s.base_url, "/responses?x=1", b, headers)
                         for b in (codex, plain)]
    models, (status, head, reply, segs), (_, plain_head, _, plain_segs) = loop.run_until_complete(go())
    assert models[0] == 200 and [m["id"] for m in models[1]["data"]] == ["policy"]
    assert status == 200, reply
    assert head["x-molt-ignored"] == "reasoning, reasoning.encrypted_content" and "x-molt-ignored" not in plain_head
    assert [s.tokens for s in segs] == [s.tokens for s in plain_segs] and [s.mask for s in segs] == [s.mask for s in plain_segs]
    sampled = [t for t, m in zip(segs[0].tokens, segs[0].mask) if m]
    if stream:   # what Codex parses, token-exact: one text delta per sampled token, the usage at the end
        kinds = [e["type"] for e in reply]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert {"response.output_item.added", "response.output_item.done"} <= set(kinds)
        deltas = [e["delta"] for e in reply if e["type"] == "response.output_text.delta"]
        assert deltas == [tok.decode([t]) for t in sampled[:-1]] and "".join(deltas) == "7 is it."
        reply = reply[-1]["response"]
    assert reply["output"][0]["content"][0]["text"] == "7 is it."
    usage = reply["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (len(segs[0].tokens) - len(sampled), len(sampled))
    assert usage["total_tokens"] == len(segs[0].tokens) and usage["input_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinking", [{"type": "adaptive", "display": "omitted"},   # 2.1.332's
                                      {"type": "enabled", "budget_tokens": 31999}, {"type": "disabled"}])
def test_a_claude_code_request_is_served_its_extra_fields_named(server, loop, stream, thinking):
    tok = smol_tokenizer()
    claude, plain = claude_body(stream, thinking)
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}

    async def go():
        async with aiohttp.ClientSession(headers=headers) as h:   # the model checks, as Claude Code makes them
            s = server.open_session(fake(tok, []), tok, sampling=SAMPLING, max_len=2048)
            checks = []
            for path in ("models?beta=true", f"models/{claude['model']}?beta=true", "messages/count_tokens?beta=true"):
                call = h.post if "count" in path else h.get
                kw = {"json": {k: claude[k] for k in ("model", "system", "messages", "tools", "thinking")}} \
                    if "count" in path else {}
                async with call(f"{s.anthropic_base_url}/v1/{path}", headers={"x-api-key": s.key}, **kw) as r:
                    checks.append((r.status, await r.json()))
            server.close_session(s.id)
        return checks, *[await post(server, tok, lambda s: s.anthropic_base_url, "/v1/messages?beta=true", b, headers)
                         for b in (claude, plain)]
    (listed, one, count), (status, head, reply, segs), (_, plain_head, _, plain_segs) = loop.run_until_complete(go())
    assert listed[0] == 200 and [m["id"] for m in listed[1]["data"]] == ["policy"] and listed[1]["has_more"] is False
    assert one == (200, {**one[1], "id": claude["model"], "type": "model"})
    assert status == 200, reply
    assert head["x-molt-ignored"] == "thinking, output_config, context_management" and "x-molt-ignored" not in plain_head
    assert [s.tokens for s in segs] == [s.tokens for s in plain_segs] and [s.mask for s in segs] == [s.mask for s in plain_segs]
    assert "3?7=<|im_end|>\n<|im_start|>system\n# Environment<|im_end|>" in tok.decode(segs[0].tokens)   # a system turn
    sampled = sum(segs[0].mask)
    prompt = len(segs[0].tokens) - sampled
    assert count == (200, {"input_tokens": prompt})
    if stream:   # what Claude Code parses, token-exact
        kinds = [e["type"] for e in reply]
        assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-2:] == ["message_delta",
                                                                                                   "message_stop"]
        assert reply[0]["message"]["usage"]["input_tokens"] == prompt
        deltas = [e["delta"]["text"] for e in reply if e["type"] == "content_block_delta"]
        assert "".join(deltas) == "7 is it." and len(deltas) == sampled - 1   # one per token, the end of turn aside
        assert reply[-2]["delta"]["stop_reason"] == "end_turn" and reply[-2]["usage"]["output_tokens"] == sampled
    else:
        assert reply["content"] == [{"type": "text", "text": "7 is it."}] and reply["stop_reason"] == "end_turn"
        assert (reply["usage"]["input_tokens"], reply["usage"]["output_tokens"]) == (prompt, sampled)


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                     "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_a_templates_thinking_switch_follows_the_requests_reasoning(server, loop):
    """Qwen3's enable_thinking: effort none / thinking disabled turn it off, any other effort or thinking on,
    nothing asked leaves the template's default; the switch is then honoured, so not named in x-molt-ignored."""
    tok = copy.deepcopy(smol_tokenizer())
    tok.chat_template = THINKING_TEMPLATE
    msgs = [{"role": "user", "content": "3?7="}]
    asks = [("responses", {"input": "3?7=", "reasoning": {"effort": "none", "summary": "auto"}}, False),
            ("responses", {"input": "3?7=", "reasoning": {"effort": "low"}}, True),
            ("responses", {"input": "3?7="}, None),
            ("chat/completions", {"messages": msgs, "reasoning_effort": "none"}, False),
            ("chat/completions", {"messages": msgs, "reasoning_effort": "medium"}, True),
            ("messages", {"messages": msgs, "max_tokens": 32000, "thinking": {"type": "disabled"}}, False),
            ("messages", {"messages": msgs, "max_tokens": 32000, "thinking": {"type": "adaptive"}}, True),
            ("messages", {"messages": msgs, "max_tokens": 32000, "thinking": {"type": "enabled", "budget_tokens": 2048},
                          "output_config": {"effort": "high"}}, True)]
    rec = fake(tok, ["7"] * len(asks))

    async def go():
        out = []
        for path, body, _ in asks:
            s = server.open_session(rec, tok, sampling=SAMPLING, max_len=2048)
            base = s.anthropic_base_url + "/v1" if path == "messages" else s.base_url
            async with aiohttp.ClientSession(headers={"x-api-key": s.key}) as h:
                async with h.post(f"{base}/{path}", json={"model": "m", **body}) as r:
                    out.append((r.status, r.headers.get("x-molt-ignored"), await r.json()))
            check_token_exact(server.close_session(s.id), rec.calls[-1:])
        return out
    out = loop.run_until_complete(go())
    assert [o[0] for o in out] == [200] * len(asks), out
    ends = [tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for prompt, _ in rec.calls]
    assert ends == [think is False for *_, think in asks]
    plain = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)   # None: the default
    assert tok.decode(rec.calls[2][0]) == plain and tok.decode(rec.calls[1][0]) == plain
    assert [o[1] for o in out] == [None] * 7 + ["output_config"]   # the switch is honoured; effort is not


def test_what_would_change_the_sample_is_still_refused(server, loop):
    """A structured output (constrained decoding: not the full softmax the trainer scores) and thinking or effort
    values no API knows are 400s naming the field, also beside the fields Codex and Claude Code send; nothing is
    sampled. Strict tools (the OpenAI Agents SDK's default) and the run's sampling are served, named."""
    tok = smol_tokenizer()
    codex, _ = codex_body(False, "none")
    claude, _ = claude_body(False, {"type": "adaptive"})
    strict = copy.deepcopy(codex)
    strict["tools"][0]["strict"] = True
    schema = {"type": "json_schema", "name": "x", "schema": SHELL}
    cases = [("/responses", {**codex, "reasoning": {"effort": "extreme"}}, "reasoning"),
             ("/responses", {**codex, "reasoning": {"effort": "low", "budget": 5}}, "reasoning"),
             ("/responses", {**codex, "text": {"format": schema}}, "text"),
             ("/v1/messages", {**claude, "output_config": {"effort": "low", "format": schema}}, "output_config"),
             ("/v1/messages", {**claude, "thinking": {"type": "sometimes"}}, "thinking"),
             ("/responses", strict, "reasoning, reasoning.encrypted_content, tools.strict"),
             ("/v1/messages", {**claude, "top_k": 5, "temperature": 0.5},
              "temperature, top_k, thinking, output_config, context_management")]

    async def go():
        return [await post(server, tok, lambda s: s.anthropic_base_url if path == "/v1/messages" else s.base_url,
                           path, body, {}) for path, body, _ in cases]
    out = loop.run_until_complete(go())
    for (path, _, named), (status, head, reply, segs) in zip(cases, out):
        if "," in named:   # served: the header names what was set aside
            assert status == 200 and head["x-molt-ignored"] == named, reply
        else:
            assert status == 400 and not segs and named in reply["error"]["message"], (named, reply)
