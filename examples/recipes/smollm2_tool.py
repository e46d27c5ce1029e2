"""Three-digit multiplication with a Python tool: the agent of the SmolLM2 tool recipe.

"What is 964 * 494?" A 135M model cannot multiply three-digit numbers in its head, so
the task needs the tool and a second turn: the model writes a ```python block, the
sandbox (examples/agents/python_tool.run_python) runs it, its output comes back as the next user turn
("Output:\n476216"), and the model answers. The answer is the number in <answer>...</answer>, or else the last number
of the final turn (SmolLM2 rarely writes the tag); the final turn is the first one without code. Reward = 1 when that
number is the product, else 0: the task's truth, no format shaping. As in a notebook, a snippet whose last line is a
bare expression prints its value.

Env form, not ChatAgent: the episode is a fixed loop (reply, run the code, show the output) that needs no agent
framework, and run_env appends the observation's tokens to the trajectory directly instead of a round trip through the
loopback HTTP server per turn (on a 2-core CPU every millisecond of agent overhead is one the engine does not get).

Rows may carry "tool": false (the no-tool ablation): then the prompt asks for the number
directly, the episode has one turn and code is not run. The held-out problems are fixed
(HELDOUT_SEED) and never among the training prompts:

    PYTHONPATH=. python examples/recipes/smollm2_tool.py OUT_DIR     # writes heldout.jsonl, heldout_notool.jsonl
    python main.py --model smollm2 --agent examples/recipes/smollm2_tool.py --eval_only \
        --eval_dataset OUT_DIR/heldout.jsonl --max_new_tokens 48 --max_len 512
"""

import ast
import importlib.util
import json
import random
import re
import sys
from pathlib import Path

from agent import Env, Result

_spec = importlib.util.spec_from_file_location(
    "python_tool", Path(__file__).resolve().parents[1] / "agents" / "python_tool.py")
python_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(python_tool)

HELDOUT_SEED, HELDOUT_SIZE = 20261202, 128
NUMBER = re.compile(r"-?\d+")

SYSTEM = ("You can run Python. To compute something, write a ```python code block that prints it; "
          "you will see its output. Then reply with the answer.")
NO_TOOL = "Answer with the number only."
# One worked example, as real turns: code block, its output, then the answer.
EXAMPLE = [{"role": "user", "content": "What is 123 * 456?"},
           {"role": "assistant", "content": "```python\nprint(123 * 456)\n```"},
           {"role": "user", "content": "Output:\n56088\n"},
           {"role": "assistant", "content": "The answer is 56088."}]


def problem(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(100, 1000), rng.randrange(100, 1000)


def heldout() -> list[tuple[int, int]]:
    rng, found = random.Random(HELDOUT_SEED), {}   # a dict: distinct problems, in the order drawn
    while len(found) < HELDOUT_SIZE:
        found[problem(rng)] = None
    return list(found)


def row(a: int, b: int, tool: bool = True) -> dict:
    question = {"role": "user", "content": f"What is {a} * {b}?"}
    prompt = [{"role": "system", "content": SYSTEM}, *EXAMPLE, question] if tool else \
        [{"role": "system", "content": NO_TOOL}, question]
    return {"prompt": prompt, "label": str(a * b), "tool": tool}


def final_answer(text: str) -> str | None:
    tagged = re.search(r"<answer>\s*(.*?)\s*</answer>", text, re.DOTALL)
    found = NUMBER.findall((tagged.group(1) if tagged else text).replace(",", ""))
    return found[-1] if found else None


def notebook(code: str) -> str:
    """`code`, with its last statement printed when it is a bare expression."""
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return code   # the sandbox shows the error
    if body and isinstance(body[-1], ast.Expr) and not (
            isinstance(body[-1].value, ast.Call) and getattr(body[-1].value.func, "id", "") == "print"):
        lines, start = code.splitlines(), body[-1].lineno - 1
        return "\n".join(lines[:start] + ["print((" + "\n".join(lines[start:]) + "))"])
    return code


class MultiplyWithPython(Env):
    max_turns = 3

    @classmethod
    def prompts(cls, seed):
        rng, held = random.Random(seed), set(heldout())
        while True:
            pair = problem(rng)
            if pair not in held:
                yield row(*pair)

    async def reset(self, row):
        self.runs = 0

    async def step(self, state):
        tool = state.row.get("tool", True)
        code = python_tool.extract_code(state.action) if tool else None
        if code is None or "<answer>" in state.action:
            answer = final_answer(state.action)
            right = float(answer == state.label)
            return Result(reward=right, info={"tool": float(self.runs > 0), "answered": float(answer is not None),
                                              "tool_then_right": right * (self.runs > 0)})
        self.runs += 1
        output = await python_tool.run_python(notebook(code))
        return Result(reward=0.0, observation=f"Output:\n{output[:200]}", terminated=False,
                      info={"tool": 1.0, "answered": 0.0, "tool_then_right": 0.0})


def main(argv: list[str]):
    """Write the held-out problems (with and without the tool) as dataset files into argv[0]."""
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, tool in (("heldout.jsonl", True), ("heldout_notool.jsonl", False)):
        (out / name).write_text("".join(json.dumps(row(a, b, tool)) + "\n" for a, b in heldout()))


if __name__ == "__main__":
    main(sys.argv[1:])
