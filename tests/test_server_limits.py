"""What one client can cost the driver's event loop and its file descriptors (server.py; issue 46, defects 6
and 7): a request's decoding, rendering and tokenizing run off the loop, one request's at a time per session;
idle and slow connections time out, and connections are capped per session and in total.

No engine: the fake one (tests/fakes.py). Nothing here asserts a duration: each arrangement is explicit (a
tokenizer that waits on the test, a connection closed or not), with generous timeouts that only a failure meets."""

import asyncio
import json
import threading

import aiohttp
import pytest

import server as srv
from fakes import fake, ids

WAIT = 20.0   # what only a failure waits for
PER_SESSION = getattr(srv, "SESSION_CONNECTIONS", 8)


class Gated:
    """A tokenizer whose encoding of a long text waits until the test opens the gate; it counts the encodings
    running at once. (`encode` calls the tokenizer; everything else passes through.)"""

    def __init__(self, tokenizer, long: int = 10_000):
        self.tokenizer, self.long = tokenizer, long
        self.entered, self.opened, self.lock = threading.Semaphore(0), threading.Event(), threading.Lock()
        self.running = self.most = self.timed_out = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, **kw):
        if len(text) < self.long:
            return self.tokenizer(text, **kw)
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.entered.release()
        self.timed_out += not self.opened.wait(WAIT)   # on the event loop, this wait would block the test too
        try:
            return self.tokenizer(text, **kw)
        finally:
            with self.lock:
                self.running -= 1


def _count_body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


async def _count(http, s, text: str) -> tuple[int, dict]:
    async with http.post(f"{s.anthropic_base_url}/v1/messages/count_tokens", data=_count_body(text),
                         headers={"x-api-key": s.key}) as r:
        return r.status, await r.json()


async def _entered(gate: Gated) -> bool:
    return await asyncio.to_thread(gate.entered.acquire, timeout=WAIT)


def test_a_large_request_is_worked_off_the_loop_one_at_a_time_per_session(loop, tiny_tokenizer):
    """While one session's large request is being tokenized, another session's request is answered; the session's
    next request waits for its previous one's work to end, even one whose client gave up."""
    gate = Gated(tiny_tokenizer)
    big = "3?7=" * 5_000

    async def go():
        server = srv.ChatServer()
        await server.start()
        a = server.open_session(fake(gate, []), gate, sampling={"max_tokens": 4}, max_len=64)
        b = server.open_session(fake(tiny_tokenizer, []), tiny_tokenizer, sampling={"max_tokens": 4}, max_len=64)
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(_count(http, a, big))
            assert await _entered(gate)   # a's text is being tokenized now
            other = await _count(http, b, "3?7=")   # the loop answers b meanwhile
            first.cancel()   # a's client gives up: its work runs on
            second = asyncio.create_task(_count(http, a, big + "1"))
            early = await asyncio.to_thread(gate.entered.acquire, timeout=2)   # (only a failure enters now)
            gate.opened.set()
            got = await second
        await server.stop()
        return other, got, early
    other, got, early = loop.run_until_complete(go())
    assert not gate.timed_out, "the event loop was blocked while a large request was tokenized"
    assert other == (200, {"input_tokens": len(ids(tiny_tokenizer, "<|user|>3?7=<|end|><|assistant|>"))})
    assert got[0] == 200 and got[1]["input_tokens"] > 20_000
    assert not early and gate.most == 1, "two of one session's requests were tokenized at once"


# ----------------------------------------------------------- connections


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


async def _connect(server, head: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*_address(server))
    writer.write(head)
    await writer.drain()
    return reader, writer


async def _closed(reader) -> bool:
    """Whether the server closes the connection (whatever it sent before); False if it is still open after WAIT."""
    try:
        while await asyncio.wait_for(reader.read(2**16), WAIT):
            pass
        return True
    except TimeoutError:
        return False


async def _status(reader) -> int:
    return int((await asyncio.wait_for(reader.readline(), WAIT)).split()[1])


def _get(s, key: str | None = None) -> bytes:
    path = s.base_url.split("/", 3)[3]
    return f"GET /{path}/models HTTP/1.1\r\nHost: x\r\n{f'x-api-key: {key}' if key else 'x: y'}\r\n\r\n".encode()


def test_idle_and_slow_connections_time_out(loop, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(srv, "IDLE_S", 1.0, raising=False)
    monkeypatch.setattr(srv, "BODY_S", 1.0, raising=False)

    async def go():   # (a StreamWriter closes its connection when it is collected: the test keeps each one)
        server = srv.ChatServer()
        await server.start()
        s = server.open_session(fake(tiny_tokenizer, []), tiny_tokenizer, sampling={"max_tokens": 4}, max_len=64)
        path = s.base_url.split("/", 3)[3]
        silent, slow_head, slow_body, keyless, kept = [await _connect(server, head) for head in (
            b"", b"POST /s/x/v1/messages HTTP/1.1\r\nHost: x\r\n",   # headers that never end
            f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: {s.key}\r\nContent-Length: 100\r\n"
            f"\r\n{{\"mess".encode(),   # a body that never ends
            f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {50 * 2**20}\r\n\r\n".encode(),
            _get(s, s.key))]
        got = (await _status(keyless[0]), await _status(slow_body[0]), await _status(kept[0]))
        closed = [await _closed(r) for r, _ in (silent, slow_head, kept)]
        for _, w in (slow_body, keyless):   # (the server reads what they send for a while: aiohttp's lingering)
            w.close()
        await server.stop()
        return got, closed
    (keyless, slow_body, kept), closed = loop.run_until_complete(go())
    assert keyless == 401   # refused before its body
    assert slow_body == 408
    assert kept == 200
    assert closed == [True, True, True]   # silent, slow headers, idle after its reply


def test_connections_are_capped_per_session_and_in_total(loop, tiny_tokenizer, monkeypatch):
    async def go():
        server = srv.ChatServer()
        await server.start()
        monkeypatch.setattr(srv, "MAX_CONNECTIONS", 6, raising=False)
        s = server.open_session(fake(tiny_tokenizer, []), tiny_tokenizer, sampling={"max_tokens": 4}, max_len=64)
        idle = [await _connect(server) for _ in range(10)]   # send nothing, carry no key
        idle += await asyncio.gather(*(_connect(server) for _ in range(10)))   # and at once
        async with aiohttp.ClientSession(headers={"x-api-key": s.key}) as http:
            async with http.get(f"{s.base_url}/models") as r:
                served = r.status
        evicted = await asyncio.gather(*(_closed(r) for r, _ in idle[:5]))   # the oldest idle ones made room
        alive = sum(h.transport is not None for h in server._runner.server.connections)
        for _, w in idle:
            w.close()
        monkeypatch.setattr(srv, "MAX_CONNECTIONS", 100, raising=False)
        keyed = [await _connect(server, _get(s, s.key)) for _ in range(PER_SESSION + 1)]
        statuses = [await _status(r) for r, _ in keyed]
        refused = keyed[statuses.index(429)] if 429 in statuses else keyed[0]
        refused_closed = await _closed(refused[0])
        keyed[statuses.index(200)][1].close()   # one of the session's connections ends: room for another
        for _ in range(200):   # until the server has seen it end
            if sum(c.transport is not None for c in getattr(s, "connections", ())) < PER_SESSION:
                break
            await asyncio.sleep(0.05)
        again = await _connect(server, _get(s, s.key))
        anonymous = await _connect(server, _get(s))   # keyless: a 401, not one of the session's
        after = (await _status(again[0]), await _status(anonymous[0]))
        await server.stop()
        return served, evicted, alive, sorted(statuses), refused_closed, after
    served, evicted, alive, statuses, refused_closed, after = loop.run_until_complete(go())
    assert served == 200 and evicted == [True] * 5 and alive <= 6, (evicted, alive)
    assert statuses == [200] * PER_SESSION + [429] and refused_closed, statuses
    assert after == (200, 401)
