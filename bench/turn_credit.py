"""Per-turn credit, measured: grpo against a turn-level estimator (gigpo) and branching (branch_value).

The task (this file's Env, tiny default model): two turns, each shows a digit d ("3=") and is right when the
reply starts with a larger digit; the reward (1 if both were right) comes only at the end, so a wrong first
turn decides the episode. `Result.state_key` gives gigpo the state (digit shown, still winnable). grpo and
gigpo sample 8 per prompt; branching 4, each forked into 2 before turn 1 (fewer tokens per step: it runs
more steps). Reward at equal sampled tokens (and wall time): the mean training reward of the steps within
the budget every run reached (learning speed; the last quarter's mean too), over SEEDS. Ends with
    reward at equal sampled tokens: grpo A, turn-level B, branching C (N seeds)

    flock /tmp/molt.lock python bench/turn_credit.py     # no arguments; ~8 min on 2 CPU cores
"""

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from agent import Env, Result  # noqa: E402

SEEDS, STEPS = (0, 1, 2), 50
COMMON = ["--max_new_tokens", "2", "--quiet", "--no_plot", "--export_hf", "none"]
TASK = ["--agent", __file__, "--prompts_per_step", "8", "--steps"]
CONFIGS = {"grpo": [*TASK, str(STEPS), "--estimator", "grpo", "--samples_per_prompt", "8"],   # 16 replies per
           "turn-level": [*TASK, str(STEPS), "--estimator", "gigpo", "--samples_per_prompt", "8"],   # group, 12
           "branching": [*TASK, str(round(STEPS * 4 / 3)), "--estimator", "branch_value", "--samples_per_prompt", "4",
                         "--branches", "2"]}   # branching: it runs 4/3 the steps


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


def run(args: list[str], seed: int, out: Path) -> list[tuple]:
    """(cumulative sampled tokens, cumulative step seconds, reward, score) per step of one main.py run (also
    bench/past_window.py's)."""
    cmd = [sys.executable, "main.py", *args, "--seed", str(seed), "--output_dir", str(out), *COMMON]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    tokens = seconds = 0.0
    for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        tokens, seconds = tokens + m["response_len"] * m["rollouts"], seconds + m["step_s"]
        yield tokens, seconds, m["reward_mean"], m["score_mean"]


def mean_reward(steps: list[tuple], i: int, budget: float, low: float) -> float:
    rewards = [r for *x, r, _ in steps if low * budget < x[i] <= budget]
    return sum(rewards) / max(len(rewards), 1)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        runs = {(n, s): list(run(CONFIGS[n], s, Path(tmp) / f"{n}-{s}")) for n in CONFIGS for s in SEEDS}
    for i, key in ((1, "seconds"), (0, "sampled tokens")):   # budget: what the cheapest run used
        budget = min(steps[-1][i] for steps in runs.values())
        for low, what in ((0.75, "last quarter"), (0.0, "mean")):
            per_seed = {n: [mean_reward(runs[n, s], i, budget, low) for s in SEEDS] for n in CONFIGS}
            r = {n: sum(v) / len(v) for n, v in per_seed.items()}
            print(f"reward, {what} of the first {budget:.0f} {key}: " + ", ".join(
                f"{n} {r[n]:.3f} (seeds {' '.join(f'{x:.3f}' for x in v)})" for n, v in per_seed.items()))
    print(f"reward at equal sampled tokens: grpo {r['grpo']:.3f}, turn-level {r['turn-level']:.3f}, "
          f"branching {r['branching']:.3f} ({len(SEEDS)} seeds)")


if __name__ == "__main__":
    main()
