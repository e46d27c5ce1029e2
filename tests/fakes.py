"""Small fakes for unit isolation (every feature also has a real-engine test)."""


class FakeEngine:
    """Samples fixed replies as token ids and records every prompt it was given."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.prompts = tokenizer, list(replies), []

    async def __call__(self, ids, sampling):
        self.prompts.append(list(ids))
        reply = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        reply = reply[: sampling["max_tokens"]]
        return {"token_ids": reply, "logprobs": [-0.5] * len(reply), "version": 3, "finish_reason": "stop"}
