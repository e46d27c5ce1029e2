"""A ChatAgent on the stock OpenAI SDK, two turns: the larger of three digits.

The agent asks "a?b=", appends the model's reply to the conversation, then asks
"?c=": the larger of the previous answer and c. The reward is 1 if the final
reply is exactly max(a, b, c). The agent owns the loop and uses
`openai.AsyncOpenAI` unchanged; the framework's loopback server at
`ctx.base_url` turns both requests into one token-exact trace. The prompts use
only the tiny default model's vocabulary, so it trains from scratch on CPU:

    python main.py --agent examples/agents/chat_openai.py
"""

import random

import openai

from agent import ChatAgent, Result


class RunningMax(ChatAgent):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            a, b, c = rng.randrange(10), rng.randrange(10), rng.randrange(10)
            yield {"prompt": f"{a}?{b}=", "label": {"follow_up": f"?{c}=", "answer": str(max(a, b, c)),
                                                   "first": str(max(a, b))}}

    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            messages = list(ctx.messages)
            first = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=4)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": ctx.label["follow_up"]}]
            final = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=4)
        choice = final.choices[0]
        right = choice.message.content == ctx.label["answer"] and choice.finish_reason == "stop"
        return Result(reward=float(right),
                      info={"first_right": float(first.choices[0].message.content == ctx.label["first"])})
