"""A ChatAgent on the stock Anthropic SDK, two turns: answer, then check the answer.

The agent asks "a?b=" (the larger digit), appends the model's reply blocks to
the conversation as they came, then sends CHECK, asking the model to check its
answer and reply again. The reward is 1 if the final reply is right, so a
policy learns to keep (or fix) its answer. The agent uses `anthropic.AsyncAnthropic`
unchanged, pointed at `ctx.anthropic_base_url` (the SDK adds /v1/messages).
CHECK is written in the tiny default model's vocabulary, so it trains on CPU;
with a real model write it in words ("Check your answer; reply with the digit only."):

    python main.py --agent examples/agents/chat_anthropic.py
"""

import random

import anthropic

from agent import ChatAgent, Result

CHECK = "=?"


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


class CheckedMax(ChatAgent):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            if a != b:
                yield {"prompt": f"{a}?{b}=", "label": str(max(a, b))}

    async def run(self, ctx):
        async with anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key) as client:
            messages = [{"role": "user", "content": ctx.prompt}]
            first = await client.messages.create(model=ctx.model_name, max_tokens=4, messages=messages)
            messages += [{"role": "assistant", "content": first.content},
                         {"role": "user", "content": CHECK}]
            final = await client.messages.create(model=ctx.model_name, max_tokens=4, messages=messages)
        right = _text(final) == ctx.label and final.stop_reason == "end_turn"
        return Result(reward=float(right), info={"first_right": float(_text(first) == ctx.label)})
