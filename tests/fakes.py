"""Small fakes for unit isolation (every feature also has a real-engine test), and test helpers."""

import asyncio
import time


class FakeEngine:
    """Samples fixed replies as token ids and records every prompt it was given."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.prompts = tokenizer, list(replies), []

    async def __call__(self, ids, sampling):
        self.prompts.append(list(ids))
        reply = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        reply = reply[: sampling["max_tokens"]]
        return {"token_ids": reply, "logprobs": [-0.5] * len(reply), "version": 3, "finish_reason": "stop"}


async def tokens_out(gen, n: int, timeout: float = 60.0):
    """Wait until the engine's one request in flight has produced at least n tokens."""
    deadline = time.monotonic() + timeout
    while not any(s.detokenizer.num_output_tokens() >= n
                  for s in gen.engine.output_processor.request_states.values()):
        assert time.monotonic() < deadline, f"no request produced {n} tokens within {timeout}s"
        await asyncio.sleep(0.005)
