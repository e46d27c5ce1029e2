"""Learning past the window, on this file's Env: 7 digits shown one per turn with filler, then a question asks for
the largest (tiny model: 140 tokens, 3.5x --max_len 40; PAST_WINDOW=smollm2: SmolLM2-135M-Instruct told the rule in
a system message, 205 tokens, 3.0x --max_len 68, one-token replies). Under truncation (`--context none`) the episode
ends before the question; under `--context window --context_turns 1` each turn starts a segment from the prompt, the
last reply and the new digit, so the answer is right only if the replies carried the running maximum. Each reply that
is the largest digit so far earns 1/8 (the answer too); success is the answer's (score_mean, the mean of the last 10
steps within the budget). Truncation samples fewer tokens per rollout, so it runs 3x (tiny) or 4x the prompts per
step, and both are compared at the smaller run's cumulative sampled tokens, over seeds. Ends with
    success at equal sampled tokens: truncation A, rewrite B (N seeds)

    flock /tmp/molt.lock python bench/past_window.py [SEEDS]     # default 2 seeds; ~25 min on 2 CPU cores
    PAST_WINDOW=smollm2 flock /tmp/molt.lock python bench/past_window.py 1   # ~35 min a seed
    python main.py --agent bench/past_window.py --context window --context_turns 1 --max_len 40   # one run
"""

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent import Env, Result  # noqa: E402

MODEL, FACTS = os.environ.get("PAST_WINDOW", "tiny"), 7   # SmolLM2 reads an instruction, words between digits, a question
FILL = " (more digits follow; keep the largest one in mind)" if MODEL == "smollm2" else ",,,,,,,,,,,,"
CONFIGS = ("truncation", "rewrite")
TASKS = {"tiny": (["--max_len", "40", "--max_new_tokens", "2", "--lr", "2e-3", "--steps", "80"], 96, 32),
         "smollm2": (["--model", "smollm2", "--max_len", "68", "--max_new_tokens", "1", "--lr", "3e-5", "--steps", "40",
                      "--samples_per_prompt", "4", "--mini_batches", "2"], 16, 4)}


class PastWindow(Env):
    max_turns = FACTS + 1

    @classmethod
    def prompts(cls, seed):
        rng = random.Random(seed)
        while True:   # the largest uniform in 0..9 (a constant answer scores 10%), at a random turn
            top = rng.randrange(10)
            digits = [rng.randrange(top + 1) for _ in range(FACTS)]
            digits[rng.randrange(FACTS)] = top
            first = f"{digits[0]}{FILL}"
            yield {"prompt": [{"role": "system", "content": "Reply with the largest digit so far."},
                              {"role": "user", "content": first}] if MODEL == "smollm2" else first, "label": digits}

    async def step(self, state):
        right = float(state.action == str(max(state.label[:state.turn + 1])) and (state.finish_reason == "stop" or
                                                                                  MODEL == "smollm2"))   # one token
        if state.turn == FACTS:   # the answer
            return Result(reward=right / (FACTS + 1), score=right)
        shown = f"{state.label[state.turn + 1]}{FILL}" if state.turn < FACTS - 1 else "?" if MODEL == "tiny" else \
            "Which digit was the largest?"
        return Result(reward=right / (FACTS + 1), score=0.0, observation=shown, terminated=False)


def success(steps: list[tuple], budget: float) -> float:
    scores = [score for tokens, score in steps if tokens <= budget * 1.0001][-10:]
    return sum(scores) / max(len(scores), 1)


def run(name: str, seed: int, out: Path) -> list[tuple]:
    """(cumulative sampled tokens, score) per step of one main.py run."""
    flags, truncation, rewrite = TASKS[MODEL]
    policy = ["--context", "none", "--prompts_per_step", str(truncation)] if name == "truncation" else [
        "--context", "window", "--prompts_per_step", str(rewrite)]
    cmd = [sys.executable, "main.py", "--agent", __file__, *flags, *policy, "--context_turns", "1", "--seed", str(seed),
           "--output_dir", str(out), "--quiet", "--no_plot", "--export_hf", "none"]
    print(f"+ PAST_WINDOW={MODEL}", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PAST_WINDOW": MODEL})
    tokens = 0.0
    for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        tokens += m["response_len"] * m["rollouts"]
        yield tokens, m["score_mean"]


def main():
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {(n, s): list(run(n, s, Path(tmp) / f"{n}-{s}")) for s in seeds for n in CONFIGS}
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
