"""Built-in default task: name the larger of two digits ("3?7=" -> "7").

Single turn, graded by plain Python: reward 1 for exactly the larger digit, else 0. A random policy over the tiny
model's ~20-token vocabulary solves it well under 1% of the time; a trained one almost always. The answer is copied
from the prompt, which is what lets a random-init model learn it by RL alone (see DESIGN notes on tiny-task
learnability).

    python main.py --agent examples/agents/max_digit.py
"""

import random

from agent import Env, Result


class MaxDigit(Env):
    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            if a != b:
                yield {"prompt": f"{a}?{b}=", "label": str(max(a, b))}

    async def step(self, state):
        # Exactly the digit, then the end of the turn: no padding, no stray tokens.
        return Result(reward=float(state.action == state.label and state.finish_reason == "stop"))
