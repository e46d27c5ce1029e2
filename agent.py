"""The agent contract: what a user writes, and how it becomes token-exact training data.

A user writes ordinary Python:

    class MyEnv(Env):                      # the framework runs the LLM loop
        async def step(self, state):       # state.action = the model's reply text
            return Result(reward=float(state.action == state.label))

`run_env` renders the first prompt with the model's chat template, tokenizes
it once, asks the engine for a completion as token ids, calls `step`, appends
the observation as non-trainable tokens rendered by the same template, and
repeats until the episode ends. It returns a `Trajectory`: the token ids the
engine actually saw and sampled, a mask of the policy's own tokens, their
sampling logprobs and policy versions, and the reward. The sampled text is
decoded for the agent to read; it is never encoded again.

Or the user owns the loop and talks to the policy with a stock SDK:

    class MyAgent(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            # or anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=...)

`run_chat_agent` opens a session on a `ChatServer` (aiohttp, 127.0.0.1 only, in
the caller's event loop) that serves `POST /s/<session>/v1/chat/completions`
(OpenAI) and `POST /s/<session>/v1/messages` (Anthropic), both decoding into
one token-exact trace: the first request is rendered with the chat template
and tokenized once; a request that extends the last one (its messages, the
reply as returned, new messages) appends only the delta, unmasked; a request
that rewrites the prefix (compaction, edited history, a template that
re-renders old turns) starts a new segment. Segments share the rollout's
reward. The server's rules:

  - sampling is the run's (`ctx.sampling_params`): request temperature, top_p,
    stop, seed are ignored so every token keeps the run's logprob convention;
    `n` > 1 and `stream: true` are refused (400);
  - `max_tokens` / `max_completion_tokens` is clamped to the run's per-turn
    limit and to what is left of `max_len`; with no room left the reply is
    empty, finish_reason "length" / stop_reason "max_tokens", nothing recorded;
  - the same body twice in a row (an SDK retry) gets the first reply, recorded once;
  - tools: a template that knows `tools` gets them natively; otherwise they are
    described in the system message and calls are written as
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, which a reply's
    text is parsed for (OpenAI `tool_calls`, Anthropic `tool_use`); text only.

Agents are loaded from a file with `load_agent(path)`; prompts come from the
agent's `prompts(seed)` or from a `--dataset` file (data.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import json
import logging
import math
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

log = logging.getLogger("molt")


@dataclass
class Result:
    """What an agent returns for one step (Env) or one episode (ChatAgent)."""
    reward: float
    observation: str | None = None   # text shown to the model next turn (Env)
    terminated: bool = True          # the episode is over
    truncated: bool = False          # cut short (budget, turn limit)
    info: dict = field(default_factory=dict)   # scalar diagnostics, logged as means
    score: float | None = None       # for dashboards/filtering; defaults to reward
    sampling_params: dict | None = None        # override for the next turn
    images: list | None = None       # shown with the observation next turn (Env; VLMs): paths, data URIs, PIL


@dataclass
class State:
    """What `Env.step` sees."""
    prompt: Any                      # the dataset row's prompt (text or messages)
    label: Any                       # the dataset row's label (anything)
    action: str                      # the model's reply this turn, decoded
    observation: str | None          # the last observation shown (None on turn 0)
    messages: list[dict]             # the conversation so far, reply included
    turn: int
    sampling_params: dict
    row: dict                        # the whole dataset row
    finish_reason: str = "stop"      # "stop" (the model ended its turn) or "length" (cut off)


class _Agent:
    @classmethod
    def prompts(cls, seed: int) -> Iterator[dict]:
        """Built-in prompt source: an endless iterator of rows {"prompt", "label"}."""
        raise ValueError(f"{cls.__name__} has no built-in prompts: pass --dataset FILE.jsonl")


class Env(_Agent):
    """Subclass and implement `step`. One instance per rollout."""
    max_turns: int = 1

    async def reset(self, row: dict) -> None:
        """Called once before the first turn."""

    async def step(self, state: State) -> Result:
        raise NotImplementedError


@dataclass
class Trajectory:
    """One rollout (or one segment of it), token-exact. Lists have equal length."""
    tokens: list[int]                # prompt + every turn, exactly as the engine saw them
    mask: list[int]                  # 1 on tokens the policy sampled
    logprobs: list[float]            # sampling logprob where mask is 1, else 0
    versions: list[int]              # policy version that sampled it, -1 where mask is 0
    reward: float
    group: int = 0                   # rollouts of the same prompt share it
    rollout_id: int = 0              # segments of one rollout share it
    score: float = 0.0
    info: dict = field(default_factory=dict)
    images: list[str] = field(default_factory=list)  # PNG data URIs, in the order of their pads in tokens

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None,
            version: int | list[int] = -1):
        self.tokens += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        if isinstance(version, list):  # per token: a partial rollout can span weight updates
            self.versions += version if sampled else [-1] * len(ids)
        else:
            self.versions += [version if sampled else -1] * len(ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)


Generate = Callable[..., Awaitable[dict]]   # (prompt_ids, sampling[, images]) -> dict (generator.py)
Call = Callable[..., Awaitable[Any]]        # (fn, *args) -> what fn(*args) returns, run where agent code runs


class DropRollout(Exception):
    """This rollout cannot be trained on; the loop drops it and counts `dropped/<reason>`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


async def _sample(generate: Generate, tokens: list[int], images: list[str], sampling: dict,
                  image_tokens) -> dict:
    """One completion of `tokens`. With images the engine gets one pad per image and the
    images (vision.py's convention) and must expand them into exactly `tokens`."""
    if not images:
        out = await generate(tokens, sampling)
    else:
        out = await generate(image_tokens.engine_ids(tokens), sampling, images)
        if out["prompt_ids"] != tokens:
            raise ValueError("the engine expanded the image tokens differently from the image processor "
                             f"({len(out['prompt_ids'])} ids, expected {len(tokens)}): check the model's "
                             "preprocessor_config.json")
    if image_tokens is not None and image_tokens.vision_ids.intersection(out["token_ids"]):
        raise DropRollout("vision_token", "the policy sampled an image/vision special token")
    return out


def _image_parts(content: Any) -> int:
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url")) \
        if isinstance(content, list) else 0


def with_images(messages: list[dict], images: list) -> list[dict]:
    """Messages whose image parts show `images`: a text `<image>` marks where one goes; with
    no image part or marker at all, the images go first in the first user message."""
    if not images:
        if any(_image_parts(m["content"]) for m in messages):
            raise ValueError("the prompt has image parts but the row has no images (--image_key)")
        return messages
    out = []
    for m in messages:
        if isinstance(m["content"], str) and "<image>" in m["content"]:
            texts = m["content"].split("<image>")
            parts = [{"type": "text", "text": texts[0]}] if texts[0] else []
            for t in texts[1:]:
                parts += [{"type": "image"}] + ([{"type": "text", "text": t}] if t else [])
            m = {**m, "content": parts}
        out.append(m)
    if not any(_image_parts(m["content"]) for m in out):
        i = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if i is None:
            raise ValueError("a row with images needs a user message to show them in")
        text = out[i]["content"]
        text = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        out[i] = {**out[i], "content": [{"type": "image"}] * len(images) + text}
    shown = sum(_image_parts(m["content"]) for m in out)
    if shown != len(images):
        raise ValueError(f"the prompt has {shown} image places (<image> or image parts) for {len(images)} images")
    return out


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool,
            tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=tools)


def _encode(tokenizer, text: str) -> list[int]:
    # The template already wrote every special token; add none of our own.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def decode_reply(tokenizer, token_ids: list[int]) -> str:
    """The reply as the model wrote it, special tokens included, less a final end-of-turn."""
    if token_ids and token_ids[-1] == tokenizer.eos_token_id:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)


class PrefixRewrite(ValueError):
    """The chat template re-renders earlier turns, so the trace cannot just grow."""


def delta_ids(tokenizer, messages: list[dict], reply_ids: list[int], new: list[dict],
              tools: list[dict] | None = None) -> list[int]:
    """Token ids that follow the sampled reply when the messages `new` come next.

    `messages` ends with the assistant reply, its content the sampled text. The
    ids are the template's text after the reply (its end-of-turn, if the model
    did not sample it), the new messages and the next generation prompt; the
    reply itself is not re-encoded. Raises PrefixRewrite if the template does
    not render the longer conversation by appending."""
    before = _render(tokenizer, messages[:-1], True, tools)
    closed = _render(tokenizer, messages, False, tools)
    reply = messages[-1]["content"]
    if not closed.startswith(before + reply):
        raise PrefixRewrite("the chat template renders the reply differently from how it was "
                            "sampled; an Env needs a template that only appends (a ChatAgent "
                            "gets a new segment instead)")
    tail = closed[len(before) + len(reply):]            # e.g. "<|im_end|>\n"
    eos = tokenizer.eos_token
    if reply_ids and reply_ids[-1] == tokenizer.eos_token_id and eos and tail.startswith(eos):
        tail = tail[len(eos):]                           # the model sampled it already
    full = _render(tokenizer, messages + new, True, tools)
    if not full.startswith(closed):
        raise PrefixRewrite("the chat template re-renders earlier turns when the conversation "
                            "grows; an Env needs a template that only appends (a ChatAgent "
                            "gets a new segment instead)")
    return _encode(tokenizer, tail + full[len(closed):])


def observation_ids(tokenizer, messages: list[dict], reply_ids: list[int],
                    observation: str | list, role: str = "user") -> list[int]:
    """Token ids that follow the sampled reply when `observation` (text, or content parts
    with images) comes next."""
    return delta_ids(tokenizer, messages, reply_ids, [{"role": role, "content": observation}])


async def run_env(env: Env, row: dict, generate: Generate, tokenizer, *,
                  sampling: dict, max_len: int, max_turns: int | None = None,
                  image_tokens=None, max_images: int | None = None, call: Call | None = None) -> Trajectory:
    """Run one episode of `env` on `row`; returns its token-exact trajectory. For a
    vision-language model `image_tokens` (vision.ImageTokens) places the row's images
    (row["images"]) and the observations' (Result.images); a trajectory shows at most
    `max_images` (the engine's per-request limit): an observation over it ends the episode.
    `call(fn, *args)` runs the env's own code (reset, step): the loop passes one that runs it
    on an agent thread (faults.AgentThreads), so a blocking step cannot freeze the loop."""
    call = call or _call_here
    images = image_tokens.uris(row.get("images")) if image_tokens else _no_images(row.get("images"))
    messages = with_images(_messages(row["prompt"]), images)
    await call(env.reset, row)
    traj = Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0, images=images)
    prompt = _encode(tokenizer, _render(tokenizer, messages, add_generation_prompt=True))
    traj.add(image_tokens.expand(prompt, images) if images else prompt, False)
    turns = max_turns or env.max_turns
    params = dict(sampling)
    observation, scores, info = None, [], {}
    for turn in range(turns):
        budget = max_len - len(traj.tokens)
        if budget <= 0:
            traj.info["truncated"] = 1.0
            break
        out = await _sample(generate, traj.tokens, traj.images,
                            {**params, "max_tokens": min(params["max_tokens"], budget)}, image_tokens)
        traj.add(out["token_ids"], True, out["logprobs"], out.get("versions", out["version"]))
        action = decode_reply(tokenizer, out["token_ids"])
        messages.append({"role": "assistant", "content": action})
        result = await call(env.step, State(prompt=row["prompt"], label=row.get("label"), action=action,
                                            observation=observation, messages=messages, turn=turn,
                                            sampling_params=params, row=row,
                                            finish_reason=out["finish_reason"]))
        reward = float(result.reward)
        if not math.isfinite(reward):
            raise ValueError(f"agent returned a non-finite reward {result.reward!r}")
        traj.reward += reward
        scores.append(reward if result.score is None else float(result.score))
        info.update(result.info)
        if result.terminated or result.truncated or turn == turns - 1:
            break
        observation = result.observation or ""
        new_images = image_tokens.uris(result.images) if image_tokens else _no_images(result.images)
        content = with_images([{"role": "user", "content": observation}], new_images)[0]["content"]
        obs_ids = observation_ids(tokenizer, messages, out["token_ids"], content)
        if new_images:
            obs_ids = image_tokens.expand(obs_ids, new_images)
        if (len(traj.tokens) + len(obs_ids) >= max_len  # whole observations only: never half an image
                or (max_images is not None and len(traj.images) + len(new_images) > max_images)):
            traj.info["truncated"] = 1.0
            break
        traj.add(obs_ids, False)
        traj.images += new_images
        messages.append({"role": "user", "content": content})
        params = {**params, **(result.sampling_params or {})}
    traj.score = sum(scores)
    traj.info.update({k: float(v) for k, v in info.items()})
    traj.info["turns"] = float(len(scores))
    return traj


async def _call_here(fn: Callable, *args) -> Any:
    """Run agent code in this event loop (tests; the loop runs it on agent threads)."""
    return await fn(*args)


def _no_images(images: Any) -> list:
    if images:
        raise ValueError("this rollout has images but the model has no vision tower: use a vision-language "
                         "model (e.g. Qwen2.5-VL) or drop the images")
    return []


# ---------------------------------------------------------------- ChatAgent: the user owns the loop


@dataclass
class ChatContext:
    """What `ChatAgent.run` gets: where to send requests, and the dataset row."""
    base_url: str            # OpenAI SDK: http://127.0.0.1:PORT/s/<session>/v1
    anthropic_base_url: str  # Anthropic SDK (it appends /v1/messages): http://127.0.0.1:PORT/s/<session>
    api_key: str             # any string works; SDKs insist on one
    model_name: str          # echoed back; the policy answers whatever model is named
    prompt: Any              # the dataset row's prompt (text or messages)
    messages: list[dict]     # the prompt as chat messages
    label: Any
    row: dict
    sampling_params: dict    # what the server samples with (request temperature etc. are ignored)


class ChatAgent(_Agent):
    """Subclass and implement `run`: talk to `ctx.base_url` with any SDK, return a Result.
    One instance per rollout; all requests of one `run` are one rollout."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


class BadRequest(ValueError):
    """A request the server refuses; `status` is the HTTP status (4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _need(cond: Any, message: str):
    if not cond:
        raise BadRequest(message)


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split a reply into its text and its `<tool_call>{json}</tool_call>` calls
    ({"id", "name", "arguments"}). A block that is not a JSON call stays text."""
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", call.get("parameters", {}))
            calls.append({"id": f"call_{secrets.token_hex(6)}", "name": call["name"], "arguments": args})
            kept.append(text[last:match.start()])
            last = match.end()
    return ("".join(kept + [text[last:]]).strip(), calls) if calls else (text, [])


def _text(content: Any, where: str) -> str:
    """Message content as one string: a string, None, or a list of text parts/blocks
    ({"type": "text", "text": ...}, the same in both APIs)."""
    if content is None or isinstance(content, str):
        return content or ""
    _need(isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                            and isinstance(p.get("text"), str) for p in content),
          f"{where}: only text content is supported")
    return "".join(p["text"] for p in content)


def _image_uri(part: dict, where: str) -> str:
    """The data URI of an OpenAI `image_url` part or an Anthropic `image` block (base64 only:
    the server is offline, so URLs are refused)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        _need(isinstance(url, str) and url.startswith("data:image/"),
              f"{where}: image_url must be a data URI (data:image/...;base64,...); URLs are not fetched")
        return url
    src = part.get("source")
    _need(isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str),
          f"{where}: image blocks need a base64 source; URLs are not fetched")
    return f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"


def _content(content: Any, where: str) -> str | list[dict]:
    """User content: a string, or, when it shows images, parts [{"type": "text", "text"} |
    {"type": "image", "image": data URI}] in order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in ("image_url", "image")
                                                for p in content):
        return _text(content, where)
    parts = []
    for j, p in enumerate(content):
        _need(isinstance(p, dict), f"{where}.{j}: must be an object")
        if p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif p.get("type") in ("image_url", "image"):
            parts.append({"type": "image", "image": _image_uri(p, f"{where}.{j}")})
        else:
            raise BadRequest(f"{where}.{j}: unsupported content part {p.get('type')!r} (text and images only)")
    return parts


def _json_args(arguments: Any) -> Any:
    """OpenAI sends tool arguments as a JSON string; keep the object it encodes."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def openai_request(body: dict) -> tuple[list[dict], list[dict] | None, Any]:
    """An OpenAI chat.completions body as (messages, tools, max_tokens) in the server's
    canonical form: messages {"role", "content": str, "tool_calls"?, "tool_call_id"?}."""
    _need(isinstance(body.get("messages"), list) and body["messages"], "'messages' must be a non-empty list")
    _need(body.get("n") in (1, None), "n > 1 is not supported: send one request per sample")
    messages = []
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        _need(isinstance(m, dict) and m.get("role") in ("system", "developer", "user", "assistant", "tool"),
              f"{where}: needs a role of system, developer, user, assistant or tool")
        msg = {"role": "system" if m["role"] == "developer" else m["role"],
               "content": (_content if m["role"] == "user" else _text)(m.get("content"), f"{where}.content")}
        if m["role"] == "assistant" and m.get("tool_calls"):
            try:
                msg["tool_calls"] = [{"id": c.get("id", ""), "name": c["function"]["name"],
                                      "arguments": _json_args(c["function"].get("arguments", "{}"))}
                                     for c in m["tool_calls"]]
            except (TypeError, KeyError, AttributeError):
                raise BadRequest(f"{where}.tool_calls: each needs function.name") from None
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        messages.append(msg)
    tools = body.get("tools") or None
    _need(tools is None or (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(
        t.get("function"), dict) for t in tools)), "'tools' must be a list of {type: function, function: {...}}")
    newer = body.get("max_completion_tokens")   # the newer name wins; either may be null
    return messages, tools, body.get("max_tokens") if newer is None else newer


def anthropic_request(body: dict) -> tuple[list[dict], list[dict] | None, Any]:
    """An Anthropic messages body as (messages, tools, max_tokens), canonical form as above.
    `tool_result` blocks become `tool` messages placed before the message's text."""
    _need(isinstance(body.get("messages"), list) and body["messages"], "messages: must be a non-empty list")
    _need("max_tokens" in body, "max_tokens: field required")
    messages = [{"role": "system", "content": _text(body["system"], "system")}] if body.get("system") else []
    for i, m in enumerate(body["messages"]):
        where = f"messages.{i}"
        _need(isinstance(m, dict) and m.get("role") in ("user", "assistant"), f"{where}.role: must be user or assistant")
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        _need(isinstance(blocks, list), f"{where}.content: must be a string or a list of blocks")
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "image" and m["role"] == "user":
                text.append({"type": "image", "image": _image_uri(b, f"{where}.content.{j}")})
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str):
                calls.append({"id": b.get("id", ""), "name": b["name"], "arguments": b.get("input", {})})
            elif kind == "tool_result" and m["role"] == "user":
                result = _text(b.get("content"), f"{where}.content.{j}.content")
                messages.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                 "content": ("Error: " if b.get("is_error") else "") + result})
            else:
                raise BadRequest(f"{where}.content.{j}: unsupported block {kind!r} (text, "
                                 "tool_use in assistant turns and tool_result in user turns only)")
        if text or calls or not blocks:
            content = "".join(text) if all(isinstance(t, str) for t in text) else \
                [{"type": "text", "text": t} if isinstance(t, str) else t for t in text]
            messages.append({"role": m["role"], "content": content, **({"tool_calls": calls} if calls else {})})
    tools = body.get("tools") or None
    _need(tools is None or (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                            for t in tools)), "tools: each tool needs a name")
    tools = tools and [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema", {})}} for t in tools]
    return messages, tools, body["max_tokens"]


def _key(m: dict) -> tuple:
    """What must match for a message to count as the same one (ids and formatting aside)."""
    calls = tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls", ()))
    content = m["content"] if isinstance(m["content"], str) else json.dumps(m["content"], sort_keys=True)
    return m["role"], content, calls


def _images_of(messages: list[dict]) -> list[str]:
    """The images shown in `messages`, in order (canonical image parts)."""
    return [p["image"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p.get("type") == "image"]


def _template_messages(messages: list[dict], native_tools: bool) -> list[dict]:
    """Canonical messages in the form the chat template takes. Without native tool
    support, calls are written as the `<tool_call>` text a model would sample."""
    out = []
    for m in messages:
        t = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls") and native_tools:
            t["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}}
                               for c in m["tool_calls"]]
        elif m.get("tool_calls"):
            t["content"] += "".join("<tool_call>" + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                                    + "</tool_call>" for c in m["tool_calls"])
        if m["role"] == "tool" and native_tools:
            t["tool_call_id"] = m["tool_call_id"]
        out.append(t)
    return out


def _tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For templates without tool support: describe the tools in the system message."""
    text = ("You can call these tools:\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n"
            'To call one, write <tool_call>{"name": <name>, "arguments": <JSON object>}</tool_call>.')
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


@dataclass
class Reply:
    """One completion, whichever API asked for it."""
    text: str                 # text outside tool calls
    tool_calls: list[dict]    # {"id", "name", "arguments"}
    finish: str               # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int


class ChatSession:
    """The token-exact trace behind one rollout's requests, cut into segments."""

    def __init__(self, url: str, generate: Generate, tokenizer, sampling: dict, max_len: int,
                 image_tokens=None):
        self.id = secrets.token_hex(8)
        self.image_tokens = image_tokens   # vision.ImageTokens for a vision-language model
        self.base_url = f"{url}/s/{self.id}/v1"            # for the OpenAI SDK
        self.anthropic_base_url = f"{url}/s/{self.id}"     # the Anthropic SDK appends /v1/messages
        self.generate, self.tokenizer = generate, tokenizer
        self.sampling, self.max_len = dict(sampling), max_len
        self.native_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        self.segments: list[Trajectory] = []   # sealed segments; the last one is still growing
        self.keys: list[tuple] = []            # the conversation as the client sees it, last reply included
        self.rendered: list[dict] = []         # the same, as the template renders it (replies as sampled)
        self.tools: list[dict] | None = None
        self.reply_ids: list[int] = []
        self.last: tuple[str, str, dict] | None = None   # (api, body, response) for retries
        self.lock = asyncio.Lock()              # one request at a time: the trace is one sequence
        self.requests = 0
        self.truncated = False
        self.error: BaseException | None = None   # a generate failure, re-raised by run_chat_agent

    def _uris(self, messages: list[dict]) -> list[str]:
        images = _images_of(messages)
        _need(not images or self.image_tokens, "this request shows images but the policy has no vision tower")
        return self.image_tokens.uris(images) if images else []

    def _prompt(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int], list[dict], list[str]]:
        """(prompt ids, ids new to the trace, template messages, images new to the trace): the
        last segment extended when the request extends its conversation; else a fresh segment
        (prompt is delta). Image pads come expanded (vision.py)."""
        native = tools if self.native_tools else None
        n = len(self.keys)
        if (self.segments and tools == self.tools and len(messages) > n
                and [_key(m) for m in messages[:n]] == self.keys):
            new = _template_messages(messages[n:], self.native_tools)
            try:
                delta = delta_ids(self.tokenizer, self.rendered, self.reply_ids, new, native)
                images = self._uris(new)
                delta = self.image_tokens.expand(delta, images) if images else delta
                return self.segments[-1].tokens + delta, delta, self.rendered + new, images
            except PrefixRewrite:
                pass  # the template re-renders history: a new segment, below
        rendered = _template_messages(messages, self.native_tools)
        if tools and not self.native_tools:
            rendered = _tool_prompt(rendered, tools)
        ids = _encode(self.tokenizer, _render(self.tokenizer, rendered, True, native))
        images = self._uris(rendered)
        ids = self.image_tokens.expand(ids, images) if images else ids
        return ids, ids, rendered, images

    async def complete(self, messages: list[dict], tools: list[dict] | None, max_tokens: Any) -> Reply:
        _need(max_tokens is None or (isinstance(max_tokens, int) and max_tokens > 0),
              "max_tokens must be a positive integer")
        prompt, delta, rendered, new_images = self._prompt(messages, tools)
        budget = self.max_len - len(prompt)
        if budget <= 0:  # no room for even one token: an empty, cut-off reply; nothing recorded
            self.truncated = True
            return Reply("", [], "length", len(prompt), 0)
        run_limit = self.sampling.get("max_tokens") or budget
        limit = min(max_tokens or run_limit, run_limit, budget)
        images = (new_images if delta is prompt else self.segments[-1].images + new_images)
        try:
            out = await _sample(self.generate, prompt, images, {**self.sampling, "max_tokens": limit},
                                self.image_tokens)
        except Exception as e:
            self.error = e
            raise
        ids = list(out["token_ids"])
        if delta is prompt:
            self.segments.append(Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0))
        self.segments[-1].add(delta, False)
        self.segments[-1].images += new_images
        self.segments[-1].add(ids, True, out["logprobs"], out.get("versions", out["version"]))
        self.requests += 1
        sampled = decode_reply(self.tokenizer, ids)
        text, calls = parse_tool_calls(sampled)
        self.keys = [_key(m) for m in messages] + [_key({"role": "assistant", "content": text, "tool_calls": calls})]
        self.rendered = rendered + [{"role": "assistant", "content": sampled}]
        self.tools, self.reply_ids = tools, ids
        finish = "tool_calls" if calls else ("length" if out["finish_reason"] == "length" else "stop")
        return Reply(text, calls, finish, len(prompt), len(ids))


def openai_response(reply: Reply, model: str) -> dict:
    message: dict = {"role": "assistant", "content": reply.text if reply.text or not reply.tool_calls else None}
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for c in reply.tool_calls]
    return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": reply.finish,
                                         "logprobs": None}],
            "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                      "total_tokens": reply.prompt_tokens + reply.completion_tokens}}


def anthropic_response(reply: Reply, model: str) -> dict:
    content = [{"type": "text", "text": reply.text}] if reply.text or not reply.tool_calls else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
                for c in reply.tool_calls]
    stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(reply.finish, "end_turn")
    return {"id": f"msg_{secrets.token_hex(8)}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}}


API = {"openai": (openai_request, openai_response), "anthropic": (anthropic_request, anthropic_response)}


def error_body(api: str, status: int, message: str) -> dict:
    """An error in the API's own format, so each SDK raises its usual exception."""
    kind = {404: "not_found_error"}.get(status, "invalid_request_error" if status < 500 else "api_error")
    if api == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class ChatServer:
    """Loopback OpenAI/Anthropic server (aiohttp) in the caller's event loop, 127.0.0.1 only.

        server = ChatServer(); await server.start()
        session = server.open_session(generate, tokenizer, sampling=..., max_len=...)
        ... requests to session.base_url / session.anthropic_base_url ...
        segments = server.close_session(session.id); await server.stop()
    """

    def __init__(self, model_name: str = "policy", api_key: str = "molt"):
        self.model_name, self.api_key = model_name, api_key
        self.sessions: dict[str, ChatSession] = {}
        self.url = ""
        self._runner = None

    async def start(self) -> str:
        from aiohttp import web
        app = web.Application(client_max_size=64 * 2**20)   # long conversations exceed the 1 MiB default
        app.router.add_post("/s/{session}/v1/chat/completions", functools.partial(self._handle, api="openai"))
        app.router.add_post("/s/{session}/v1/messages", functools.partial(self._handle, api="anthropic"))
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))   # a free port, loopback only
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self):
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.url = None, ""

    def open_session(self, generate: Generate, tokenizer, *, sampling: dict, max_len: int,
                     image_tokens=None) -> ChatSession:
        if not self.url:
            raise ValueError("ChatServer.open_session: call `await server.start()` first")
        session = ChatSession(self.url, generate, tokenizer, sampling, max_len, image_tokens)
        self.sessions[session.id] = session
        return session

    def close_session(self, sid: str) -> list[Trajectory]:
        """Forget the session; its segments in order (later requests to it get 404)."""
        return self.sessions.pop(sid).segments

    async def _handle(self, request, api: str):
        from aiohttp import web
        parse, respond = API[api]
        session = self.sessions.get(request.match_info["session"])
        try:
            _need(session, f"no open session {request.match_info['session']!r} (closed, or never opened)")
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON") from None
            _need(isinstance(body, dict), "the request body must be a JSON object")
            _need(not body.get("stream"), "stream: true is not supported by this server; send the request without it")
            key = json.dumps(body, sort_keys=True)
            async with session.lock:
                if session.last and session.last[:2] == (api, key):   # a retry: same reply, recorded once
                    return web.json_response(session.last[2])
                response = respond(await session.complete(*parse(body)), str(body.get("model", self.model_name)))
                session.last = (api, key, response)
            return web.json_response(response)
        except BadRequest as e:
            status = 404 if session is None else e.status
            return web.json_response(error_body(api, status, str(e)), status=status)
        except Exception as e:
            from jinja2 import TemplateError
            if isinstance(e, TemplateError):   # e.g. a template that insists roles alternate
                return web.json_response(error_body(api, 400, f"chat template: {e}"), status=400)
            if session.error is not e:
                log.exception("chat server: request failed")
            return web.json_response(error_body(api, 500, f"{type(e).__name__}: {e}"), status=500)

    async def _not_found(self, request):
        from aiohttp import web
        api = "anthropic" if request.path.endswith("/messages") else "openai"
        return web.json_response(error_body(api, 404, (
            f"no route {request.method} {request.path}; OpenAI clients use ctx.base_url "
            "(.../s/<session>/v1), Anthropic clients ctx.anthropic_base_url (.../s/<session>)")), status=404)


async def run_chat_agent(agent: ChatAgent, row: dict, generate: Generate, tokenizer, server: ChatServer, *,
                         sampling: dict, max_len: int, image_tokens=None,
                         call: Call | None = None) -> list[Trajectory]:
    """Run one `agent.run` on `row` through a fresh session of `server` (started, in this
    event loop). Returns the rollout's segments, each carrying its reward, score and info.
    A row's images appear in `ctx.messages` as OpenAI `image_url` parts with data URIs."""
    session = server.open_session(generate, tokenizer, sampling=sampling, max_len=max_len,
                                  image_tokens=image_tokens)
    images = image_tokens.uris(row.get("images")) if image_tokens else _no_images(row.get("images"))
    messages, shown = with_images(_messages(row["prompt"]), images), iter(images)
    messages = [{**m, "content": [{"type": "image_url", "image_url": {"url": next(shown)}}
                                  if p.get("type") in ("image", "image_url") else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in messages]
    ctx = ChatContext(base_url=session.base_url, anthropic_base_url=session.anthropic_base_url,
                      api_key=server.api_key, model_name=server.model_name, prompt=row["prompt"],
                      messages=messages, label=row.get("label"), row=row,
                      sampling_params=dict(sampling))
    try:
        result = await (call or _call_here)(agent.run, ctx)
    except Exception:
        if session.error is None:
            raise
    finally:
        segments = server.close_session(session.id)
    if session.error is not None:   # the engine failed under the agent: raise that, not the SDK's 500
        raise session.error
    if not isinstance(result, Result):
        raise ValueError(f"{type(agent).__name__}.run returned {type(result).__name__}, not a Result")
    reward = float(result.reward)
    if not math.isfinite(reward):
        raise ValueError(f"agent returned a non-finite reward {result.reward!r}")
    if not segments:
        raise ValueError(f"{type(agent).__name__} made no model request"
                         + (" that fit in max_len" if session.truncated else "")
                         + ": call the API at ctx.base_url (OpenAI) or ctx.anthropic_base_url (Anthropic)")
    info = {k: float(v) for k, v in result.info.items()}
    info.update(segments=float(len(segments)), requests=float(session.requests))
    if session.truncated:
        info["truncated"] = 1.0
    for seg in segments:
        seg.reward, seg.info = reward, dict(info)
        seg.score = reward if result.score is None else float(result.score)
    return segments


def load_agent(path: str) -> type:
    """Load the one Env or ChatAgent subclass defined in the Python file at `path`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--agent {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"molt_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [obj for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, (Env, ChatAgent))
             and obj.__module__ == module.__name__]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(f"--agent {path}: expected exactly one Env subclass (or one ChatAgent "
                         f"subclass) defined in the file, found {names}")
    return found[0]
