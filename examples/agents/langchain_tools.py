"""A ChatAgent on LangChain (`langchain-openai`): a streamed tool-calling loop with ChatOpenAI.

`ChatOpenAI` is pointed at `ctx.base_url` (OpenAI chat completions) with one tool bound; each turn is streamed with
`astream` and the chunks are summed into the reply, as LangChain agents do with streaming on. Tool calls are run and
their results sent back as `ToolMessage`s; then the agent asks a follow-up question ("?c=": the larger of the answer
and c). The reward is 1 if the final reply is max(a, b, c). All requests of the rollout are one token-exact trace.

    python main.py --agent examples/agents/langchain_tools.py --max_len 768
"""

import random

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agent import ChatAgent, Result


@tool
def larger(a: int, b: int) -> int:
    """The larger of two digits."""
    return max(a, b)


class LangChainMax(ChatAgent):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            a, b, c = rng.randrange(10), rng.randrange(10), rng.randrange(10)
            yield {"prompt": f"{a}?{b}=", "label": {"follow_up": f"?{c}=", "answer": str(max(a, b, c))}}

    async def run(self, ctx):
        llm = ChatOpenAI(model=ctx.model_name, base_url=ctx.base_url, api_key=ctx.api_key,
                         max_retries=0).bind_tools([larger])
        messages, calls = [HumanMessage(ctx.prompt)], 0
        for question in (None, ctx.label["follow_up"]):
            if question:
                messages.append(HumanMessage(question))
            for _ in range(3):   # a turn: the model, then its tool calls, until it answers
                reply = None
                async for chunk in llm.astream(messages):
                    reply = chunk if reply is None else reply + chunk
                messages.append(reply)
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    calls += 1
                    try:
                        result = str(larger.invoke(call["args"]))
                    except ValueError as e:   # the model's arguments do not fit the tool
                        result = f"error: {e}"
                    messages.append(ToolMessage(result, tool_call_id=call["id"]))
        return Result(reward=float(reply.content == ctx.label["answer"]), info={"tool_calls": calls})
