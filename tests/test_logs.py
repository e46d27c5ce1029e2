"""logs.py: metrics.jsonl always; TensorBoard, MLflow and W&B (offline) write what they claim,
with the same metric names and the run's flags; plots from metrics files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import logs

ROOT = Path(__file__).resolve().parents[1]
STEPS = [{"step": s, "reward_mean": 0.1 * s, "response_len": 3.0 + s, "mismatch_k3": 1e-7, "step_s": 1.5,
          "dropped/error": 1, "note": "text is kept in JSONL only"} for s in (1, 2, 3)]


def _cfg(tmp_path, logger):
    return {"output_dir": str(tmp_path / "run"), "logger": logger, "lr": 1e-5, "eps_clip": [0.2, 0.28],
            "ref_model": None, "run_name": "t", "wandb_project": "molt-test", "wandb_mode": "offline",
            "mlflow_uri": None}


def _log_all(cfg):
    sink = logs.Sinks(cfg)
    for m in STEPS:
        sink.log(m)
    sink.close()
    return Path(cfg["output_dir"])


def test_jsonl_always(tmp_path):
    out = _log_all(_cfg(tmp_path, []))
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == STEPS


def test_tensorboard_event_file_is_readable(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = _log_all(_cfg(tmp_path, ["tensorboard"]))
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert {"reward_mean", "response_len", "mismatch_k3", "step_s", "dropped/error"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert any("config" in t for t in acc.Tags()["tensors"])  # the flags, as text


def test_mlflow_local_store_has_metrics_and_params(tmp_path):
    pytest.importorskip("mlflow")
    import mlflow
    cfg = _cfg(tmp_path, ["mlflow"])
    out = _log_all(cfg)
    client = mlflow.tracking.MlflowClient((out / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("molt-test").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert "dropped/error" in run.data.metrics
    assert run.data.params["lr"] == "1e-05" and run.data.params["eps_clip"] == "[0.2, 0.28]"


def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb
    out = _log_all(_cfg(tmp_path, ["wandb"]))
    wandb.teardown()  # the wandb service writes the run file; stopping it flushes (as process exit does)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    record = next(runs[0].glob("run-*.wandb")).read_bytes()  # what `wandb sync` uploads
    assert b"reward_mean" in record and b"dropped/error" in record   # metrics, same names
    assert b"wandb_project" in record and b"eps_clip" in record       # the run's flags (config)


def test_several_backends_at_once(tmp_path):
    for name in ("tensorboard", "mlflow"):
        pytest.importorskip(name)
    out = _log_all(_cfg(tmp_path, ["tensorboard", "mlflow"]))
    assert list((out / "tensorboard").glob("events.out.tfevents.*")) and (out / "mlruns").is_dir()


def test_plot_from_metrics_file_and_several_runs(tmp_path):
    pytest.importorskip("matplotlib")
    a = _log_all(_cfg(tmp_path / "a", []))
    png = logs.plot([a], a / "metrics.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    b = _log_all(_cfg(tmp_path / "b", []))
    out = tmp_path / "compare.png"
    subprocess.run([sys.executable, str(ROOT / "plot.py"), str(a), str(b), "-o", str(out)], check=True,
                   capture_output=True)
    assert out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        logs.plot([tmp_path / "nothing"], tmp_path / "x.png")


def test_real_loop_run_with_a_csv_dataset_loggers_and_plot(tiny_model, tmp_path):
    """Through the real loop (Ray, vLLM, trainer): a CSV dataset, TensorBoard + MLflow beside
    metrics.jsonl, and metrics.png at the end."""
    for name in ("tensorboard", "mlflow", "matplotlib"):
        pytest.importorskip(name)
    import main
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (tmp_path / "d.csv").write_text("question,answer\n" + "".join(f"{a}?{b}=,{max(a, b)}\n"
                                                                 for a in range(4) for b in range(5, 9)))
    out = tmp_path / "run"
    main.main(["--model", tiny_model, "--dataset", str(tmp_path / "d.csv"), "--input_key", "question",
               "--label_key", "answer", "--steps", "2", "--prompts_per_step", "2", "--samples_per_prompt", "4",
               "--mini_batches", "2", "--logger", "tensorboard", "mlflow", "--output_dir", str(out), "--quiet"])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert len(acc.Scalars("reward_mean")) == 2 and "mismatch_abs" in acc.Tags()["scalars"]
    assert (out / "mlruns").is_dir()
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_info_means_leave_out_nan_and_inf():
    """A program's or an Env's info value may be NaN or infinite: the step's mean is over the rollouts with a finite
    value (one without the key counts 0), not poisoned; a key with no finite value is not logged."""
    def traj(rollout: int, info: dict) -> dict:
        return {"group": 0, "rollout_id": rollout, "mask": [1], "reward": 1.0, "score": 1.0, "info": info}
    trajs = [traj(0, {"a": 1.0, "bad": float("nan")}), traj(1, {"a": float("nan"), "bad": float("inf")}),
             traj(2, {"a": 3.0, "bad": float("-inf")}), traj(3, {})]
    metrics = logs.batch_metrics(trajs)
    assert metrics["info/a"] == (1.0 + 3.0 + 0.0) / 3 and metrics["info/bad"] == 0.0   # the rollout without it
    assert "info/x" not in logs.batch_metrics([traj(0, {"x": float("nan")})])


def test_the_longest_episode_is_logged_beside_the_mean():
    """info/episode_tokens_max is the longest episode of the step (against --max_len), a rollout counted once however
    many segments it has; a step with no rewritten episode logs neither."""
    trajs = [{"group": 0, "rollout_id": r, "mask": [1], "reward": 0.0, "score": 0.0, "info": info}
             for r, info in [(0, {"episode_tokens": 90.0}), (0, {}), (1, {"episode_tokens": 30.0}), (2, {})]]
    metrics = logs.batch_metrics(trajs)
    assert metrics["info/episode_tokens_max"] == 90.0 and metrics["info/episode_tokens"] == 40.0
    assert "info/episode_tokens_max" not in logs.batch_metrics(trajs[3:])
