"""Learning past the window, on this file's Env (tiny model): 7 digits shown one per turn with filler, then "?"
asks for the largest, 140 tokens in all, 3.5x --max_len 40. Under truncation (`--context none`) the episode ends
before the question; under `--context window --context_turns 1` each turn starts a segment from the prompt, the
last reply and the new digit, so the answer is right only if the replies carried the running maximum. Each reply
that is the largest digit so far earns 1/8 (the answer too); success is the answer's (score_mean, the mean of the
last 10 steps within the budget). Truncation samples fewer tokens per rollout, so it runs 3x the prompts per step,
and both are compared at the smaller run's cumulative sampled tokens, 80 steps each, over seeds. Ends with
    success at equal sampled tokens: truncation A, rewrite B (N seeds)

    flock /tmp/molt.lock python bench/past_window.py [SEEDS]     # default 2 seeds; ~25 min on 2 CPU cores
    python main.py --agent bench/past_window.py --context window --context_turns 1 --max_len 40   # one run
"""

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent import Env, Result  # noqa: E402

FILL, FACTS = ",,,,,,,,,,,,", 7
TASK = ["--agent", __file__, "--max_len", "40", "--context_turns", "1", "--lr", "2e-3", "--steps", "80"]
CONFIGS = {"truncation": [*TASK, "--context", "none", "--prompts_per_step", "96"],
           "rewrite": [*TASK, "--context", "window", "--prompts_per_step", "32"]}


class PastWindow(Env):
    max_turns = FACTS + 1

    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:   # the largest uniform in 0..9 (a constant answer scores 10%), at a random turn
            top = rng.randrange(10)
            digits = [rng.randrange(top + 1) for _ in range(FACTS)]
            digits[rng.randrange(FACTS)] = top
            yield {"prompt": f"{digits[0]}{FILL}", "label": digits}

    async def step(self, state):
        right = float(state.action == str(max(state.label[:state.turn + 1])) and state.finish_reason == "stop")
        if state.turn == FACTS:   # the answer
            return Result(reward=right / (FACTS + 1), score=right)
        shown = f"{state.label[state.turn + 1]}{FILL}" if state.turn < FACTS - 1 else "?"
        return Result(reward=right / (FACTS + 1), score=0.0, observation=shown, terminated=False)


def success(steps: list[tuple], budget: float) -> float:
    scores = [score for tokens, score in steps if tokens <= budget * 1.0001][-10:]
    return sum(scores) / max(len(scores), 1)


def run(args: list[str], seed: int, out: Path) -> list[tuple]:
    """(cumulative sampled tokens, score) per step of one main.py run."""
    cmd = [sys.executable, "main.py", *args, "--seed", str(seed), "--output_dir", str(out), "--max_new_tokens", "2",
           "--quiet", "--no_plot", "--export_hf", "none"]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], check=True, stdout=subprocess.DEVNULL)
    tokens = 0.0
    for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        tokens += m["response_len"] * m["rollouts"]
        yield tokens, m["score_mean"]


def main():
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {(n, s): list(run(CONFIGS[n], s, Path(tmp) / f"{n}-{s}")) for s in seeds for n in CONFIGS}
    found = {n: [] for n in CONFIGS}
    for s in seeds:
        budget = min(runs[n, s][-1][0] for n in CONFIGS)
        for n in CONFIGS:
            found[n].append(success(runs[n, s], budget))
        print(f"seed {s}: at {budget:,.0f} sampled tokens success truncation {found['truncation'][-1]:.3f}, rewrite "
              f"{found['rewrite'][-1]:.3f} (its last 10 steps: {success(runs['rewrite', s], float('inf')):.3f})")
    mean = {n: sum(v) / len(v) for n, v in found.items()}
    print(f"success at equal sampled tokens: truncation {mean['truncation']:.3f}, rewrite {mean['rewrite']:.3f} "
          f"({len(seeds)} seeds)")


if __name__ == "__main__":
    main()
