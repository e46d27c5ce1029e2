"""Where metrics go: metrics.jsonl always, plus TensorBoard / W&B / MLflow (each also records the run's
flags), and plots; what the loop reports (`batch_metrics`, the progress bar, the end-of-run `summarize`);
a run's records (`earlier_records`: what a fresh run refuses to overwrite without --overwrite;
`complete_checkpoints`: those --resume may use).

    sink = Sinks(cfg)          # opens metrics.jsonl in --output_dir and every --logger backend
    sink.log(metrics)          # one step: the same metric names everywhere ("step" is the x axis)
    sink.close()
    python plot.py runs/latest runs/other -o compare.png    # reward, length, KL/mismatch, step time

W&B runs offline and MLflow writes a local store unless told otherwise (docs/recipes.md: `wandb sync`, `mlflow ui`).
"""

import json
import math
import os
import shutil
import sys
from pathlib import Path


class Sinks:
    """metrics.jsonl plus each backend of `cfg["logger"]`, opened at once, closed at once
    (main.validate has checked that each backend's package is installed)."""

    def __init__(self, cfg: dict, append: bool = False):
        self.out = Path(cfg["output_dir"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.out / "metrics.jsonl").open("a" if append else "w")  # append on --resume
        self.tb = self.wandb = self.mlflow = None
        backends = cfg.get("logger") or []
        name = cfg.get("run_name") or self.out.resolve().name
        # the flags as scalars: lists and None become text (what hparams/params accept)
        flat = {k: v if isinstance(v, (int, float, bool, str)) else json.dumps(v, default=str) for k, v in cfg.items()}
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
            self.tb = SummaryWriter(str(self.out / "tensorboard"))
            self.tb.add_text("config", "```\n" + json.dumps(cfg, indent=1, default=str) + "\n```")
            for summary in hparams(flat, {"reward_mean": 0.0}):   # the HParams tab, same run folder
                self.tb.file_writer.add_summary(summary)
        if "wandb" in backends:
            import wandb
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=cfg.get("wandb_project") or "molt", name=name, config=cfg, dir=str(self.out),
                                    mode=cfg.get("wandb_mode") or os.environ.get("WANDB_MODE") or "offline",
                                    reinit="create_new")
            self.wandb.define_metric("*", step_metric="step")
        if "mlflow" in backends:
            # a local file store; mlflow 3 keeps it in "maintenance mode" and asks for this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            import mlflow
            # not $MLFLOW_TRACKING_URI: set_tracking_uri writes it, so a second run would inherit the first's
            mlflow.set_tracking_uri(cfg.get("mlflow_uri") or (self.out / "mlruns").resolve().as_uri())
            mlflow.set_experiment(cfg.get("wandb_project") or "molt")
            self.mlflow = mlflow
            mlflow.start_run(run_name=name)
            mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})

    def log(self, metrics: dict) -> None:
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        step = int(metrics.get("step", 0))
        nums = {k: float(v) for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(nums)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k: v for k, v in nums.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()


# ---------------------------------------------------------------- pictures

PANELS = [  # (title, metric names tried in order: the first present is drawn)
    ("reward (mean)", ["reward_mean"]),
    ("response length (tokens)", ["response_len"]),
    ("KL to reference / engine-trainer mismatch", ["ref_kl_k3", "mismatch_k3", "mismatch_abs"]),
    ("step time (s)", ["step_s"]),
]


def plot(runs: list[str | Path], out: str | Path) -> str:
    """One PNG: a 2x2 grid of reward, response length, KL/mismatch and step time over steps,
    every run overlaid (labelled by its folder name)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
    for run in runs:
        path = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
        if not path.is_file():
            raise ValueError(f"{run}: no metrics.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        label = path.resolve().parent.name   # the run folder's name
        for ax, (title, keys) in zip(axes.flat, PANELS):
            key = next((k for k in keys if any(k in r for r in rows)), None)
            if key is None:
                continue
            pts = [(r.get("step", i + 1), r[key]) for i, r in enumerate(rows) if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{label}: {key}" if len(keys) > 1 else label)
    for ax, (title, _) in zip(axes.flat, PANELS):
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)


# ---------------------------------------------------------------- the loop's step metrics and summary

def batch_metrics(trajs: list[dict]) -> dict:
    """Reward, score and length statistics, counting each rollout once (not once per segment)."""
    rollouts: dict[tuple, dict] = {}
    for t in trajs:
        r = rollouts.setdefault((t["group"], t["rollout_id"]), {**t, "sampled": 0, "segments": 0})
        r["sampled"] += sum(t["mask"])
        r["segments"] += 1
    rs = list(rollouts.values())
    rewards = [r["reward"] for r in rs]
    mean = sum(rewards) / len(rs)
    keys = sorted({k for r in rs for k in r["info"]})   # a rollout without a key counts 0; a NaN or inf not at all
    info = {k: [v for r in rs if math.isfinite(v := r["info"].get(k, 0.0))] for k in keys}
    return {
        "reward_mean": mean,
        "reward_std": (sum((x - mean) ** 2 for x in rewards) / len(rs)) ** 0.5,
        "score_mean": sum(r["score"] for r in rs) / len(rs),
        "response_len": sum(r["sampled"] for r in rs) / len(rs),
        "rollouts": len(rs),
        "segments_per_rollout": len(trajs) / len(rs),
        **{f"info/{k}": sum(v) / len(v) for k, v in info.items() if v},
        **({"info/episode_tokens_max": max(info["episode_tokens"])} if info.get("episode_tokens") else {}),
    }


# ---------------------------------------------------------------- a run's records

# What a run writes into --output_dir: a fresh run refuses to start over any of them (--overwrite).
RECORDS = ("config.json", "metrics.jsonl", "metrics.png", "checkpoints", "final", "tensorboard", "mlruns", "wandb")


def complete_checkpoints(out: Path) -> list[Path]:
    """The checkpoints of OUTPUT_DIR that were written to the end (renamed from .tmp), oldest first."""
    return sorted(p for p in (Path(out) / "checkpoints").glob("step_*")
                  if p.is_dir() and not p.name.endswith(".tmp") and (p / "loop.json").is_file())


async def save_checkpoint(out: Path, write, state: dict, keep: int):
    """Write a checkpoint: `await write(folder)` (the trainer's state) and the loop `state` go
    into step_N.tmp, which is then renamed to step_N: a checkpoint interrupted mid-write is
    never mistaken for a complete one. Keeps the last `keep` complete checkpoints."""
    root = Path(out) / "checkpoints"
    final, tmp = root / f"step_{state['step']:06d}", root / f"step_{state['step']:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        await write(str(tmp / "trainer"))
        (tmp / "loop.json").write_text(json.dumps(state))
    except BaseException:  # stopped or failed mid-write: leave no half checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in complete_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_interrupted_checkpoints(out: Path):
    for tmp in (Path(out) / "checkpoints").glob("step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def earlier_records(cfg: dict) -> list[str]:
    """What an earlier run left that a fresh run with `cfg` would overwrite."""
    out = Path(cfg["output_dir"])
    found = [str(out / name) for name in RECORDS if (out / name).exists()]
    export = cfg.get("export_hf")
    if export and (Path(export) / "config.json").is_file() and str(Path(export)) not in found:  # a model folder
        found.append(str(export))
    dump = cfg.get("dump_rollouts")
    if dump and any(Path(dump).glob("step_*.jsonl")):
        found.append(f"{dump}/step_*.jsonl")
    return found


def clear_records(cfg: dict):
    """--overwrite: remove the earlier run's records (only those `earlier_records` names)."""
    for name in earlier_records(cfg):
        path = Path(name)
        if name.endswith("step_*.jsonl"):
            for f in path.parent.glob("step_*.jsonl"):
                f.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def keep_metrics(path: Path, last_step: int):
    """On resume, forget metrics of steps after the checkpoint (they will be redone)."""
    if path.is_file():
        lines = [l for l in path.read_text().splitlines() if l and json.loads(l)["step"] <= last_step]
        path.write_text("".join(l + "\n" for l in lines))


def progress(cfg: dict, total: int, desc: str = "train", unit: str = "step", done: int = 0):
    from tqdm import tqdm
    return tqdm(total=total, initial=done, desc=desc, unit=unit, dynamic_ncols=True,
                disable=cfg["quiet"] or not sys.stderr.isatty())


def summarize(history: list[dict], setup_s: float, total_s: float, out: Path, final: str | None) -> dict:
    if not history:
        return {"steps": 0, "total_s": total_s, "setup_s": setup_s, "text": "done: nothing left to train"}
    k = max(1, min(10, len(history) // 4))
    first = sum(m["reward_mean"] for m in history[:k]) / k
    last = sum(m["reward_mean"] for m in history[-k:]) / k
    fresh = [m["mismatch_fresh_abs"] for m in history if "mismatch_fresh_abs" in m]  # without policy lag
    mismatch = sum(fresh) / len(fresh) if fresh else float("nan")
    text = (f"done: {len(history)} steps in {total_s:.0f}s (setup {setup_s:.0f}s)\n"
            f"reward: {first:.3f} (mean of first {k} steps) -> {last:.3f} (mean of last {k})\n"
            f"engine/trainer logprob mismatch: mean |diff| {mismatch:.2e}\n"
            f"metrics: {out / 'metrics.jsonl'}\nmodel:   {final or '(not exported)'}")
    return {"first_reward": first, "last_reward": last, "steps": len(history),
            "total_s": total_s, "setup_s": setup_s, "mismatch_abs": mismatch, "text": text}
