"""The ChatAgent loopback server: stock OpenAI and Anthropic SDKs over one token-exact trace.

(The agent contract, `ChatAgent` and `run_chat_agent`, is in agent.py; this is the HTTP half.
The trace and its rendering, `Trajectory`, `render`/`encode`, `delta_ids`, `sample`, are trajectory.py's.)

`ChatServer` (aiohttp, on 127.0.0.1 unless told, in the caller's event loop) serves one URL prefix per rollout,
`/s/<session>/v1/`, to requests that carry the rollout's key (`Authorization: Bearer` or `x-api-key`; else a 401): POST chat/completions (OpenAI), responses (OpenAI; previous_response_id within the
session) and messages (Anthropic), each streamed or not; POST messages/count_tokens; GET models.

Each API is decoded into one canonical request (`Request`) and a `ChatSession` turns requests into a token-exact
trace: the first request is rendered with the chat template and tokenized once; one that extends the last (its
messages, the reply as returned, new messages) appends only the delta, unmasked; one that rewrites the prefix starts
a new segment. A reply is one completion of sampled ids, split into reasoning, text and tool calls by vLLM's own
parsers (`reply_parsers`); streamed, it is the same reply as server-sent events: neither changes the trace. What
each API field gets (honoured; ignored, named in `x-molt-ignored`; a 400, never a 5xx): docs/server.md.
"""

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import re
import resource
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from trajectory import (Generate, PrefixRewrite, Trajectory, decode_reply, delta_ids, encode, end_ids, render,
                        sample)

log = logging.getLogger("molt")
MAX_BODY = 64 * 2**20   # long conversations with images exceed aiohttp's 1 MiB default
IDLE_S, BODY_S, SESSION_CONNECTIONS = 30.0, 60.0, 8   # what a client can hold: docs/server.md, "Limits"
MAX_CONNECTIONS = max(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) // 2 or 2**15   # in all: half the driver's fds
_POOL = ThreadPoolExecutor(MAX_CONNECTIONS, "molt-chat-server")   # requests' CPU work (each holds a connection)


class BadRequest(ValueError):
    """A request the server refuses; `status` is the HTTP status (4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _need(cond: Any, message: str):
    if not cond:
        raise BadRequest(message)


@functools.lru_cache(maxsize=8)
def reply_parsers(tool: str, reasoning: str | None, tokenizer) -> tuple[Any, Any]:
    """vLLM's tool and reasoning parsers (None: none) for `tokenizer`, as its server's --tool-call-parser /
    --reasoning-parser pick them. ValueError: a name vLLM lacks, or special tokens the tokenizer lacks."""
    from vllm.reasoning import ReasoningParserManager as Reasoning
    from vllm.tool_parsers import ToolParserManager as Tools
    made = []
    for flag, name, get, names in (("tool_parser", tool, Tools.get_tool_parser, Tools.list_registered()),
                                   ("reasoning_parser", reasoning, Reasoning.get_reasoning_parser,
                                    Reasoning.list_registered())):
        if name is not None and name not in names:
            raise ValueError(f"--{flag} {name!r} is not one of vLLM's: {', '.join(names)}")
        try:
            made.append(name and get(name)(tokenizer))
        except Exception as e:   # e.g. the template's special tokens are not in the vocabulary
            raise ValueError(f"--{flag} {name}: does not fit the model's tokenizer ({e})") from None
    return made[0], made[1]


def parse_reply(text: str, parsers: tuple, request, calls: bool, most: int | None) -> tuple[str | None, str, list]:
    """(reasoning, text, calls {"id", "name", "arguments"}) of a reply's text by vLLM's parsers (ids untouched).
    Only JSON-object arguments make calls (agents index them; else the reply stays text); at most `most`."""
    tool, thinking = parsers
    reasoning, text = thinking.extract_reasoning(text, request) if thinking else (None, text)
    text = text or ""
    found = tool.extract_tool_calls(text, request) if calls and request.tools else None
    got = [{"id": c.id, "name": c.function.name, "arguments": _json_args(c.function.arguments)}
           for c in (found.tool_calls if found and found.tools_called else [])]
    if not got or not all(isinstance(c["arguments"], dict) for c in got):
        return reasoning, text, []
    return reasoning, (found.content or "").strip(), got[:most]


# ---------------------------------------------------------------- requests: each API -> one canonical form

TEXT_PARTS = ("text", "input_text", "output_text")   # Chat/Anthropic, Responses input, Responses output
IMAGE_PARTS = ("image_url", "image", "input_image")


def _text(content: Any, where: str) -> str:
    """Message content as one string: a string, None, or a list of text parts/blocks
    ({"type": "text", "text": ...}; the Responses API's input_text/output_text)."""
    if content is None or isinstance(content, str):
        return content or ""
    _need(isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                            and isinstance(p.get("text"), str) for p in content),
          f"{where}: only text content is supported")
    return "".join(p["text"] for p in content)


def _image_uri(part: dict, where: str) -> str:
    """The data URI of an OpenAI `image_url`/`input_image` part or an Anthropic `image` block
    (base64 only: the server is offline, so URLs are refused)."""
    if part.get("type") in ("image_url", "input_image"):
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
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                for p in content):
        return _text(content, where)
    parts = []
    for j, p in enumerate(content):
        _need(isinstance(p, dict), f"{where}.{j}: must be an object")
        if p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif p.get("type") in IMAGE_PARTS:
            parts.append({"type": "image", "image": _image_uri(p, f"{where}.{j}")})
        else:
            raise BadRequest(f"{where}.{j}: unsupported content part {p.get('type')!r} (text and images only)")
    return parts


def _json_args(arguments: Any) -> Any:
    """OpenAI sends tool arguments as a JSON string; keep the object it encodes."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except (json.JSONDecodeError, RecursionError):
        return arguments


def _call(name: Any, arguments: Any, call_id: Any, where: str) -> dict:
    _need(isinstance(name, str) and name, f"{where}: a tool call needs a name")
    return {"id": str(call_id or ""), "name": name, "arguments": _json_args(arguments)}


@dataclass
class Request:
    """One request of any API, canonical."""
    messages: list[dict]
    tools: list[dict] | None = None      # OpenAI chat form [{"type": "function", "function": {...}}]
    max_tokens: Any = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    top_logprobs: int | None = None      # None: no logprobs asked; k: the sampled token's and k alternatives
    usage_in_stream: bool = False        # OpenAI stream_options.include_usage
    single_call: bool = False            # parallel_tool_calls false / disable_parallel_tool_use


def _limit(value: Any, name: str) -> Any:
    _need(value is None or (type(value) is int and value > 0), f"{name} must be a positive integer")
    return value


def _stops(value: Any, name: str, most: int) -> list[str]:
    stops = [value] if isinstance(value, str) else (value or [])
    _need(isinstance(stops, list) and len(stops) <= most and all(isinstance(s, str) and s for s in stops),
          f"{name} must be a non-empty string or a list of at most {most} non-empty strings")
    return stops


def _no_n(body: dict):
    _need(body.get("n") in (1, None), "n > 1 is not supported: send one request per sample "
                                       "(each request samples anew, and each sample is its own rollout segment)")


# Every top-level field each API knows (as of openai 3.57 and anthropic 2.15), in three kinds
# beside those the decoders below read: INERT fields do not change the sample (ids, metadata,
# caching and routing hints); RUN_SAMPLING gives way to the run's sampling (the reply names them
# in `x-molt-ignored`); ONLY fields are honoured at the listed values (what the server does
# anyway) and refused at any other. Unknown fields are refused, as the real APIs refuse them.
_READ = {"openai": "model messages tools max_tokens max_completion_tokens stop stream stream_options logprobs "
                   "top_logprobs n",
         "anthropic": "model messages max_tokens system stop_sequences stream tools",
         "count_tokens": "model messages system tools",
         "responses": "model input instructions tools max_output_tokens stream previous_response_id include "
                      "top_logprobs"}
_CACHE = "metadata service_tier safety_identifier prompt_cache_key prompt_cache_retention prompt_cache_options moderation"
_ANTHROPIC_INERT = "cache_control speed workspace_id user_profile_id"
_INERT = {"openai": "user store " + _CACHE, "responses": "user store stream_options " + _CACHE,
          "anthropic": "metadata service_tier inference_geo " + _ANTHROPIC_INERT, "count_tokens": _ANTHROPIC_INERT}
RUN_SAMPLING = {"openai": ("temperature", "top_p", "seed"), "anthropic": ("temperature", "top_p", "top_k"),
                "count_tokens": (), "responses": ("temperature", "top_p")}
_AUTO = {"type": "auto"}
_ANTHROPIC_ONLY = {"thinking": ({"type": "disabled"},), "output_config": (), "output_format": (), "container": (),
                   "diagnostics": (), "tool_choice": (_AUTO, *({**_AUTO, "disable_parallel_tool_use": b}
                                                               for b in (False, True)))}
_ONLY = {"openai": {"tool_choice": ("auto",), "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
                    "modalities": (["text"],), "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                    "reasoning_effort": (), "verbosity": (), "audio": (), "prediction": (), "web_search_options": (),
                    "functions": (), "function_call": ()},
         "anthropic": _ANTHROPIC_ONLY, "count_tokens": _ANTHROPIC_ONLY,
         "responses": {"tool_choice": ("auto",), "parallel_tool_calls": (True, False), "truncation": ("disabled",),
                       "text": ({"format": {"type": "text"}},), "reasoning": (), "background": (False,),
                       "background_options": (), "context_management": (), "conversation": (), "prompt": (),
                       "max_tool_calls": (), "image": (), "access_programs": ()}}
_ACCEPTED = {api: {*_READ[api].split(), *_INERT[api].split(), *RUN_SAMPLING[api]} for api in _READ}


def check_fields(api: str, body: dict) -> list[str]:
    """Refuse (BadRequest) what `api` cannot honour; the run-sampling fields the body sets."""
    for k, v in body.items():
        if k in _ACCEPTED[api]:
            continue
        if k not in _ONLY[api]:
            raise BadRequest(f"{k}: Extra inputs are not permitted" if api in ("anthropic", "count_tokens")
                             else f"Unrecognized request argument supplied: {k}")
        _need(v is None or v in _ONLY[api][k], f"{k}={json.dumps(v)[:80]} is not supported by this server" + (
            f" (only {' or '.join(json.dumps(x) for x in _ONLY[api][k])})" if _ONLY[api][k] else ""))
    return [k for k in RUN_SAMPLING[api] if body.get(k) is not None]


def openai_request(body: dict) -> Request:
    """An OpenAI chat.completions body as a canonical Request."""
    _need(isinstance(body.get("messages"), list) and body["messages"], "'messages' must be a non-empty list")
    _no_n(body)
    messages = []
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        _need(isinstance(m, dict) and m.get("role") in ("system", "developer", "user", "assistant", "tool"),
              f"{where}: needs a role of system, developer, user, assistant or tool")
        msg = {"role": "system" if m["role"] == "developer" else m["role"],
               "content": (_content if m["role"] == "user" else _text)(m.get("content"), f"{where}.content")}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            _need(isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls), f"{where}.tool_calls: each needs a function")
            msg["tool_calls"] = [_call(c["function"].get("name"), c["function"].get("arguments", "{}"),
                                       c.get("id"), f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        messages.append(msg)
    logprobs = body.get("logprobs")
    _need(logprobs in (None, True, False), "logprobs must be a boolean")
    top = body.get("top_logprobs")
    _need(top is None or (type(top) is int and 0 <= top <= 20), "top_logprobs must be an integer in 0..20")
    _need(top is None or logprobs, "top_logprobs needs logprobs: true")
    options = body.get("stream_options")
    _need(options is None or isinstance(options, dict), "stream_options must be an object")
    tools = body.get("tools")
    _need(tools is None or (isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools)), "'tools' must be a list of {type: function, function: {name, ...}}")
    newer = body.get("max_completion_tokens")   # the newer name wins; either may be null
    return Request(messages, tools or None,
                   _limit(body.get("max_tokens") if newer is None else newer, "max_tokens"),
                   _stops(body.get("stop"), "stop", 4), bool(body.get("stream")),
                   (top or 0) if logprobs else None, bool((options or {}).get("include_usage")),
                   body.get("parallel_tool_calls") is False)


def anthropic_request(body: dict, count_only: bool = False) -> Request:
    """An Anthropic messages body as a canonical Request. `tool_result` blocks become `tool`
    messages placed before the message's text."""
    _need(isinstance(body.get("messages"), list) and body["messages"], "messages: must be a non-empty list")
    _need(count_only or "max_tokens" in body, "max_tokens: field required")
    messages = [{"role": "system", "content": _text(body["system"], "system")}] if body.get("system") else []
    for i, m in enumerate(body["messages"]):
        where = f"messages.{i}"
        _need(isinstance(m, dict) and m.get("role") in ("user", "assistant"),
              f"{where}.role: must be user or assistant")
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        _need(isinstance(blocks, list), f"{where}.content: must be a string or a list of blocks")
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "image" and m["role"] == "user":
                text.append({"type": "image", "image": _image_uri(b, f"{where}.content.{j}")})
            elif kind == "tool_use" and m["role"] == "assistant":
                _need(isinstance(b.get("input", {}), dict),
                      f"{where}.content.{j}.input: Input should be a valid dictionary")
                calls.append(_call(b.get("name"), b.get("input", {}), b.get("id"), f"{where}.content.{j}"))
            elif kind == "tool_result" and m["role"] == "user":
                result = _text(b.get("content"), f"{where}.content.{j}.content")
                messages.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                 "content": ("Error: " if b.get("is_error") else "") + result})
            elif kind not in ("thinking", "redacted_thinking") or m["role"] != "assistant":   # the trace has those
                raise BadRequest(f"{where}.content.{j}: unsupported block {kind!r} (text, "
                                 "tool_use in assistant turns and tool_result in user turns only)")
        if text or calls or not blocks:
            content = "".join(text) if all(isinstance(t, str) for t in text) else \
                [{"type": "text", "text": t} if isinstance(t, str) else t for t in text]
            messages.append({"role": m["role"], "content": content, **({"tool_calls": calls} if calls else {})})
    # A final assistant turn is a prefill the real API continues; rendered here it would start a new
    # turn, so the reply would not be what the API promises.
    _need(count_only or messages[-1]["role"] != "assistant",
          f"messages.{len(body['messages']) - 1}: a final assistant message (prefill) is not supported by this "
          "server: the reply would start a new turn instead of continuing it; end with a user message")
    tools = body.get("tools") or None
    _need(tools is None or (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                            for t in tools)), "tools: each tool needs a name")
    tools = tools and [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema", {})}} for t in tools]
    choice = body.get("tool_choice")
    return Request(messages, tools, None if count_only else _limit(body["max_tokens"], "max_tokens"),
                   _stops(body.get("stop_sequences"), "stop_sequences", 8), bool(body.get("stream")),
                   single_call=isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)


def responses_request(body: dict, history: dict[str, list[dict]]) -> tuple[Request, list[dict]]:
    """An OpenAI Responses body as (a canonical Request, its conversation without the instructions).
    `history` maps the session's response ids to their conversations (for previous_response_id)."""
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    _need(isinstance(items, list) and items, "'input' must be a string or a non-empty list of items")
    _no_n(body)
    previous = body.get("previous_response_id")
    _need(previous is None or (isinstance(previous, str) and previous in history),
          f"previous_response_id {previous!r} is not a response of this rollout; this server keeps "
          "no state across rollouts: send the whole input")
    messages = list(history[previous]) if previous is not None else []   # earlier instructions do not carry over
    for i, item in enumerate(items):
        where = f"input[{i}]"
        _need(isinstance(item, dict), f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            _need(role in ("system", "developer", "user", "assistant"),
                  f"{where}: needs a role of system, developer, user or assistant")
            parse = _content if role == "user" else _text
            messages.append({"role": "system" if role == "developer" else role,
                             "content": parse(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _call(item.get("name"), item.get("arguments", "{}"), item.get("call_id"), where)
            if messages and messages[-1]["role"] == "assistant":   # calls after a message are part of its turn
                messages[-1] = {**messages[-1], "tool_calls": messages[-1].get("tool_calls", []) + [call]}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":   # reasoning items: the trace holds the reasoning as sampled
            raise BadRequest(f"{where}: unsupported item type {kind!r} (message, function_call and "
                             "function_call_output only)")
    tools = body.get("tools") or None
    _need(tools is None or (isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools)),
          "'tools' must be a list of {type: function, name, parameters}: only function tools are supported")
    tools = tools and [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                         "parameters": t.get("parameters") or {}}} for t in tools]
    include = body.get("include") or []
    _need(isinstance(include, list), "'include' must be a list")
    top = body.get("top_logprobs")
    _need(top is None or (type(top) is int and 0 <= top <= 20), "top_logprobs must be an integer in 0..20")
    logprobs = "message.output_text.logprobs" in include or top is not None
    system = [{"role": "system", "content": _text(body["instructions"], "instructions")}] \
        if body.get("instructions") else []
    return Request(system + messages, tools, _limit(body.get("max_output_tokens"), "max_output_tokens"), [],
                   bool(body.get("stream")), (top or 0) if logprobs else None,
                   single_call=body.get("parallel_tool_calls") is False), messages


def _key(m: dict) -> tuple:
    """What must match for a message to count as the same one: role, text and calls
    (names and arguments as objects); ids and formatting aside."""
    calls = tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls", ()))
    content = m["content"] if isinstance(m["content"], str) else json.dumps(m["content"], sort_keys=True)
    return m["role"], content, calls


def _template_messages(messages: list[dict], native_tools: bool) -> list[dict]:
    """Canonical messages in the form the chat template takes. Without native tool
    support, calls are written as the `<tool_call>` text a model would sample."""
    out = []
    for m in messages:
        t = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls") and native_tools:
            t["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
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


# ---------------------------------------------------------------- the trace behind a session

@dataclass
class Reply:
    """One completion, whichever API asked for it."""
    text: str                 # text outside tool calls, cut before a stop string
    tool_calls: list[dict]    # {"id", "name", "arguments"}
    finish: str               # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    logprobs: list[dict] | None = None   # OpenAI's per-token form, when asked
    pieces: list[str] = field(default_factory=list)   # the text as streamed: one delta per sampled token
    reasoning: str | None = None         # what the reasoning parser took out of the text

    def deltas(self) -> list[tuple[str, list[dict] | None]]:
        """The text as streamed, each delta with its logprobs: one per sampled token when the pieces are
        the tokens, else all on the first delta (None: none asked, or a later delta)."""
        per_token = self.logprobs is not None and len(self.pieces) == len(self.logprobs)
        return [(d, self.logprobs[i:i + 1] if per_token else (self.logprobs if i == 0 else None))
                for i, d in enumerate(self.pieces or ([self.text] if self.text else []))]


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2, Llama 3, Qwen) -> the bytes they stand for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, t: int, text: str) -> list[int]:
    """The bytes token `t` stands for. Its decoded `text` is the answer unless the token holds part
    of a multi-byte character (decoding writes U+FFFD): then the vocabulary's own piece, a
    SentencePiece byte token `<0xE2>` or byte-level BPE's stand-in characters."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(t)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return [int(piece[3:5], 16)]
    table = _byte_decoder()
    return [table[c] for c in piece] if all(c in table for c in piece) else list(text.encode("utf-8"))


def _token_logprobs(tokenizer, ids: list[int], logprobs: list[float], tops: list | None) -> list[dict]:
    """Per token of `ids`: its text, bytes, logprob and alternatives."""
    def entry(t: int, lp: float) -> dict:
        text = tokenizer.decode([t], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": token_bytes(tokenizer, t, text)}
    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in (tops[i] if tops else [])]}
            for i, (t, lp) in enumerate(zip(ids, logprobs))]


class ChatSession:
    """The token-exact trace behind one rollout's requests, cut into segments."""

    def __init__(self, url: str, generate: Generate, tokenizer, sampling: dict, max_len: int,
                 image_tokens=None, parsers: tuple = (None, None)):
        self.id = secrets.token_hex(8)
        self.key = secrets.token_urlsafe(24)   # the rollout's secret: every request must carry it
        self.image_tokens = image_tokens   # vision.ImageTokens for a vision-language model
        self.base_url = f"{url}/s/{self.id}/v1"            # for the OpenAI SDK
        self.anthropic_base_url = f"{url}/s/{self.id}"     # the Anthropic SDK appends /v1/messages
        self.generate, self.tokenizer, self.parsers = generate, tokenizer, parsers   # parsers: `reply_parsers`
        self.sampling, self.max_len = dict(sampling), max_len
        self.native_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        self.segments: list[Trajectory] = []   # sealed segments; the last one is still growing
        self.keys: list[tuple] = []            # the conversation as the client sees it, last reply included
        self.rendered: list[dict] = []         # the same, as the template renders it (replies as sampled)
        self.tools: list[dict] | None = None
        self.reply_ids: list[int] = []
        self.last: tuple | None = None         # (api, body, response) for retries
        self.history: dict[str, list[dict]] = {}   # Responses API: response id -> its conversation
        self.lock = asyncio.Lock()              # one request at a time: the trace is one sequence
        self.requests, self.work, self.connections = 0, None, set()   # work: `off_loop`'s; connections: `_check_key`
        self.truncated = False
        self.error: BaseException | None = None   # a generate failure, re-raised by run_chat_agent
        self.in_flight: set[asyncio.Task] | None = set()   # requests waiting for their sample (None: closed)

    async def off_loop(self, fn, *args):
        """`fn(*args)` (CPU work) on a thread, after the session's previous one ends (a cancelled request's runs on)."""
        await asyncio.wait([self.work]) if self.work else None
        self.work = asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)
        return await asyncio.shield(self.work)

    def _uris(self, messages: list[dict]) -> list[str]:
        images = [p["image"] for m in messages if isinstance(m["content"], list)   # canonical image parts, in order
                  for p in m["content"] if p.get("type") == "image"]
        _need(not images or self.image_tokens, "this request shows images but the policy has no vision tower")
        return self.image_tokens.uris(images) if images else []

    def prompt(self, messages: list[dict],
               tools: list[dict] | None) -> tuple[list[int], list[int], list[dict], list[str]]:
        """(prompt ids, ids new to the trace, template messages, images new to the trace): the last segment
        extended when the request extends its conversation, else a fresh one (prompt is delta); pads expanded."""
        native = tools if self.native_tools else None
        # The whole last conversation, or all but its reply when that was empty: the OpenAI Agents SDK
        # (chat completions) drops an empty reply from the history it sends back.
        empty = [_key({"role": "assistant", "content": ""})]   # a reply with no text and no call
        held = [n for n in (len(self.keys), len(self.keys) - 1 if self.keys[-1:] == empty else -1)
                if 0 <= n < len(messages) and [_key(m) for m in messages[:n]] == self.keys[:n]]
        if self.segments and tools == self.tools and held:
            n = held[0]
            new = _template_messages(messages[n:], self.native_tools)
            with contextlib.suppress(PrefixRewrite):   # the template re-renders history: a new segment, below
                delta = delta_ids(self.tokenizer, self.rendered, self.reply_ids, new, native)
                images = self._uris(new)
                delta = self.image_tokens.expand(delta, images) if images else delta
                return self.segments[-1].tokens + delta, delta, self.rendered + new, images
        rendered = _template_messages(messages, self.native_tools)
        if tools and not self.native_tools:
            rendered = _tool_prompt(rendered, tools)
        ids = encode(self.tokenizer, render(self.tokenizer, rendered, True, native))
        images = self._uris(rendered)
        ids = self.image_tokens.expand(ids, images) if images else ids
        return ids, ids, rendered, images

    async def complete(self, req: Request) -> Reply:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        try:   # what vLLM's parsers read: the tools offered
            request = ChatCompletionRequest(model="policy", messages=[], tools=req.tools)
        except ValueError as e:
            raise BadRequest(f"tools: {e}") from None
        prompt, delta, rendered, new_images = await self.off_loop(self.prompt, req.messages, req.tools)
        budget = self.max_len - len(prompt)
        if budget <= 0:  # no room for even one token: an empty, cut-off reply; nothing recorded
            self.truncated = True
            return Reply("", [], "length", len(prompt), 0, logprobs=[] if req.top_logprobs is not None else None)
        run_limit = self.sampling.get("max_tokens") or budget
        limit = min(req.max_tokens or run_limit, run_limit, budget)
        images = (new_images if delta is prompt else self.segments[-1].images + new_images)
        sampling = {**self.sampling, "max_tokens": limit, **({"stop": req.stop} if req.stop else {}),
                    **({"top_logprobs": req.top_logprobs} if req.top_logprobs else {})}
        _need(self.in_flight is not None, "this rollout has ended")
        self.in_flight.add(task := asyncio.current_task())
        try:
            out = await sample(self.generate, prompt, images, sampling, self.image_tokens)
        except Exception as e:
            self.error = e
            raise
        finally:
            (self.in_flight or set()).discard(task)   # None once closed
        ids = list(out["token_ids"])
        if delta is prompt:
            self.segments.append(Trajectory(tokens=[], mask=[], logprobs=[], versions=[], reward=0.0))
        self.segments[-1].add(delta, False)
        self.segments[-1].images += new_images
        self.segments[-1].add(ids, True, out["logprobs"], out.get("versions", out["version"]))
        self.requests += 1
        sampled = decode_reply(self.tokenizer, ids)
        stop = out.get("stop_reason")
        cut = sampled.find(stop) if stop else -1   # the first match is where the engine stopped
        text = sampled[:cut] if cut >= 0 else sampled
        cutoff = out["finish_reason"] == "length"   # a call in a cut-off turn is not a call (the real APIs)
        reasoning, text, calls = parse_reply(text, self.parsers, request, not cutoff, 1 if req.single_call else None)
        reply = {"role": "assistant", "content": text, "tool_calls": calls}
        self.keys = [_key(m) for m in req.messages] + [_key(reply)]
        self.rendered = rendered + [{"role": "assistant", "content": sampled}]
        self.tools, self.reply_ids = req.tools, ids
        finish = "length" if cutoff else ("tool_calls" if calls else "stop")
        self.segments[-1].finish_reasons.append(finish)
        shown = ids[:-1] if ids and ids[-1] in end_ids(self.tokenizer) else ids   # a final end-of-turn aside
        logprobs = None if req.top_logprobs is None else \
            _token_logprobs(self.tokenizer, shown, out["logprobs"], out.get("top_logprobs"))
        # Streamed one piece per sampled token when the pieces make exactly the text; else whole (tool calls,
        # reasoning, a stop cut, a character split across tokens).
        pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in shown]
        return Reply(text, calls, finish, len(prompt), len(ids), stop if cut >= 0 else None, logprobs,
                     pieces if "".join(pieces) == text else [], reasoning)


# ---------------------------------------------------------------- replies: one Reply -> each API, whole or streamed

Event = tuple[str | None, Any]   # (SSE event name or None, data: a JSON object or a raw string)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _openai_calls(reply: Reply) -> list[dict]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in reply.tool_calls]


def openai_response(reply: Reply, model: str, req: Request) -> dict | list[Event]:
    usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
             "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    logprobs = None if reply.logprobs is None else {"content": reply.logprobs, "refusal": None}
    text = reply.text if reply.text or not reply.tool_calls else None
    head = {"id": _id("chatcmpl"), "created": int(time.time()), "model": model}
    think = {"reasoning_content": reply.reasoning} if reply.reasoning else {}   # as DeepSeek's API and LiteLLM
    if not req.stream:
        message: dict = {"role": "assistant", "content": text, **think}
        if reply.tool_calls:
            message["tool_calls"] = _openai_calls(reply)
        return {**head, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": reply.finish, "logprobs": logprobs}]}
    extra = {"usage": None} if req.usage_in_stream else {}

    def chunk(delta: dict, finish: str | None = None, lp: dict | None = None) -> Event:
        return None, {**head, "object": "chat.completion.chunk", **extra,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]}
    events = [chunk({"role": "assistant", "content": ""})] + ([chunk(think)] if think else [])
    if text:
        for piece, lp in reply.deltas():   # one chunk per sampled token, with its logprobs
            events.append(chunk({"content": piece}, lp=None if lp is None else {"content": lp, "refusal": None}))
    for i, c in enumerate(_openai_calls(reply)):   # the name first, then the arguments, as OpenAI streams them
        events.append(chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                             "function": {"name": c["function"]["name"], "arguments": ""}}]}))
        events.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]}))
    events.append(chunk({}, reply.finish))
    if req.usage_in_stream:
        events.append((None, {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}))
    return events + [(None, "[DONE]")]


def anthropic_response(reply: Reply, model: str, req: Request) -> dict | list[Event]:
    content = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
    content += [{"type": "text", "text": reply.text}] if reply.text or not reply.tool_calls else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
                for c in reply.tool_calls]
    stop = "stop_sequence" if reply.stop_sequence else \
        {"tool_calls": "tool_use", "length": "max_tokens"}.get(reply.finish, "end_turn")
    sequence = reply.stop_sequence if stop == "stop_sequence" else None
    message = {"id": _id("msg"), "type": "message", "role": "assistant", "model": model, "content": content,
               "stop_reason": stop, "stop_sequence": sequence,
               "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}}
    if not req.stream:
        return message
    events: list[Event] = [("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}})]
    for i, block in enumerate(content):
        if block["type"] == "text":
            start, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": t} for t, _ in reply.deltas()]
        elif block["type"] == "thinking":
            start, deltas = {**block, "thinking": ""}, [{"type": "thinking_delta", "thinking": reply.reasoning}]
        else:
            start = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        events += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}),
                   *[("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}) for d in deltas],
                   ("content_block_stop", {"type": "content_block_stop", "index": i})]
    end = {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence},
           "usage": {"output_tokens": reply.completion_tokens}}
    return events + [("message_delta", end), ("message_stop", {"type": "message_stop"})]


def responses_response(reply: Reply, model: str, req: Request, body: dict) -> tuple[str, dict | list[Event]]:
    """(the response id, the response or its events)."""
    done = "incomplete" if reply.finish == "length" else "completed"
    output = [{"type": "reasoning", "id": _id("rs"), "summary": [], "status": done,
               "content": [{"type": "reasoning_text", "text": reply.reasoning}]}] if reply.reasoning else []
    if reply.text or not reply.tool_calls:
        output.append({"type": "message", "id": _id("msg"), "role": "assistant", "status": done, "content": [
            {"type": "output_text", "text": reply.text, "annotations": [], "logprobs": reply.logprobs or []}]})
    output += [{"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": c["name"],
                "arguments": json.dumps(c["arguments"]), "status": "completed"} for c in reply.tool_calls]
    response = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
                "status": done, "incomplete_details": {"reason": "max_output_tokens"} if done == "incomplete" else None,
                "error": None, "instructions": body.get("instructions"), "output": output,
                "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
                "parallel_tool_calls": not req.single_call, "previous_response_id": body.get("previous_response_id"),
                "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
                "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
                          "total_tokens": reply.prompt_tokens + reply.completion_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}
    if not req.stream:
        return response["id"], response
    events: list[Event] = []

    def event(kind: str, **data):
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))
    for kind in ("response.created", "response.in_progress"):
        event(kind, response={**response, "status": "in_progress", "output": [], "usage": None})
    for i, item in enumerate(output):
        at = {"item_id": item["id"], "output_index": i}
        empty = {"content": []} if item["type"] != "function_call" else {"arguments": ""}
        event("response.output_item.added", output_index=i, item={**item, "status": "in_progress", **empty})
        if item["type"] == "message":
            part = item["content"][0]
            event("response.content_part.added", **at, content_index=0, part={**part, "text": "", "logprobs": []})
            for piece, lp in reply.deltas():   # one delta per sampled token, with its logprobs
                event("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=lp or [])
            event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part["logprobs"])
            event("response.content_part.done", **at, content_index=0, part=part)
        elif item["type"] == "reasoning":
            event("response.reasoning_text.delta", **at, content_index=0, delta=reply.reasoning)
            event("response.reasoning_text.done", **at, content_index=0, text=reply.reasoning)
        else:
            event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            event("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
        event("response.output_item.done", output_index=i, item=item)
    event("response.incomplete" if done == "incomplete" else "response.completed", response=response)
    return response["id"], events


def error_response(api: str, status: int, message: str):
    """An error in the API's own format, so each SDK raises its usual exception."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
        status, "invalid_request_error" if status < 500 else "api_error")
    body = ({"type": "error", "error": {"type": kind, "message": message}} if api == "anthropic"
            else {"error": {"message": message, "type": kind, "param": None, "code": None}})
    return web.json_response(body, status=status)


def _sse(events: list[Event]) -> bytes:
    return b"".join(((f"event: {name}\n" if name else "")
                     + f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n").encode()
                    for name, data in events)


async def _read_json(request) -> dict:
    """The body as a JSON object; every way a body can be malformed is a BadRequest (413 if too large, 408 if slow)."""
    try:
        raw = await asyncio.wait_for(request.read(), BODY_S)
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"the request body is over the server's limit of {MAX_BODY // 2**20} MiB", 413) from None
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {BODY_S:g} s", 408) from None
    try:   # JSON is UTF-8 (or -16/-32, detected); a Content-Type charset is not needed to read it
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode("utf-8")   # a lone surrogate cannot be tokenized
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except UnicodeError:
        raise BadRequest("the request body is not valid UTF-8 text (or holds a lone UTF-16 surrogate)") from None
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    _need(isinstance(body, dict), "the request body must be a JSON object")
    return body


def _check_key(request, session: "ChatSession | None"):
    """A 401 (its body unread) unless the request carries the rollout's key as `Authorization: Bearer` (OpenAI SDKs)
    or `x-api-key` (Anthropic's), compared in constant time; a 429 (then closed) past SESSION_CONNECTIONS."""
    _need(session, f"no open session {request.match_info['session']!r} (closed, or never opened)")   # a 404
    sent = (request.headers.get("Authorization", "").removeprefix("Bearer "), request.headers.get("x-api-key", ""))
    if not any(hmac.compare_digest(k.encode(), session.key.encode()) for k in sent):
        raise BadRequest("missing or wrong API key: send this rollout's key (OPENAI_API_KEY / ANTHROPIC_API_KEY, "
                         "a ChatAgent's ctx.api_key)", 401)
    held = {c for c in session.connections if c.transport is not None} | {request.protocol}
    if len(held) > SESSION_CONNECTIONS:
        request.protocol.close()   # once this reply is sent
        raise BadRequest(f"this rollout already has {SESSION_CONNECTIONS} connections open: reuse them", 429)
    session.connections = held


class ChatServer:
    """Loopback OpenAI/Anthropic server: `await server.start()`; `session = server.open_session(generate,
    tokenizer, sampling=..., max_len=...)`; requests to `session.base_url` / `session.anthropic_base_url`;
    `segments = server.close_session(session.id)`; `await server.stop()`."""

    def __init__(self, model_name: str = "policy", tool_parser: str = "hermes", reasoning_parser: str | None = None,
                 host: str | None = None):
        self.model_name, self.host = model_name, host or "127.0.0.1"
        self.parser_names = (tool_parser, reasoning_parser)   # vLLM's parsers of the policy's format
        self.sessions: dict[str, ChatSession] = {}
        self.url, self._runner = "", None

    async def start(self) -> str:
        app = web.Application(client_max_size=MAX_BODY)
        route = "/s/{session}/v1/"
        for path, api in (("chat/completions", "openai"), ("messages", "anthropic"), ("responses", "responses"),
                          ("messages/count_tokens", "count_tokens")):
            app.router.add_post(route + path, functools.partial(self._handle, api=api))
        app.router.add_get(route + "models{model:(/.+)?}", self._models)   # the list, or one
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        sock = socket.socket()
        sock.bind((self.host, 0))   # a free port; loopback unless told (--agent_resources, --server_host)
        # A client that disconnects (a timeout, a cancelled call) cancels its request: its reply is never trained.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, keepalive_timeout=IDLE_S)
        await self._runner.setup()
        self._runner.server.connection_made = self._connection_made
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"
        if self.host != "127.0.0.1":   # on every interface (0.0.0.0), clients connect at this node's Ray address
            import ray
            self.url = self.url.replace("0.0.0.0", ray.util.get_node_ip_address())
            log.warning("chat server: listening on %s, at %s (requests need their rollout's key)", self.host, self.url)
        return self.url

    async def stop(self):
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.url = None, ""

    def _connection_made(self, handler, transport):
        """aiohttp's; past MAX_CONNECTIONS the oldest connection with no request in progress closes (else this one)."""
        type(server := self._runner.server).connection_made(server, handler, transport)
        if len(held := [h for h in server.connections if h.transport]) > MAX_CONNECTIONS:   # (closed ones aside)
            idle = [h for h in held if h is not handler and not getattr(h, "_request_in_progress", False)]
            (idle or [handler])[0].force_close()

    def open_session(self, generate: Generate, tokenizer, *, sampling: dict, max_len: int,
                     image_tokens=None) -> ChatSession:
        if not self.url:
            raise ValueError("ChatServer.open_session: call `await server.start()` first")
        session = ChatSession(self.url, generate, tokenizer, sampling, max_len, image_tokens,
                              reply_parsers(*self.parser_names, tokenizer))
        self.sessions[session.id] = session
        return session

    def close_session(self, sid: str) -> list[Trajectory]:
        """Forget the session; its segments in order (later requests to it get 404). Its requests in
        flight are cancelled: nothing changes the rollout once it is handed back."""
        session = self.sessions.pop(sid)
        for task in session.in_flight:
            task.cancel()
        session.in_flight = None   # closed: it samples nothing more
        return session.segments

    async def _reply(self, session: ChatSession, api: str, body: dict) -> dict | list[Event]:
        """The response (a JSON object, or SSE events when streamed) to one parsed body."""
        model = str(body.get("model", self.model_name))
        if api == "count_tokens":
            req = await session.off_loop(anthropic_request, body, True)
            return {"input_tokens": len((await session.off_loop(session.prompt, req.messages, req.tools))[0])}
        if api == "responses":
            req, conversation = await session.off_loop(responses_request, body, session.history)
            reply = await session.complete(req)
            rid, response = responses_response(reply, model, req, body)
            session.history[rid] = conversation + [{"role": "assistant", "content": reply.text,
                                                    **({"tool_calls": reply.tool_calls} if reply.tool_calls else {})}]
            return response
        req = await session.off_loop(openai_request if api == "openai" else anthropic_request, body)
        return (openai_response if api == "openai" else anthropic_response)(await session.complete(req), model, req)

    async def _handle(self, request, api: str):
        from jinja2 import TemplateError
        session = self.sessions.get(request.match_info["session"])
        fmt = "anthropic" if api in ("anthropic", "count_tokens") else "openai"
        cached = False
        try:
            _check_key(request, session)
            async with session.lock:   # one request at a time: its body, then its CPU work (off the loop)
                body = await _read_json(request)
                ignored, key = check_fields(api, body), json.dumps(body, sort_keys=True)
                retry = request.headers.get("x-stainless-retry-count", "").lstrip("0").isdigit()   # > 0 (both SDKs)
                if api != "count_tokens" and session.last and session.last[:2] == (api, key) and retry:
                    response, cached = session.last[2], True   # a retry: same reply, recorded once
                else:
                    response = await self._reply(session, api, body)
                    if api != "count_tokens":
                        session.last = (api, key, response)
        except BadRequest as e:
            return error_response(fmt, 404 if session is None else e.status, str(e))
        except (TemplateError, RecursionError, UnicodeError) as e:   # e.g. a template that insists roles alternate
            return error_response(fmt, 400, f"the chat template cannot render this request: {e}")
        except Exception as e:
            if session.error is not e:
                log.exception("chat server: request failed")
            return error_response(fmt, 500, f"{type(e).__name__}: {e}")
        headers = {**({"x-molt-cached": "true"} if cached else {}),
                   **({"x-molt-ignored": ", ".join(ignored)} if ignored else {})}   # the run's sampling applies
        if isinstance(response, dict):
            return web.json_response(response, headers=headers)
        return web.Response(body=_sse(response), content_type="text/event-stream",
                            headers={**headers, "Cache-Control": "no-cache"})

    async def _models(self, request):
        """The one model, in a shape both SDKs parse (OpenAI's list and Anthropic's page)."""
        model = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "molt",
                 "type": "model", "display_name": self.model_name, "created_at": "1970-01-01T00:00:00Z"}
        session = self.sessions.get(request.match_info["session"])
        try:
            _check_key(request, session)
        except BadRequest as e:
            return error_response("openai", 404 if session is None else e.status, str(e))
        return web.json_response(model if request.match_info["model"] else {"object": "list", "data": [model],
                                 "has_more": False, "first_id": self.model_name, "last_id": self.model_name})

    async def _not_found(self, request):
        api = "anthropic" if "/messages" in request.path else "openai"
        return error_response(api, 404, f"no route {request.method} {request.path}; OpenAI clients use ctx.base_url "
                              "(.../s/<session>/v1), Anthropic clients ctx.anthropic_base_url (.../s/<session>)")
