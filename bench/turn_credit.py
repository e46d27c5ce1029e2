"""Per-turn credit, measured: GRPO against a turn-level estimator (gigpo) and branching (branch_value).

The task (this file's Env, on the tiny default model): two turns, each shows a digit d ("3=") and is right
when the reply starts with a larger digit; the reward, 1 if both turns were right, comes only at the end,
so a wrong first turn decides the episode though the second is still played. The Env gives GiGPO its
state (`Result.state_key`: the digit shown and whether the episode is still winnable). Each config runs
the real loop over SEEDS: grpo and gigpo with 8 samples per prompt, branching with 4 samples forked into 2
before turn 1 (the first turn sampled once per pair: fewer sampled tokens per step, so it runs more
steps). Reward is compared at equal sampled tokens (and at equal wall time): the mean training reward of
the steps in the last quarter of the budget every config reached. Ends with

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
COMMON = ["--prompts_per_step", "8", "--max_new_tokens", "2", "--quiet", "--no_plot", "--export_hf", "none"]
CONFIGS = {"grpo": ["--estimator", "grpo", "--samples_per_prompt", "8"],
           "turn-level": ["--estimator", "gigpo", "--samples_per_prompt", "8"],
           "branching": ["--estimator", "branch_value", "--samples_per_prompt", "4", "--branches", "2"]}
STEP_SCALE = {"branching": 4 / 3}   # 12 replies per group against 16: equal sampled tokens need 4/3 the steps


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


def run(name: str, seed: int, out: Path) -> list[dict]:
    steps = round(STEPS * STEP_SCALE.get(name, 1))
    cmd = [sys.executable, "main.py", "--agent", __file__, "--steps", str(steps), "--seed", str(seed),
           "--output_dir", str(out), *COMMON, *CONFIGS[name]]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def at_budget(metrics: list[dict], key: str, budget: float) -> float:
    """Mean reward of the steps whose cumulative `key` falls in (0.75 budget, budget]."""
    total, window = 0.0, []
    for m in metrics:
        total += m["response_len"] * m["rollouts"] if key == "tokens" else m["step_s"]
        if 0.75 * budget < total <= budget:
            window.append(m["reward_mean"])
    return sum(window) / max(len(window), 1)


def main():
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            for seed in SEEDS:
                runs[name, seed] = run(name, seed, Path(tmp) / f"{name}-{seed}")
    used = {k: (sum(m["response_len"] * m["rollouts"] for m in v), sum(m["step_s"] for m in v)) for k, v in runs.items()}
    out = {}
    for i, key in enumerate(("tokens", "wall")):
        budget = min(u[i] for u in used.values())
        out[key] = {n: sum(at_budget(runs[n, s], key, budget) for s in SEEDS) / len(SEEDS) for n in CONFIGS}
        print(f"{key} budget {budget:.0f}: " + ", ".join(f"{n} {r:.3f}" for n, r in out[key].items()))
    for name in CONFIGS:
        finals = [runs[name, s][-1]["reward_mean"] for s in SEEDS]
        print(f"{name}: final-step reward {', '.join(f'{r:.3f}' for r in finals)}; per-seed tokens, seconds "
              f"{[(round(used[name, s][0]), round(used[name, s][1])) for s in SEEDS]}")
    r = out["tokens"]
    print(f"reward at equal sampled tokens: grpo {r['grpo']:.3f}, turn-level {r['turn-level']:.3f}, "
          f"branching {r['branching']:.3f} ({len(SEEDS)} seeds)")


if __name__ == "__main__":
    main()
