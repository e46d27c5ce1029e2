"""Grade a reasoning-gym task with its own scorer: the agent of the SmolLM2 recipe.

Single turn. The reply's last number is the answer (small instruct models
rarely write the bare number); reward = the task's score of that answer
(`data.score_reasoning_gym`), and 0 when the reply is cut off by
--max_new_tokens, so the policy also learns to answer briefly.

    python main.py --model smollm2 --agent examples/recipes/smollm2_agent.py \
        --dataset reasoning-gym:chain_sum:min_terms=2,max_terms=2,max_digits=1

Without --dataset it trains on that same default task.
"""

import re

import data
from agent import Env, Result

DEFAULT_TASK = "reasoning-gym:chain_sum:min_terms=2,max_terms=2,max_digits=1"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ReasoningGymAnswer(Env):
    @classmethod
    def prompts(cls, seed):
        yield from data.reasoning_gym_rows(DEFAULT_TASK, seed)

    async def step(self, state):
        found = NUMBER.findall(state.action.replace(",", ""))
        answer = found[-1] if found else None
        finished = state.finish_reason == "stop"
        score = data.score_reasoning_gym(state.row, answer) if answer is not None else 0.0
        return Result(reward=score if finished else 0.0, score=score,
                      info={"answered": float(answer is not None), "finished": float(finished)})
