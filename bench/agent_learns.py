"""An agent that learns, end to end: SmolLM2-135M-Instruct and a Python tool on 3-digit products.

Runs examples/recipes/smollm2_tool.sh as it is: `--eval_only` on the initial model, the training run, `--eval_only` on
the final model, and the no-tool ablation (the final model answering the same held-out problems without the tool, in
one turn). All evaluations use the recipe's sampling. Leaves in runs/agent_learns/: the learning curve
(learning_curve.png: train reward, tool-use rate, held-out success), every step's rollouts in the rollout viewer
(viewer/index.html: conversations token by token, coloured by advantage, per-turn rewards and branches where the run
records them) and results.json. Ends with the line

    held-out success: A% -> B% (no tool: C%), tool then answer: D% -> E%, N min

where "tool then answer" is the share of held-out episodes that ran code and then gave the right answer.

    python bench/agent_learns.py            # no arguments; ~25 min on 2 CPU cores
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "recipes" / "smollm2_tool.sh"
OUT = ROOT / "runs" / "agent_learns"
sys.path.insert(0, str(ROOT))
import main as molt  # noqa: E402  (the recipe writes its held-out files under molt.cache_dir())
import viewer  # noqa: E402


def recipe(*flags: str) -> dict:
    """Run the recipe with extra flags; the JSON scores an --eval_only run prints last."""
    cmd = ["bash", str(RECIPE), "--output_dir", str(OUT), "--quiet", *flags]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True,
                          env={**os.environ, "PYTHON": sys.executable})   # the recipe runs this interpreter
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def curve(metrics: list[dict], first: float, final: float, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["reward_mean"] for m in metrics], label="train reward (success)")
    ax.plot(steps, [m["info/tool"] for m in metrics], label="train tool-use rate")
    during = [(m["step"], m["eval/reward_mean"]) for m in metrics if "eval/reward_mean" in m]
    ax.plot(*zip((0, first), *during), "o-", label="held-out success (128 problems, --eval_every)")
    ax.plot([0, steps[-1]], [first, final], "s", color="black", label="held-out success, --eval_only (initial, final)")
    ax.set(xlabel="step", ylim=(0, 1), title="SmolLM2-135M-Instruct + Python tool, 3-digit products, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    t0 = time.perf_counter()
    first = recipe("--eval_only")
    recipe("--overwrite", "--dump_rollouts", str(OUT / "dump"))
    final = recipe("--eval_only", "--model", str(OUT / "final"))
    no_tool = recipe("--eval_only", "--model", str(OUT / "final"),
                     "--eval_dataset", str(molt.cache_dir() / "smollm2_tool" / "heldout_notool.jsonl"))
    minutes = (time.perf_counter() - t0) / 60

    metrics = [json.loads(line) for line in (OUT / "metrics.jsonl").read_text().splitlines()]
    curve(metrics, first["eval/reward_mean"], final["eval/reward_mean"], OUT / "learning_curve.png")
    print("rollouts:", viewer.write(OUT))   # reads OUT/dump, decodes with OUT/final's tokenizer
    results = {"initial": first, "final": final, "no_tool": no_tool, "minutes": minutes}
    (OUT / "results.json").write_text(json.dumps(results, indent=1))
    pct = lambda x: f"{100 * x:.0f}%"
    print(f"held-out success: {pct(first['eval/reward_mean'])} -> {pct(final['eval/reward_mean'])} "
          f"(no tool: {pct(no_tool['eval/reward_mean'])}), tool then answer: "
          f"{pct(first['eval/info/tool_then_right'])} -> {pct(final['eval/info/tool_then_right'])}, "
          f"{minutes:.0f} min")


if __name__ == "__main__":
    sys.exit(main())
