"""Small fakes for unit isolation (every feature also has a real-engine test), and test helpers."""

import asyncio
import threading
import time

FLAGS: dict[str, threading.Event] = {}


def flag(name: str) -> threading.Event:
    """A named event shared by a test and the agent code it runs in this process (agents run
    in the driver, on agent threads): an agent holds until the test's hook sets it."""
    return FLAGS.setdefault(name, threading.Event())


async def until(name: str):
    """In agent code: wait (without blocking its thread) until flag `name` is set."""
    while not flag(name).is_set():
        await asyncio.sleep(0.01)


class FakeEngine:
    """Samples fixed replies as token ids and records every prompt it was given."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.prompts = tokenizer, list(replies), []

    async def __call__(self, ids, sampling):
        self.prompts.append(list(ids))
        reply = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        reply = reply[: sampling["max_tokens"]]
        return {"token_ids": reply, "logprobs": [-0.5] * len(reply), "version": 3, "finish_reason": "stop"}


async def tokens_out(gen, n: int, timeout: float = 60.0, requests: int = 1):
    """Wait until `requests` requests in flight (samples of one vLLM request count apart) have
    each produced at least n tokens."""
    deadline = time.monotonic() + timeout
    while sum(s.detokenizer.num_output_tokens() >= n
              for s in gen.engine.output_processor.request_states.values()) < requests:
        assert time.monotonic() < deadline, f"no request produced {n} tokens within {timeout}s"
        await asyncio.sleep(0.005)


class Recorder:
    """Wraps a generate function; keeps every (prompt ids, output) the engine got and gave."""

    def __init__(self, generate):
        self.generate, self.calls, self.sampling = generate, [], []

    async def __call__(self, ids, sampling):
        out = await self.generate(ids, sampling)
        self.calls.append((list(ids), out))
        self.sampling.append(dict(sampling))
        return out


def fake(tokenizer, replies):
    """A Recorder over a fake engine that samples `replies` in order: text (then the end of
    the turn) or a list of ids (sampled as is, cut off: finish_reason "length"); stop strings
    end a reply at the token that completes one, as vLLM does."""
    replies = list(replies)

    async def generate(ids, sampling):
        reply = replies.pop(0)
        cut = isinstance(reply, list)
        if not cut:
            reply = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        reply, stop = reply[: sampling["max_tokens"]], None
        for n in range(1, len(reply) + 1):   # like vLLM: end at the first token that completes a stop string
            text = tokenizer.decode(reply[:n])
            stop = next((s for s in sampling.get("stop", ()) if s in text), None)
            if stop:
                reply, cut = reply[:n], False
                break
        return {"token_ids": reply, "logprobs": [-0.25 * (i + 1) for i in range(len(reply))],
                "version": 7, "finish_reason": "length" if cut else "stop", "stop_reason": stop}
    return Recorder(generate)


def check_token_exact(segments, calls):
    """Each engine call's prompt + completion is a prefix of one segment, in order, and the
    segment ends with its last call's completion; masks cover exactly the completions,
    which carry the engine's logprobs and versions."""
    i = 0
    for seg in segments:
        assert len(seg.tokens) == len(seg.mask) == len(seg.logprobs) == len(seg.versions)
        mask, first = [0] * len(seg.tokens), i
        while i < len(calls):
            prompt, out = calls[i]
            a, b = len(prompt), len(prompt) + len(out["token_ids"])
            if seg.tokens[:b] != prompt + out["token_ids"]:
                break
            mask[a:b] = [1] * (b - a)
            assert seg.logprobs[a:b] == out["logprobs"]
            assert seg.versions[a:b] == out.get("versions", [out["version"]] * (b - a))
            i += 1
        assert i > first, "a segment that no engine call produced"
        assert seg.tokens == calls[i - 1][0] + calls[i - 1][1]["token_ids"]
        assert seg.mask == mask
        assert all(lp == 0.0 and v == -1 for lp, v, m in zip(seg.logprobs, seg.versions, seg.mask) if not m)
    assert i == len(calls), "engine calls missing from the trace"


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trainer_logprobs(trainer, trajectories: list[dict]) -> list[list[float]]:
    """The trainer's logprobs of each trajectory's tokens (position t scores token t+1), as
    its step scores them. With several ranks every rank must be called with the same trajectories."""
    import batches
    batch = batches.collate(trajectories, trainer.pad_id, trainer.dims.cp)
    old = trainer._score(batch)["old"]
    return [row[:len(t["tokens"]) - 1] for row, t in zip(old.tolist(), trajectories)]


def other_value(s):
    """A value of losses.Setting `s` inside its bounds that is not its default (the generic
    tests move every declared setting with it)."""
    def fits(v):
        try:
            s.check("x", v)
        except ValueError:
            return False
        return v != s.default
    return next(s.type(v) for v in (s.low, s.high, 0.5, 2.0, 3.0, 10.0) if v is not None and fits(s.type(v)))
