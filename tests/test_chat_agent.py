"""The ChatAgent contract: a loopback OpenAI/Anthropic server over token-exact traces.

Stock `openai` and `anthropic` clients talk to the real server. Generation is the
real vLLM engine on the tiny model (one engine and one event loop for the module:
vLLM's AsyncLLM binds to the loop it first runs on), or a fake that returns fixed
ids where a test needs exact control: SmolLM2's real ChatML template with tools,
prefix rewrites, retries, the context clamp, bad requests."""

import asyncio
import collections
import contextlib
import functools
import itertools
import json
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

import agent as agents
from _smollm import smol_tokenizer
from fakes import Recorder, check_token_exact, fake, ids
from agent import ChatAgent, Result
from trajectory import DropRollout

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
SAMPLING = {"temperature": 1.0, "max_tokens": 4}


# ----------------------------------------------------------- stock SDKs, real vLLM engine


def _run_example(file, row_index, engine, server, loop, tokenizer, max_len=128):
    cls = agents.load_agent(str(EXAMPLES / file))
    rows = cls.prompts(0)
    row = [next(rows) for _ in range(row_index + 1)][-1]
    rec = Recorder(engine.generate)
    segs = loop.run_until_complete(agents.run_chat_agent(cls(), row, rec, tokenizer, server,
                                                         sampling=SAMPLING, max_len=max_len))
    return row, rec, segs


def test_openai_sdk_two_turns_are_one_token_exact_trace(engine, server, loop, tiny_tokenizer):
    tok = tiny_tokenizer
    row, rec, segs = _run_example("chat_openai.py", 0, engine, server, loop, tok)
    assert len(rec.calls) == 2 and len(segs) == 1
    check_token_exact(segs, rec.calls)
    first = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                    tokenize=False)
    assert rec.calls[0][0] == ids(tok, first)
    assert tok.decode(rec.calls[1][0]).endswith(f"<|user|>{row['label']['follow_up']}<|end|><|assistant|>")
    assert segs[0].reward in (0.0, 1.0) and segs[0].score == segs[0].reward
    assert segs[0].info["requests"] == 2 and segs[0].info["segments"] == 1 and "first_right" in segs[0].info
    assert all(s["temperature"] == 1.0 and s["max_tokens"] == 4 for s in rec.sampling)


def test_anthropic_sdk_two_turns_are_one_token_exact_trace(engine, server, loop, tiny_tokenizer):
    tok = tiny_tokenizer
    row, rec, segs = _run_example("chat_anthropic.py", 0, engine, server, loop, tok)
    assert len(rec.calls) == 2 and len(segs) == 1
    check_token_exact(segs, rec.calls)
    assert tok.decode(rec.calls[0][0]) == f"<|user|>{row['prompt']}<|end|><|assistant|>"
    assert tok.decode(rec.calls[1][0]).endswith("<|user|>=?<|end|><|assistant|>")
    assert segs[0].reward in (0.0, 1.0)


def test_concurrent_sessions_do_not_mix(engine, server, loop, tiny_tokenizer):
    tok = tiny_tokenizer
    cls = agents.load_agent(str(EXAMPLES / "chat_openai.py"))
    rows = cls.prompts(1)
    rows = [next(rows) for _ in range(4)]
    recs = [Recorder(engine.generate) for _ in rows]

    async def all_four():
        return await asyncio.gather(*[agents.run_chat_agent(cls(), row, rec, tok, server, sampling=SAMPLING,
                                                            max_len=128) for row, rec in zip(rows, recs)])
    results = loop.run_until_complete(all_four())
    for row, rec, segs in zip(rows, recs, results):
        assert len(segs) == 1 and len(rec.calls) == 2
        check_token_exact(segs, rec.calls)
        text = tok.decode(segs[0].tokens)
        assert text.startswith(f"<|user|>{row['prompt']}<|end|><|assistant|>")
        assert f"<|user|>{row['label']['follow_up']}<|end|><|assistant|>" in text
    assert not server.sessions


# ----------------------------------------------------------- SmolLM2's ChatML template, tools


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_chatml_openai_tool_calls_token_exact(server, loop):
    tok = smol_tokenizer()
    rec = fake(tok, ["Let me add. " + CALL, "The sum is 5."])

    async def go():
        s = server.open_session(rec, tok, sampling={"temperature": 0.7, "max_tokens": 64}, max_len=2048)
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.key, max_retries=0) as client:
            msgs = [{"role": "user", "content": "What is 2 + 3?"}]
            r1 = await client.chat.completions.create(model="smol", messages=msgs, tools=TOOLS)
            msg = r1.choices[0].message
            assert r1.choices[0].finish_reason == "tool_calls" and msg.content == "Let me add."
            call = msg.tool_calls[0]
            assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
            msgs += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
            r2 = await client.chat.completions.create(model="smol", messages=msgs, tools=TOOLS)
            assert r2.choices[0].message.content == "The sum is 5." and r2.choices[0].finish_reason == "stop"
            assert r2.usage.prompt_tokens == len(rec.calls[1][0])
        return server.close_session(s.id)
    segs = loop.run_until_complete(go())
    assert len(segs) == 1 and segs[0].finish_reasons == ["tool_calls", "stop"]   # as each reply said
    check_token_exact(segs, rec.calls)
    text = tok.decode(segs[0].tokens)
    # The template has no tool support: the tools are described in a system message, the
    # call stays as sampled, the result is a tool turn.
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n<tools>\n")
    assert text.count(CALL) == 1
    assert text.endswith("<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\nThe sum is 5.<|im_end|>")


def test_chatml_anthropic_tools_and_cut_off_replies_token_exact(server, loop):
    tok = smol_tokenizer()
    cut = ids(tok, "The answer is")  # no end of turn: the template's <|im_end|> is appended unmasked
    rec = fake(tok, [cut, CALL, "It is 5."])
    tools = [{"name": "add", "description": "Add two integers", "input_schema": TOOLS[0]["function"]["parameters"]}]

    async def go():
        s = server.open_session(rec, tok, sampling={"temperature": 0.7, "max_tokens": 64}, max_len=2048)
        async with anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0) as client:
            kw = {"model": "smol", "max_tokens": 50, "system": "Be brief.", "tools": tools}
            msgs = [{"role": "user", "content": "What is 2 + 3?"}]
            r1 = await client.messages.create(messages=msgs, **kw)
            assert r1.stop_reason == "max_tokens" and r1.content[0].text == "The answer is"
            msgs += [{"role": "assistant", "content": r1.content}, {"role": "user", "content": "Use the tool."}]
            r2 = await client.messages.create(messages=msgs, **kw)
            assert r2.stop_reason == "tool_use" and [b.type for b in r2.content] == ["tool_use"]
            assert r2.content[0].name == "add" and r2.content[0].input == {"a": 2, "b": 3}
            msgs += [{"role": "assistant", "content": r2.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r2.content[0].id,
                                                   "content": "5"}]}]
            r3 = await client.messages.create(messages=msgs, **kw)
            assert r3.content[0].text == "It is 5." and r3.stop_reason == "end_turn"
        return server.close_session(s.id)
    segs = loop.run_until_complete(go())
    assert len(segs) == 1
    check_token_exact(segs, rec.calls)
    text = tok.decode(segs[0].tokens)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:")
    assert "<|im_start|>assistant\nThe answer is<|im_end|>\n<|im_start|>user\nUse the tool.<|im_end|>\n" in text
    assert text.endswith(CALL + "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\nIt is 5.<|im_end|>")
    # The appended <|im_end|> after the cut-off reply is not trainable.
    after_cut = len(rec.calls[0][0]) + len(cut)
    assert segs[0].mask[after_cut] == 0 and tok.decode(segs[0].tokens[after_cut]) == "<|im_end|>"


# ----------------------------------------------------------- segments, retries, the context clamp


class Compacting(ChatAgent):
    """Two turns, then a compacted history (a rewrite), then an edited reply (another)."""

    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            async def ask(messages):
                r = await client.chat.completions.create(model=ctx.model_name, messages=messages)
                return messages + [{"role": "assistant", "content": r.choices[0].message.content}]
            m = await ask(ctx.messages)
            m = await ask(m + [{"role": "user", "content": "3?4="}])                 # extends
            m = await ask([{"role": "user", "content": "5?6="}])                     # compacted: new segment
            m = await ask(m + [{"role": "user", "content": "7?8="}])                 # extends segment 2
            m[-1]["content"] = "9"                                                   # edits its reply
            await ask(m + [{"role": "user", "content": "?"}])                        # new segment
        return Result(reward=0.5, score=2.0, info={"x": 1})


def test_prefix_rewrite_starts_a_segment_with_the_same_reward(server, loop, tiny_tokenizer):
    tok = tiny_tokenizer
    rec = fake(tok, ["2", "4", "6", "8", "1"])
    segs = loop.run_until_complete(agents.run_chat_agent(Compacting(), {"prompt": "1?2="}, rec, tok, server,
                                                         sampling=SAMPLING, max_len=64))
    assert len(segs) == 3
    check_token_exact(segs, rec.calls)
    assert [tok.decode(s.tokens) for s in segs] == [
        "<|user|>1?2=<|end|><|assistant|>2<|end|><|user|>3?4=<|end|><|assistant|>4<|end|>",
        "<|user|>5?6=<|end|><|assistant|>6<|end|><|user|>7?8=<|end|><|assistant|>8<|end|>",
        "<|user|>5?6=<|end|><|assistant|>6<|end|><|user|>7?8=<|end|><|assistant|>9<|end|><|user|>?<|end|>"
        "<|assistant|>1<|end|>"]
    assert [(s.reward, s.score) for s in segs] == [(0.5, 2.0)] * 3
    assert segs[0].info == {"x": 1.0, "segments": 3.0, "requests": 5.0}
    # a request is a turn; the episode's reward sits on each segment's last turn
    assert [s.turn_rewards for s in segs] == [[0.0, 0.5], [0.0, 0.5], [0.5]]   # the last: one sampled reply
    assert all(len(s.turns) == len(s.tokens) and s.turns[-1] == len(s.turn_rewards) - 1 for s in segs)


def test_template_that_rerenders_history_starts_a_segment(server, loop, tiny_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # Like templates that drop old <think> blocks: earlier replies render without their content.
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    rec = fake(tok, ["2", "4"])

    class TwoTurns(ChatAgent):
        async def run(self, ctx):
            async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                r = await client.chat.completions.create(model="m", messages=ctx.messages)
                m = ctx.messages + [{"role": "assistant", "content": r.choices[0].message.content},
                                    {"role": "user", "content": "3?4="}]
                await client.chat.completions.create(model="m", messages=m)
            return Result(reward=1.0)
    segs = loop.run_until_complete(agents.run_chat_agent(TwoTurns(), {"prompt": "1?2="}, rec, tok, server,
                                                         sampling=SAMPLING, max_len=64))
    assert len(segs) == 2
    check_token_exact(segs, rec.calls)
    assert tok.decode(segs[1].tokens) == "<|user|>1?2=<|end|><|assistant|><|end|><|user|>3?4=<|end|><|assistant|>4<|end|>"


@pytest.mark.parametrize("reply", ["", "<|assistant|>1<|user|>", "3 "])
def test_a_history_with_the_servers_own_reply_extends_the_trace(server, loop, tiny_tokenizer, reply):
    """Whatever the reply holds (nothing, special-token text, trailing whitespace), sending it back
    as the library keeps it extends the one trace: the OpenAI Agents SDK (chat completions) drops an
    empty reply from the history it sends, which is still the same conversation."""
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner
    rec = fake(tiny_tokenizer, [reply, "9"])

    class AgentsSDK(ChatAgent):
        async def run(self, ctx):
            async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                agent, config = Agent(name="m", model=OpenAIChatCompletionsModel("m", client)), \
                    RunConfig(tracing_disabled=True)
                first = await Runner.run(agent, ctx.prompt, run_config=config)
                await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": "?3="}], run_config=config)
            return Result(reward=1.0)
    segs = loop.run_until_complete(agents.run_chat_agent(AgentsSDK(), {"prompt": "1?2="}, rec, tiny_tokenizer, server,
                                                         sampling=SAMPLING, max_len=64))
    assert len(segs) == 1
    check_token_exact(segs, rec.calls)
    assert tiny_tokenizer.decode(segs[0].tokens) == f"<|user|>1?2=<|end|><|assistant|>{reply}<|end|><|user|>?3=<|end|>" \
        "<|assistant|>9<|end|>"


async def _post(http, url, body, headers=None):
    async with http.post(url, data=body if isinstance(body, (str, bytes)) else json.dumps(body),
                         headers=headers) as r:
        return r.status, await r.json()


def test_a_retry_returns_the_cached_reply_and_records_once(server, loop, tiny_tokenizer):
    """A retry is what the SDKs mark as one (`x-stainless-retry-count` > 0); the same body
    without the mark is a new sample (a new segment: the conversation did not grow)."""
    rec = fake(tiny_tokenizer, ["7", "8"])
    body = {"model": "m", "messages": [{"role": "user", "content": "3?7="}], "temperature": 0.2}

    async def go():
        s = server.open_session(rec, tiny_tokenizer, sampling=SAMPLING, max_len=64)
        url = s.base_url + "/chat/completions"
        retry = {"x-stainless-retry-count": "1"}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:
            both = await asyncio.gather(_post(http, url, body, retry), _post(http, url, body, retry))  # in flight
            later = await _post(http, url, body, {"x-stainless-retry-count": "2"})                   # afterwards
            again = await _post(http, url, body, {"x-stainless-retry-count": "0"})   # a first try: samples
        return both + [later, again], server.close_session(s.id)
    replies, segs = loop.run_until_complete(go())
    assert [status for status, _ in replies] == [200] * 4
    assert replies[0][1] == replies[1][1] == replies[2][1]
    assert [r[1]["choices"][0]["message"]["content"] for r in replies] == ["7", "7", "7", "8"]
    assert len(rec.calls) == 2 and len(segs) == 2
    check_token_exact(segs, rec.calls)
    assert rec.sampling[0]["temperature"] == 1.0  # the run's temperature, not the request's


def test_max_tokens_is_clamped_to_the_context_left(server, loop, tiny_tokenizer):
    tok = tiny_tokenizer
    rec = fake(tok, ["77", "8"])

    class Long(ChatAgent):
        async def run(self, ctx):
            async with anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0) as c:
                m = [{"role": "user", "content": "3?7="}]   # 7 prompt tokens; max_len 10 leaves 3
                r1 = await c.messages.create(model="m", max_tokens=100, messages=m)
                m += [{"role": "assistant", "content": r1.content}, {"role": "user", "content": "?"}]
                r2 = await c.messages.create(model="m", max_tokens=100, messages=m)   # no room left
            return Result(reward=float(r1.stop_reason == "end_turn" and r2.stop_reason == "max_tokens"
                                       and r2.content[0].text == "" and r2.usage.output_tokens == 0))
    segs = loop.run_until_complete(agents.run_chat_agent(Long(), {"prompt": "3?7="}, rec, tok, server,
                                                         sampling=SAMPLING, max_len=10))
    assert rec.sampling == [{**SAMPLING, "max_tokens": 3}]  # one engine call, clamped to what was left
    assert len(segs) == 1 and len(segs[0].tokens) == 10 and segs[0].reward == 1.0
    assert segs[0].info["truncated"] == 1.0
    check_token_exact(segs, rec.calls)


def test_bad_requests_get_4xx_json_and_the_server_lives_on(server, loop, tiny_tokenizer):
    rec = fake(tiny_tokenizer, ["5"])

    async def go():
        s = server.open_session(rec, tiny_tokenizer, sampling=SAMPLING, max_len=64)
        oa, an = s.base_url + "/chat/completions", s.anthropic_base_url + "/v1/messages"
        msg = [{"role": "user", "content": "1?5="}]
        got = {}
        other = server.open_session(rec, tiny_tokenizer, sampling=SAMPLING, max_len=64)   # another rollout
        async with aiohttp.ClientSession() as http:   # keys: none, or another rollout's, touch no trace
            got["no key"] = await _post(http, oa, {"messages": msg})
            got["other key"] = await _post(http, oa, {"messages": msg}, {"Authorization": f"Bearer {other.key}"})
            got["anthropic other key"] = await _post(http, an, {"messages": msg, "max_tokens": 4},
                                                     {"x-api-key": other.key})
            got["anthropic key prefix"] = await _post(http, an, {"messages": msg, "max_tokens": 4},
                                                      {"x-api-key": s.key[:-1]})
            async with http.get(s.base_url + "/models", headers={"x-api-key": other.key}) as r:
                got["models other key"] = r.status, await r.json()
        for api, client in (("openai", openai.AsyncOpenAI(base_url=s.base_url, api_key=other.key, max_retries=0)),
                            ("anthropic", anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key=other.key,
                                                                   max_retries=0))):
            async with client:
                with pytest.raises((openai.AuthenticationError, anthropic.AuthenticationError), match="wrong API key"):
                    await (client.chat.completions.create(model="m", messages=msg) if api == "openai" else
                           client.messages.create(model="m", max_tokens=4, messages=msg))
        assert not server.close_session(other.id)
        async with aiohttp.ClientSession(headers={"x-api-key": s.key}) as http:
            got["unknown session"] = await _post(http, server.url + "/s/nope/v1/chat/completions", {"messages": msg})
            got["unknown session anthropic"] = await _post(http, server.url + "/s/nope/v1/messages",
                                                           {"messages": msg, "max_tokens": 4})
            got["not json"] = await _post(http, oa, "{oops")
            got["not an object"] = await _post(http, oa, [1, 2])
            got["no messages"] = await _post(http, oa, {"model": "m"})
            got["bad role"] = await _post(http, oa, {"messages": [{"role": "robot", "content": "1"}]})
            got["image"] = await _post(http, oa, {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:"}}]}]})
            got["n"] = await _post(http, oa, {"messages": msg, "n": 2})
            got["max_tokens 0"] = await _post(http, oa, {"messages": msg, "max_tokens": 0})
            got["anthropic no max_tokens"] = await _post(http, an, {"messages": msg})
            got["anthropic bad block"] = await _post(http, an, {"messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}], "max_tokens": 4})
            got["wrong path"] = await _post(http, server.url + f"/s/{s.id}/v1/v1/messages", {"messages": msg})
            got["good"] = await _post(http, oa, {"messages": msg})
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="n > 1 is not supported"):
                await client.chat.completions.create(model="m", messages=msg, n=3)
        async with openai.AsyncOpenAI(base_url=server.url + "/s/nope/v1", api_key="k", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError, match="no open session"):
                await client.chat.completions.create(model="m", messages=msg)
        return got, server.close_session(s.id)
    got, segs = loop.run_until_complete(go())
    statuses = {k: status for k, (status, _) in got.items()}
    assert statuses == {"no key": 401, "other key": 401, "anthropic other key": 401, "anthropic key prefix": 401,
                        "models other key": 401, "unknown session": 404, "unknown session anthropic": 404, "not json": 400,
                        "not an object": 400, "no messages": 400, "bad role": 400, "image": 400,
                        "n": 400, "max_tokens 0": 400, "anthropic no max_tokens": 400,
                        "anthropic bad block": 400, "wrong path": 404, "good": 200}
    for name, (status, body) in got.items():
        if status == 200:
            continue
        if "anthropic" in name:  # Anthropic's error format
            assert body["type"] == "error" and body["error"]["message"]
        else:                    # OpenAI's
            assert body["error"]["message"] and body["error"]["type"]
    assert "anthropic_base_url" in got["wrong path"][1]["error"]["message"]
    assert got["anthropic other key"][1]["error"]["type"] == "authentication_error"
    assert len(segs) == 1 and len(rec.calls) == 1
    check_token_exact(segs, rec.calls)


def test_a_turn_end_other_than_the_tokenizers_eos_ends_the_turn_everywhere(tiny_model, tmp_path, server, loop):
    """Gemma-it ends turns with <end_of_turn>, an eos id of its generation_config but not its tokenizer's
    eos, and vLLM stops on it: the Env reads the reply without it, the trace holds it once, and an SDK
    client gets neither it as content nor its logprob."""
    import shutil
    from transformers import AutoTokenizer
    from trajectory import render
    folder = tmp_path / "turn-end"
    shutil.copytree(tiny_model, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.eos_token = "<|tool|>"   # the tokenizer's eos; the template ends turns with <|end|> (id 0)
    tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, 0]}))
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token_id != 0 and tok.convert_ids_to_tokens(0) == "<|end|>"
    seen = []

    class TwoTurns(agents.Env):
        max_turns = 2

        async def step(self, state):
            seen.append(state.action)
            return Result(reward=1.0, observation="1", terminated=False)
    traj = loop.run_until_complete(agents.run_env(TwoTurns(), {"prompt": "1?2="}, fake(tok, [ids(tok, "7") + [0],
                                                                                             ids(tok, "8") + [0]]),
                                                  tok, sampling=SAMPLING, max_len=64))
    assert seen == ["7", "8"]
    talk = [{"role": "user", "content": "1?2="}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "1"}, {"role": "assistant", "content": "8"}]
    assert traj.tokens == ids(tok, render(tok, talk, False))   # each turn's end once, where the template puts it

    class Ask(ChatAgent):
        async def run(self, ctx):
            async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                r = await client.chat.completions.create(model="m", messages=ctx.messages, logprobs=True)
            seen.append((r.choices[0].message.content, len(r.choices[0].logprobs.content)))
            return Result(reward=1.0)
    loop.run_until_complete(agents.run_chat_agent(Ask(), {"prompt": "1?2="}, fake(tok, [ids(tok, "7") + [0]]), tok,
                                                  server, sampling=SAMPLING, max_len=64))
    assert seen[-1] == ("7", 1)


class Abandons(ChatAgent):
    """Abandons its first call while it samples (as an SDK timeout or a cancelled race does), is answered
    by its second, and ends with a third still in flight (its client still open)."""

    def __init__(self, events):
        self.events = events

    async def run(self, ctx):
        ev = self.events
        self.client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        ask = functools.partial(self.client.chat.completions.create, model="m")
        first = asyncio.ensure_future(ask(messages=ctx.messages))
        await ev["sampling 0"].wait()
        first.cancel()   # the SDK closes the connection: the server must not train what it never delivered
        with contextlib.suppress(asyncio.TimeoutError):   # (a bound only for today's code, which never cancels)
            await asyncio.wait_for(ev["cancelled 0"].wait(), 30)
        ev["release 0"].set()
        reply = (await ask(messages=ctx.messages)).choices[0].message.content
        self.third = asyncio.ensure_future(ask(messages=ctx.messages + [{"role": "assistant", "content": reply},
                                                                       {"role": "user", "content": "1"}]))
        await ev["sampling 2"].wait()
        return Result(reward=1.0)


def test_a_reply_never_delivered_is_not_trained_and_a_returned_rollout_never_changes(server, loop, tiny_tokenizer):
    tok = tiny_tokenizer
    events = collections.defaultdict(asyncio.Event)
    replies = ["9", "5", "7"]

    async def generate(prompt, sampling):
        n = 3 - len(replies)
        reply = ids(tok, replies.pop(0)) + [tok.eos_token_id]
        events[f"sampling {n}"].set()
        try:
            await events[f"release {n}"].wait() if n != 1 else None
        except asyncio.CancelledError:
            events[f"cancelled {n}"].set()
            raise
        return {"token_ids": reply, "logprobs": [-0.5] * len(reply), "version": 1, "finish_reason": "stop"}
    agent = Abandons(events)
    segments = loop.run_until_complete(agents.run_chat_agent(agent, {"prompt": "1?2="}, generate, tok, server,
                                                             sampling=SAMPLING, max_len=64))
    handed = [list(s.tokens) for s in segments]
    assert len(handed) == 1 and tok.decode(list(itertools.compress(handed[0], segments[0].mask))) == "5<|end|>"
    events["release 2"].set()   # the call left in flight could now finish: it must not reach the rollout
    loop.run_until_complete(asyncio.wait([agent.third], timeout=30))
    loop.run_until_complete(agent.client.close())
    assert [list(s.tokens) for s in segments] == handed
    assert agent.third.done() and events["cancelled 2"].is_set()   # the engine request was cancelled too


# ----------------------------------------------------------- run_chat_agent and load_agent


class Silent(ChatAgent):
    async def run(self, ctx):
        return Result(reward=1.0)


class NaN(ChatAgent):
    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=ctx.messages)
        return Result(reward=float("nan"))


class TooLong(ChatAgent):
    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1?2=" * 20}])
        return Result(reward=1.0)


def test_run_chat_agent_errors(server, loop, tiny_tokenizer):
    tok = tiny_tokenizer

    def run(agent, generate):
        return loop.run_until_complete(agents.run_chat_agent(agent, {"prompt": "1?2="}, generate, tok, server,
                                                             sampling=SAMPLING, max_len=64))
    with pytest.raises(ValueError, match="made no model request"):
        run(Silent(), fake(tok, []))
    with pytest.raises(ValueError, match="non-finite"):
        run(NaN(), fake(tok, ["2"]))
    with pytest.raises(DropRollout, match="no room for a reply within --max_len 64") as e:   # not trained empty
        run(TooLong(), fake(tok, []))
    assert e.value.reason == "prompt_too_long"

    async def broken(ids, sampling):
        raise RuntimeError("engine died")
    with pytest.raises(RuntimeError, match="engine died"):  # the engine's error, not the SDK's HTTP 500
        run(NaN(), broken)
    assert not server.sessions


def test_load_agent_finds_one_env_or_chat_agent(tmp_path):
    one = tmp_path / "one.py"
    one.write_text("from agent import ChatAgent, Result\nclass C(ChatAgent):\n"
                   "    async def run(self, ctx):\n        return Result(1.0)\n")
    assert issubclass(agents.load_agent(str(one)), ChatAgent)
    both = tmp_path / "both.py"
    both.write_text("from agent import ChatAgent, Env\nclass A(Env): pass\nclass B(ChatAgent): pass\n")
    with pytest.raises(ValueError, match="exactly one Env subclass .or one ChatAgent subclass.*A, B"):
        agents.load_agent(str(both))
