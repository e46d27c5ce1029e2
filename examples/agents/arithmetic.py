"""A reasoning-gym math task: single-turn arithmetic, graded by the dataset's own scorer.

Prompts are generated offline by `reasoning_gym.create_dataset("basic_arithmetic")` (a fresh seed each epoch); the
model must put its result in <answer>...</answer> (reasoning-gym's default system prompt asks for that) and the reward
is the dataset's `score_answer` (1 for the exact answer, partial credit when the answer is inside a longer one). To
train on another reasoning-gym task, change DATASET and CONFIG: the label is the whole dataset entry, so any task's
scorer works.

The tiny default model cannot read these prompts (its vocabulary is digits and
a few symbols); use a real chat model, e.g. SmolLM2-135M-Instruct:

    pip install reasoning-gym
    python main.py --agent examples/agents/arithmetic.py --model PATH/TO/MODEL
"""

import functools
import itertools

from agent import Env, Result

DATASET = "basic_arithmetic"
CONFIG = {"min_terms": 2, "max_terms": 3, "max_digits": 2, "operators": ("+", "-", "*")}


@functools.cache
def _scorer(name: str):
    import reasoning_gym
    return reasoning_gym.get_score_answer_fn(name)


def grade(reply: str, entry: dict) -> float:
    """The dataset's score for the <answer> in `reply` (0 without one)."""
    from reasoning_gym.utils import extract_answer
    return float(_scorer(DATASET)(extract_answer(reply), entry))


class Arithmetic(Env):
    @classmethod
    def prompts(cls, seed):
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS
        for epoch in itertools.count():
            data = reasoning_gym.create_dataset(DATASET, size=1000, seed=seed * 100_003 + epoch, **CONFIG)
            for entry in data:
                yield {"prompt": [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                                  {"role": "user", "content": entry["question"]}],
                       "label": {"question": entry["question"], "answer": entry["answer"],
                                 "metadata": entry["metadata"]}}

    async def step(self, state):
        return Result(reward=grade(state.action, state.label))
