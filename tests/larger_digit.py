"""The Env of the retired bench/turn_credit.py (git show f7853c9:bench/turn_credit.py), for tests/test_loop.py: two
turns, each shows a digit d ("3=") and is right when the reply starts with a larger digit; the reward (1 if both
were right) comes only at the end; `Result.state_key` names the state (digit shown, still winnable)."""

import random

from agent import Env, Result


class LargerDigit(Env):
    max_turns = 2

    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:
            yield {"prompt": f"{rng.randrange(8)}="}

    async def reset(self, row):
        self.winnable, self.rng = True, random.Random(row["prompt"])

    async def step(self, state):
        shown = (state.observation or state.prompt)[0]
        self.winnable &= state.action[:1].isdigit() and state.action[:1] > shown
        if state.turn == 0:
            d = str(self.rng.randrange(8))
            return Result(0.0, observation=f"{d}=", terminated=False, state_key=f"{d}{'+' if self.winnable else '-'}")
        return Result(float(self.winnable))
