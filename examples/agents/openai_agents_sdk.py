"""A ChatAgent on the OpenAI Agents SDK (`openai-agents`), unchanged: an Agent with a function tool.

The SDK talks the Responses API (`POST /v1/responses`) to the loopback server at
`ctx.base_url`. The rollout is two runs of one conversation: a streamed run on
"a?b=" (the larger digit; the model may call `larger` for it), then a second run
on the first run's items plus "?c=" (the larger of that answer and c), which the
SDK re-sends as history; the server recognises it and extends the same
token-exact trace. The reward is 1 if the final answer is max(a, b, c); a reply cut
off by `--max_new_tokens` (which the SDK raises on) gets 0. Tracing is off: runs are
offline. On the tiny default model the tool prompt is long (its
vocabulary spells it out character by character), so give it room:

    python main.py --agent examples/agents/openai_agents_sdk.py --max_len 768
"""

import random

import openai
from agents import Agent, ModelBehaviorError, OpenAIResponsesModel, RunConfig, Runner, function_tool

from agent import ChatAgent, Result


@function_tool
def larger(a: int, b: int) -> int:
    """The larger of two digits."""
    return max(a, b)


class ToolMax(ChatAgent):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            a, b, c = rng.randrange(10), rng.randrange(10), rng.randrange(10)
            yield {"prompt": f"{a}?{b}=", "label": {"follow_up": f"?{c}=", "answer": str(max(a, b, c))}}

    async def run(self, ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            agent = Agent(name="max", tools=[larger], model=OpenAIResponsesModel(ctx.model_name, client))
            config = RunConfig(tracing_disabled=True)
            try:
                first = Runner.run_streamed(agent, ctx.prompt, run_config=config, max_turns=3)
                async for _ in first.stream_events():   # a streamed run: the same trace as an unstreamed one
                    pass
                history = first.to_input_list() + [{"role": "user", "content": ctx.label["follow_up"]}]
                final = await Runner.run(agent, history, run_config=config, max_turns=3)
            except ModelBehaviorError:   # the SDK refuses a reply cut off by --max_new_tokens ("incomplete")
                return Result(reward=0.0, info={"cut_off": 1.0})
        answer = str(final.final_output).strip()
        return Result(reward=float(answer == ctx.label["answer"]), info={"cut_off": 0.0})
