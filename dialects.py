"""Each API dialect's wire format (OpenAI Chat Completions and Responses, Anthropic Messages) in and out of one
canonical form: a body -> `Request` (`openai_request`, `responses_request`, `anthropic_request`, after `check_fields`),
a `Reply` -> the API's response or its server-sent events (`openai_response`, ...). Pure functions of JSON; the
HTTP server and the token-exact trace behind them are server.py's. What each field gets: docs/server.md.
"""

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any


class BadRequest(ValueError):
    """A request the server refuses; `status` is the HTTP status (4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def need(cond: Any, message: str, status: int = 400):
    if not cond:
        raise BadRequest(message, status)


# ---------------------------------------------------------------- requests: each API -> one canonical form

TEXT_PARTS = ("text", "input_text", "output_text")   # Chat/Anthropic, Responses input, Responses output
IMAGE_PARTS = ("image_url", "image", "input_image")


def _text(content: Any, where: str) -> str:
    """Message content as one string: a string, None, or a list of text parts/blocks (any of TEXT_PARTS)."""
    if content is None or isinstance(content, str):
        return content or ""
    need(isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                           and isinstance(p.get("text"), str) for p in content),
         f"{where}: only text content is supported")
    return "".join(p["text"] for p in content)


def _image_uri(part: dict, where: str) -> str:
    """The data URI of an image part/block (base64 only: the server is offline, so URLs are refused)."""
    if part.get("type") in ("image_url", "input_image"):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        need(isinstance(url, str) and url.startswith("data:image/"),
             f"{where}: image_url must be a data URI (data:image/...;base64,...); URLs are not fetched")
        return url
    src = part.get("source")
    need(isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str),
         f"{where}: image blocks need a base64 source; URLs are not fetched")
    return f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"


def _content(content: Any, where: str) -> str | list[dict]:
    """User content: a string, or, when it shows images, parts [{"type": "text"|"image", "text"|"image": ...}]."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                for p in content):
        return _text(content, where)
    parts = []
    for j, p in enumerate(content):
        need(isinstance(p, dict), f"{where}.{j}: must be an object")
        if p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif p.get("type") in IMAGE_PARTS:
            parts.append({"type": "image", "image": _image_uri(p, f"{where}.{j}")})
        else:
            raise BadRequest(f"{where}.{j}: unsupported content part {p.get('type')!r} (text and images only)")
    return parts


def json_args(arguments: Any) -> Any:
    """OpenAI sends tool arguments as a JSON string; keep the object it encodes."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except (json.JSONDecodeError, RecursionError):
        return arguments


def _call(name: Any, arguments: Any, call_id: Any, where: str) -> dict:
    need(isinstance(name, str) and name, f"{where}: a tool call needs a name")
    return {"id": str(call_id or ""), "name": name, "arguments": json_args(arguments)}


@dataclass
class Request:
    messages: list[dict]
    tools: list[dict] | None = None      # OpenAI chat form [{"type": "function", "function": {...}}]
    max_tokens: Any = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    top_logprobs: int | None = None      # None: no logprobs asked; k: the sampled token's and k alternatives
    usage_in_stream: bool = False        # OpenAI stream_options.include_usage
    single_call: bool = False            # parallel_tool_calls false / disable_parallel_tool_use
    think: bool | None = None            # what a thinking switch is asked (`thinking`); None: nothing


def _limit(value: Any, name: str) -> Any:
    need(value is None or (type(value) is int and value > 0), f"{name} must be a positive integer")
    return value


def _stops(value: Any, name: str, most: int) -> list[str]:
    stops = [value] if isinstance(value, str) else (value or [])
    need(isinstance(stops, list) and len(stops) <= most and all(isinstance(s, str) and s for s in stops),
         f"{name} must be a non-empty string or a list of at most {most} non-empty strings")
    return stops


def _no_n(body: dict):
    need(body.get("n") in (1, None), "n > 1 is not supported: send one request per sample "
                                      "(each request samples anew, and each sample is its own rollout segment)")


# Every top-level field each API knows (as of openai 3.57 and anthropic 2.15), in three kinds
# beside those the decoders below read: INERT fields do not change the sample (ids, metadata,
# caching and routing hints); IGNORED ones give way to the run (the reply names them in `x-molt-ignored`):
# its sampling, and thinking and effort, but for THINKING's fields where the template has a thinking
# switch (they set it); ONLY fields are honoured at the listed values (what the server does anyway)
# and refused at any other, as are keys outside _KEYS (a structured output_config.format). Unknown
# fields are refused, as the real APIs refuse them.
_READ = {"openai": "model messages tools max_tokens max_completion_tokens stop stream stream_options logprobs "
                   "top_logprobs n",
         "anthropic": "model messages max_tokens system stop_sequences stream tools",
         "count_tokens": "model messages system tools",
         "responses": "model input instructions tools max_output_tokens stream previous_response_id include "
                      "top_logprobs"}
_CACHE = "metadata service_tier safety_identifier prompt_cache_key prompt_cache_retention prompt_cache_options moderation"
_ANTHROPIC_INERT = "cache_control speed workspace_id user_profile_id"
_INERT = {"openai": "user store " + _CACHE, "responses": "user store stream_options client_metadata " + _CACHE,
          "anthropic": "metadata service_tier inference_geo " + _ANTHROPIC_INERT, "count_tokens": _ANTHROPIC_INERT}
_THINK = "thinking output_config context_management"
IGNORED = {"openai": "temperature top_p seed reasoning_effort", "anthropic": "temperature top_p top_k " + _THINK,
           "count_tokens": _THINK, "responses": "temperature top_p reasoning"}
_KEYS = {"reasoning": ("effort", "summary", "generate_summary"), "thinking": ("type", "budget_tokens", "display"),
         "output_config": ("effort",)}
THINKING = ("reasoning_effort", "reasoning", "thinking")   # what a template's thinking switch follows
MODES = ("none", "disabled", "minimal", "low", "medium", "high", "xhigh", "max", "enabled", "adaptive")   # 2 off
_AUTO = {"type": "auto"}
_ANTHROPIC_ONLY = {"output_format": (), "container": (), "diagnostics": (), "tool_choice": (
    _AUTO, *({**_AUTO, "disable_parallel_tool_use": b} for b in (False, True)))}
_ONLY = {"openai": {"tool_choice": ("auto",), "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
                    "modalities": (["text"],), "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                    "verbosity": (), "audio": (), "prediction": (), "web_search_options": (),
                    "functions": (), "function_call": ()},
         "anthropic": _ANTHROPIC_ONLY, "count_tokens": _ANTHROPIC_ONLY,
         "responses": {"tool_choice": ("auto",), "parallel_tool_calls": (True, False), "truncation": ("disabled",),
                       "text": ({"format": {"type": "text"}},), "background": (False,),
                       "background_options": (), "context_management": (), "conversation": (), "prompt": (),
                       "max_tool_calls": (), "image": (), "access_programs": ()}}
_ACCEPTED = {api: {*_READ[api].split(), *_INERT[api].split(), *IGNORED[api].split()} for api in _READ}


def check_fields(api: str, body: dict, switch: bool = False) -> list[str]:
    """Refuse (BadRequest) what `api` cannot honour; for `x-molt-ignored`, the IGNORED fields the body sets (THINKING's
    honoured with a thinking `switch`), the `include`s it cannot give, and strict tools (sampled unconstrained)."""
    for k, v in body.items():
        if k in _ACCEPTED[api]:
            if k in _KEYS and v is not None and not (isinstance(v, dict) and set(v) <= set(_KEYS[k])):
                raise BadRequest(f"{k}={json.dumps(v)[:80]} is not supported by this server (keys: {', '.join(_KEYS[k])})")
            continue
        if k not in _ONLY[api]:
            raise BadRequest(f"{k}: Extra inputs are not permitted" if api in ("anthropic", "count_tokens")
                             else f"Unrecognized request argument supplied: {k}")
        need(v is None or v in _ONLY[api][k], f"{k}={json.dumps(v)[:80]} is not supported by this server" + (
            f" (only {' or '.join(json.dumps(x) for x in _ONLY[api][k])})" if _ONLY[api][k] else ""))
    include = body["include"] if isinstance(body.get("include"), list) else []   # (a field of responses only)
    tools = body["tools"] if isinstance(body.get("tools"), list) else []   # a chat tool's fields are its function's
    strict = any(isinstance(t, dict) and isinstance(f := t.get("function", t), dict) and f.get("strict") for t in tools)
    return [k for k in IGNORED[api].split() if body.get(k) is not None and not (switch and k in THINKING)] + \
        [str(i) for i in include if i != "message.output_text.logprobs"] + ["tools.strict"] * strict


def thinking(body: dict) -> bool | None:
    """The thinking switch a request asks for: off at effort none or thinking disabled, on at any other; None: none."""
    k = next((k for k in THINKING if body.get(k) is not None), "")
    mode = body[k].get("effort", body[k].get("type")) if isinstance(body.get(k), dict) else body.get(k)
    need(mode in (None, *MODES), f"{k}={json.dumps(body.get(k))[:80]} is not supported by this server")
    return None if mode is None else mode not in MODES[:2]


def openai_request(body: dict) -> Request:
    need(isinstance(body.get("messages"), list) and body["messages"], "'messages' must be a non-empty list")
    _no_n(body)
    messages = []
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        need(isinstance(m, dict) and m.get("role") in ("system", "developer", "user", "assistant", "tool"),
             f"{where}: needs a role of system, developer, user, assistant or tool")
        msg = {"role": "system" if m["role"] == "developer" else m["role"],
               "content": (_content if m["role"] == "user" else _text)(m.get("content"), f"{where}.content")}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            need(isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                 for c in calls), f"{where}.tool_calls: each needs a function")
            msg["tool_calls"] = [_call(c["function"].get("name"), c["function"].get("arguments", "{}"),
                                       c.get("id"), f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        messages.append(msg)
    logprobs = body.get("logprobs")
    need(logprobs in (None, True, False), "logprobs must be a boolean")
    top = body.get("top_logprobs")
    need(top is None or (type(top) is int and 0 <= top <= 20), "top_logprobs must be an integer in 0..20")
    need(top is None or logprobs, "top_logprobs needs logprobs: true")
    options = body.get("stream_options")
    need(options is None or isinstance(options, dict), "stream_options must be an object")
    tools = body.get("tools")
    need(tools is None or (isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools)), "'tools' must be a list of {type: function, function: {name, ...}}")
    newer = body.get("max_completion_tokens")   # the newer name wins; either may be null
    return Request(messages, tools or None,
                   _limit(body.get("max_tokens") if newer is None else newer, "max_tokens"),
                   _stops(body.get("stop"), "stop", 4), bool(body.get("stream")),
                   (top or 0) if logprobs else None, bool((options or {}).get("include_usage")),
                   body.get("parallel_tool_calls") is False, thinking(body))


def anthropic_request(body: dict, count_only: bool = False) -> Request:
    """An Anthropic messages body as a Request; `tool_result` blocks become `tool` messages before its text."""
    need(isinstance(body.get("messages"), list) and body["messages"], "messages: must be a non-empty list")
    need(count_only or "max_tokens" in body, "max_tokens: field required")
    messages = [{"role": "system", "content": _text(body["system"], "system")}] if body.get("system") else []
    for i, m in enumerate(body["messages"]):
        where = f"messages.{i}"
        need(isinstance(m, dict) and m.get("role") in ("user", "assistant", "system"),   # system: Claude Code's, mid-turn
             f"{where}.role: must be user, assistant or system")
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        need(isinstance(blocks, list), f"{where}.content: must be a string or a list of blocks")
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "image" and m["role"] == "user":
                text.append({"type": "image", "image": _image_uri(b, f"{where}.content.{j}")})
            elif kind == "tool_use" and m["role"] == "assistant":
                need(isinstance(b.get("input", {}), dict),
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
    need(count_only or messages[-1]["role"] != "assistant",
         f"messages.{len(body['messages']) - 1}: a final assistant message (prefill) is not supported by this "
         "server: the reply would start a new turn instead of continuing it; end with a user message")
    tools = body.get("tools") or None
    need(tools is None or (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                           for t in tools)), "tools: each tool needs a name")
    tools = tools and [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema", {})}} for t in tools]
    choice = body.get("tool_choice")
    return Request(messages, tools, None if count_only else _limit(body["max_tokens"], "max_tokens"),
                   _stops(body.get("stop_sequences"), "stop_sequences", 8), bool(body.get("stream")),
                   single_call=isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True,
                   think=thinking(body))


def responses_request(body: dict, history: dict[str, list[dict]]) -> tuple[Request, list[dict]]:
    """An OpenAI Responses body as (a canonical Request, its conversation without the instructions).
    `history` maps the session's response ids to their conversations (for previous_response_id)."""
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    need(isinstance(items, list) and items, "'input' must be a string or a non-empty list of items")
    _no_n(body)
    previous = body.get("previous_response_id")
    need(previous is None or (isinstance(previous, str) and previous in history),
         f"previous_response_id {previous!r} is not a response of this rollout; this server keeps "
         "no state across rollouts: send the whole input")
    messages = list(history[previous]) if previous is not None else []   # earlier instructions do not carry over
    for i, item in enumerate(items):
        where = f"input[{i}]"
        need(isinstance(item, dict), f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            need(role in ("system", "developer", "user", "assistant"),
                 f"{where}: needs a role of system, developer, user or assistant")
            messages.append({"role": "system" if role == "developer" else role, "content": (
                _content if role == "user" else _text)(item.get("content"), f"{where}.content")})
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
    need(tools is None or (isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools)),
         "'tools' must be a list of {type: function, name, parameters}: only function tools are supported")
    tools = tools and [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                         "parameters": t.get("parameters") or {}}} for t in tools]
    include = body.get("include") or []
    need(isinstance(include, list), "'include' must be a list")
    top = body.get("top_logprobs")
    need(top is None or (type(top) is int and 0 <= top <= 20), "top_logprobs must be an integer in 0..20")
    logprobs = "message.output_text.logprobs" in include or top is not None
    system = [{"role": "system", "content": _text(body["instructions"], "instructions")}] \
        if body.get("instructions") else []
    return Request(system + messages, tools, _limit(body.get("max_output_tokens"), "max_output_tokens"), [],
                   bool(body.get("stream")), (top or 0) if logprobs else None,
                   single_call=body.get("parallel_tool_calls") is False, think=thinking(body)), messages


# ---------------------------------------------------------------- replies: one Reply -> each API, whole or streamed

@dataclass
class Reply:
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


Event = tuple[str | None, Any]   # (SSE event name or None, data: a JSON object or a raw string)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def openai_response(reply: Reply, model: str, req: Request) -> dict | list[Event]:
    usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
             "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    logprobs = None if reply.logprobs is None else {"content": reply.logprobs, "refusal": None}
    text = reply.text if reply.text or not reply.tool_calls else None
    head = {"id": _id("chatcmpl"), "created": int(time.time()), "model": model}
    think = {"reasoning_content": reply.reasoning} if reply.reasoning else {}   # as DeepSeek's API and LiteLLM
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in reply.tool_calls]
    if not req.stream:
        message: dict = {"role": "assistant", "content": text, **think}
        if reply.tool_calls:
            message["tool_calls"] = calls
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
    for i, c in enumerate(calls):   # the name first, then the arguments, as OpenAI streams them
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
               "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}   # as the API sends them
    if not req.stream:
        return message
    events: list[Event] = [("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**message["usage"], "output_tokens": 0}}})]
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
