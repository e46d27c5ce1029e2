"""A ChatAgent on the stock Anthropic SDK, streamed: `client.messages.stream(...)`.

The same task as chat_anthropic.py (answer "a?b=", then check the answer), with the SDK's stream helper: text arrives
as deltas and `get_final_message()` assembles the reply. The stream is a rendering of the sampled token ids, so the
trace is the same as unstreamed. A long `max_tokens` (which the SDK will not send without streaming) is fine: the
server clamps it to the run's `--max_new_tokens`.

    python main.py --agent examples/agents/chat_anthropic_stream.py
"""

import random

import anthropic

from agent import ChatAgent, Result

CHECK = "=?"


class StreamedCheckedMax(ChatAgent):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            if a != b:
                yield {"prompt": f"{a}?{b}=", "label": str(max(a, b))}

    async def run(self, ctx):
        async with anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key) as client:
            messages, texts = [{"role": "user", "content": ctx.prompt}], []
            for follow_up in (CHECK, None):
                async with client.messages.stream(model=ctx.model_name, max_tokens=32000, messages=messages) as stream:
                    texts.append("".join([t async for t in stream.text_stream]))
                    reply = await stream.get_final_message()
                messages.append({"role": "assistant", "content": reply.content})
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        right = texts[-1] == ctx.label and reply.stop_reason == "end_turn"
        return Result(reward=float(right), info={"first_right": float(texts[0] == ctx.label)})
