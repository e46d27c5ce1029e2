"""The ChatAgent loopback server: stock OpenAI and Anthropic SDKs over one token-exact trace.

(The agent contract, `ChatAgent` and `run_chat_agent`, is in agent.py; this is the HTTP half. Each API's wire format
is dialects.py's; the trace and its rendering, `Trajectory`, `render`/`encode`, `delta_ids`, `sample`, trajectory.py's.)

`ChatServer` (aiohttp, on 127.0.0.1 unless told, in the caller's event loop) serves one URL prefix per rollout,
`/s/<session>/v1/`, to requests that carry the rollout's key (`Authorization: Bearer` or `x-api-key`; else a 401): POST chat/completions (OpenAI), responses (OpenAI; previous_response_id within the
session) and messages (Anthropic), each streamed or not; POST messages/count_tokens; GET models.

Each API is decoded into one canonical request (`Request`), and a `ChatSession` turns requests into a token-exact
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
from typing import Any

from aiohttp import web

from dialects import (BadRequest, Event, Reply, Request, anthropic_request, anthropic_response, check_fields,
                      json_args, need, openai_request, openai_response, responses_request, responses_response)
from trajectory import (Generate, PrefixRewrite, Trajectory, decode_reply, delta_ids, encode, end_ids, render,
                        sample)

log = logging.getLogger("molt")
MAX_BODY = 64 * 2**20   # long conversations with images exceed aiohttp's 1 MiB default
IDLE_S, BODY_S, SESSION_CONNECTIONS = 30.0, 60.0, 8   # what a client can hold: docs/server.md, "Limits"
MAX_CONNECTIONS = max(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) // 2 or 2**15   # in all: half the driver's fds
_POOL = ThreadPoolExecutor(MAX_CONNECTIONS, "molt-chat-server")   # requests' CPU work (each holds a connection)

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
    got = [{"id": c.id, "name": c.function.name, "arguments": json_args(c.function.arguments)}
           for c in (found.tool_calls if found and found.tools_called else [])]
    if not got or not all(isinstance(c["arguments"], dict) for c in got):
        return reasoning, text, []
    return reasoning, (found.content or "").strip(), got[:most]


def _key(m: dict) -> tuple:
    """What must match for a message to be the same: role, text, calls (arguments as objects); not ids or formatting."""
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


# ---------------------------------------------------------------- the trace behind a session

def token_bytes(tokenizer, t: int, text: str) -> list[int]:
    """The bytes token `t` stands for. Its decoded `text` is the answer unless the token holds part
    of a multi-byte character (decoding writes U+FFFD): then the vocabulary's own piece, a
    SentencePiece byte token `<0xE2>` or byte-level BPE's stand-in characters."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(t)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return [int(piece[3:5], 16)]
    from transformers.convert_slow_tokenizer import bytes_to_unicode   # byte-level BPE's (GPT-2, Llama 3, Qwen)
    table = {c: b for b, c in bytes_to_unicode().items()}
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
        template = getattr(tokenizer, "chat_template", None) or ""
        self.native_tools, self.switch = "tools" in template, "enable_thinking" in template   # switch: Qwen3's
        self.segments: list[Trajectory] = []   # sealed segments; the last one is still growing
        self.keys: list[tuple] = []            # the conversation as the client sees it, last reply included
        self.rendered: list[dict] = []         # the same, as the template renders it (replies as sampled)
        self.tools, self.reply_ids = None, []   # (tools, thinking switch) as the last reply was sampled; its ids
        self.last: tuple | None = None         # (api, body, response) for retries
        self.history: dict[str, list[dict]] = {}   # Responses API: response id -> its conversation
        self.lock = asyncio.Lock()              # one request at a time: the trace is one sequence
        self.refused = []                       # "STATUS message" of each request answered with an error
        self.requests, self.work, self.connections = 0, None, set()   # work: `off_loop`'s; connections: `_check_key`
        self.truncated = False
        self.error: BaseException | None = None   # a generate failure, re-raised by run_chat_agent
        self.in_flight: set[asyncio.Task] | None = set()   # requests waiting for their sample (None: closed)

    async def off_loop(self, fn, *args):
        """`fn(*args)` (CPU work) on a thread, after the session's previous one ends (a cancelled request's runs on)."""
        await asyncio.wait([self.work]) if self.work else None
        self.work = asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)
        return await asyncio.shield(self.work)

    def _expand(self, ids: list[int], messages: list[dict]) -> tuple[list[int], list[str]]:
        """(`ids` with the pads of the images `messages` show expanded, those images' URIs)."""
        images = [p["image"] for m in messages if isinstance(m["content"], list)   # canonical image parts, in order
                  for p in m["content"] if p.get("type") == "image"]
        need(not images or self.image_tokens, "this request shows images but the policy has no vision tower")
        uris = self.image_tokens.uris(images) if images else []
        return (self.image_tokens.expand(ids, uris) if uris else ids), uris

    def prompt(self, messages: list[dict], tools: list[dict] | None,
               think: bool | None = None) -> tuple[list[int], list[int], list[dict], list[str]]:
        """(prompt ids, ids new to the trace, template messages, images new to the trace): the last segment
        extended when the request extends its conversation, else a fresh one (prompt is delta); pads expanded."""
        native, think = tools if self.native_tools else None, think if self.switch else None
        options = {} if think is None else {"enable_thinking": think}   # the template's own default, or the request's
        # The whole last conversation, or all but its reply when that was empty: the OpenAI Agents SDK
        # (chat completions) drops an empty reply from the history it sends back.
        empty = [_key({"role": "assistant", "content": ""})]   # a reply with no text and no call
        held = [n for n in (len(self.keys), len(self.keys) - 1 if self.keys[-1:] == empty else -1)
                if 0 <= n < len(messages) and [_key(m) for m in messages[:n]] == self.keys[:n]]
        if self.segments and (tools, think) == self.tools and held:
            n = held[0]
            new = _template_messages(messages[n:], self.native_tools)
            with contextlib.suppress(PrefixRewrite):   # the template re-renders history: a new segment, below
                delta = delta_ids(self.tokenizer, self.rendered, self.reply_ids, new, native, **options)
                delta, images = self._expand(delta, new)
                return self.segments[-1].tokens + delta, delta, self.rendered + new, images
        rendered = _template_messages(messages, self.native_tools)
        if tools and not self.native_tools:   # a template without tool support: the tools in the system message
            text = ("You can call these tools:\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n"
                    'To call one, write <tool_call>{"name": <name>, "arguments": <JSON object>}</tool_call>.')
            if rendered and rendered[0]["role"] == "system":
                text = rendered.pop(0)["content"] + "\n\n" + text
            rendered = [{"role": "system", "content": text}] + rendered
        ids = encode(self.tokenizer, render(self.tokenizer, rendered, True, native, **options))
        ids, images = self._expand(ids, rendered)
        return ids, ids, rendered, images

    async def complete(self, req: Request) -> Reply:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        try:   # what vLLM's parsers read: the tools offered
            request = ChatCompletionRequest(model="policy", messages=[], tools=req.tools)
        except ValueError as e:
            raise BadRequest(f"tools: {e}") from None
        prompt, delta, rendered, new_images = await self.off_loop(self.prompt, req.messages, req.tools, req.think)
        budget = self.max_len - len(prompt)
        if budget <= 0:  # no room for even one token: an empty, cut-off reply; nothing recorded
            self.truncated = True
            return Reply("", [], "length", len(prompt), 0, logprobs=[] if req.top_logprobs is not None else None)
        limit = min(req.max_tokens or budget, self.sampling.get("max_tokens") or budget, budget)
        images = (new_images if delta is prompt else self.segments[-1].images + new_images)
        sampling = {**self.sampling, "max_tokens": limit, **({"stop": req.stop} if req.stop else {}),
                    **({"top_logprobs": req.top_logprobs} if req.top_logprobs else {})}
        need(self.in_flight is not None, "this rollout has ended")
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
        self.tools, self.reply_ids = (req.tools, req.think if self.switch else None), ids
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


def error_response(api: str, status: int, message: str):
    """An error in the API's own format, so each SDK raises its usual exception."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
        status, "invalid_request_error" if status < 500 else "api_error")
    body = ({"type": "error", "error": {"type": kind, "message": message}} if api == "anthropic"
            else {"error": {"message": message, "type": kind, "param": None, "code": None}})
    return web.json_response(body, status=status)


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
    need(isinstance(body, dict), "the request body must be a JSON object")
    return body


def _check_key(request, session: "ChatSession | None"):
    """A 401 (its body unread) unless the request carries the rollout's key as `Authorization: Bearer` (OpenAI SDKs)
    or `x-api-key` (Anthropic's), compared in constant time; a 429 (then closed) past SESSION_CONNECTIONS."""
    need(session, f"no open session {request.match_info['session']!r} (closed, or never opened)", 404)
    sent = (request.headers.get("Authorization", "").removeprefix("Bearer "), request.headers.get("x-api-key", ""))
    need(any(hmac.compare_digest(k.encode(), session.key.encode()) for k in sent), "missing or wrong API key: send "
         "this rollout's key (OPENAI_API_KEY / ANTHROPIC_API_KEY, a ChatAgent's ctx.api_key)", 401)
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
        model = str(body.get("model", self.model_name))
        if api == "count_tokens":
            req = await session.off_loop(anthropic_request, body, True)
            ids = (await session.off_loop(session.prompt, req.messages, req.tools, req.think))[0]
            return {"input_tokens": len(ids)}
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

        def refuse(status: int, message: str):   # the rollout's drop names them (agent.run_chat_agent)
            if session is not None:
                session.refused.append(f"{status} {message[:300]}")
            return error_response(fmt, status, message)
        try:
            _check_key(request, session)
            async with session.lock:   # one request at a time: its body, then its CPU work (off the loop)
                body = await _read_json(request)
                ignored, key = check_fields(api, body, session.switch), json.dumps(body, sort_keys=True)
                retry = request.headers.get("x-stainless-retry-count", "").lstrip("0").isdigit()   # > 0 (both SDKs)
                if api != "count_tokens" and session.last and session.last[:2] == (api, key) and retry:
                    response, cached = session.last[2], True   # a retry: same reply, recorded once
                else:
                    response = await self._reply(session, api, body)
                    if api != "count_tokens":
                        session.last = (api, key, response)
        except BadRequest as e:
            return refuse(e.status, str(e))
        except (TemplateError, RecursionError, UnicodeError) as e:   # e.g. a template that insists roles alternate
            return refuse(400, f"the chat template cannot render this request: {e}")
        except Exception as e:
            if session.error is not e:
                log.exception("chat server: request failed")
            return refuse(500, f"{type(e).__name__}: {e}")
        headers = {**({"x-molt-cached": "true"} if cached else {}),
                   **({"x-molt-ignored": ", ".join(ignored)} if ignored else {})}   # the run's sampling applies
        if isinstance(response, dict):
            return web.json_response(response, headers=headers)
        sse = b"".join(((f"event: {name}\n" if name else "")   # server-sent events
                        + f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n").encode()
                       for name, data in response)
        return web.Response(body=sse, content_type="text/event-stream",
                            headers={**headers, "Cache-Control": "no-cache"})

    async def _models(self, request):
        """The one model, in a shape both SDKs parse (OpenAI's list and Anthropic's page)."""
        name = request.match_info["model"][1:] or self.model_name   # any name is the policy, as in every POST
        model = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "molt",
                 "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        try:
            _check_key(request, self.sessions.get(request.match_info["session"]))
        except BadRequest as e:
            return error_response("openai", e.status, str(e))
        return web.json_response(model if request.match_info["model"] else {"object": "list", "data": [model],
                                 "has_more": False, "first_id": self.model_name, "last_id": self.model_name})

    async def _not_found(self, request):
        api = "anthropic" if "/messages" in request.path else "openai"
        return error_response(api, 404, f"no route {request.method} {request.path}; OpenAI clients use ctx.base_url "
                              "(.../s/<session>/v1), Anthropic clients ctx.anthropic_base_url (.../s/<session>)")
