"""The real loop end to end: Ray + vLLM + FSDP2 trainer on the tiny model."""

import json

import psutil
import pytest
import torch
from safetensors.torch import load_file

import main

FLAKY_AGENT = '''
from agent import Env, Result

class Flaky(Env):
    """The default task, except that prompts starting with 1 crash the agent."""
    @classmethod
    def prompts(cls, seed):
        i = 0
        while True:
            a, b = i % 10, (i * 7 + 3) % 10
            i += 1
            if a != b:
                yield {"prompt": f"{a}?{b}=", "label": str(max(a, b))}

    async def step(self, state):
        if state.prompt.startswith("1"):
            raise RuntimeError("agent bug on prompt 1")
        # graded, so that 3 steps of a random policy already give a gradient
        return Result(reward=float(state.action == state.label) + len(state.action) / 3, info={"len": len(state.action)})
'''

SMALL = ["--prompts_per_step", "4", "--samples_per_prompt", "4", "--max_new_tokens", "3", "--quiet"]


def test_short_run_trains_logs_and_cleans_up(tiny_model, tmp_path):
    agent = tmp_path / "flaky.py"
    agent.write_text(FLAKY_AGENT)
    out = tmp_path / "run"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    summary = main.main(["--model", tiny_model, "--agent", str(agent), "--steps", "3", "--train_workers", "2",
                         "--output_dir", str(out), *SMALL])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["rollouts"] > 0 and m["staleness"] == 0.0   # sync mode is exactly on-policy:
        assert abs(m["is_weight_mean"] - 1.0) < 1e-4             # IS weights are 1
        assert m["mismatch_abs"] < 1e-4
        assert all(isinstance(v, (int, float)) and v == v for v in m.values())  # finite, no NaN
    assert sum(m.get("dropped/error", 0) for m in lines[-1:]) > 0   # crashed rollouts were counted
    assert "info/len" in lines[0]
    assert summary["steps"] == 3
    # Parameters changed, and the exported folder loads.
    start = load_file(f"{tiny_model}/model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], final[k]) for k in start)
    # Nothing left behind: no Ray, no vLLM engine processes.
    import ray
    assert not ray.is_initialized()
    leftovers = [p.name() for p in psutil.Process().children(recursive=True)
                 if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, leftovers


def test_every_rollout_failing_stops_with_a_clear_error(tiny_model, tmp_path):
    agent = tmp_path / "broken.py"
    agent.write_text("from agent import Env\nclass Broken(Env):\n"
                     "    @classmethod\n    def prompts(cls, seed):\n        while True: yield {'prompt': '1?2='}\n"
                     "    async def step(self, state):\n        raise KeyError('reward')\n")
    with pytest.raises(RuntimeError, match="every rollout of the first 4 groups failed"):
        main.main(["--model", tiny_model, "--agent", str(agent), "--steps", "2",
                   "--output_dir", str(tmp_path / "run"), *SMALL])


def test_async_partial_rollout_checkpoint_resume_and_replay(tiny_model, tmp_path):
    """Async depth 1 with partial rollout, filtering and eval; a checkpoint per step; then
    a resumed run continues where the first stopped; then the dumped batches retrain
    without an engine. Weights go by broadcast (gloo), to two engines in the first run."""
    import loop
    out, dump = tmp_path / "run", tmp_path / "dump"
    common = ["--model", tiny_model, "--output_dir", str(out), *SMALL, "--export_hf", "none",
              "--weight_sync", "broadcast"]
    main.main([*common, "--steps", "2", "--async_depth", "1", "--partial_rollout", "--num_engines", "2", "--eval_every", "2",
               "--eval_prompts", "4", "--save_every", "1", "--keep_checkpoints", "1", "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[0]["staleness"] == 0.0 and "eval/pass@1" in lines[1]
    assert all(m["mismatch_fresh_abs"] < 1e-4 for m in lines if "mismatch_fresh_abs" in m)
    ckpts = loop.complete_checkpoints(out)
    assert [c.name for c in ckpts] == ["step_000002"]  # retention kept the last one
    state = json.loads((ckpts[0] / "loop.json").read_text())
    assert state["step"] == 2 and state["version"] == 2 and state["rows_started"] >= 8

    # A checkpoint that died mid-write (no rename) is ignored.
    (out / "checkpoints" / "step_000003.tmp").mkdir()
    assert loop.complete_checkpoints(out) == ckpts

    main.main([*common, "--steps", "3", "--resume", "--save_every", "1"])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert lines[2]["version"] == 3 and lines[2]["staleness"] == 0.0
    assert lines[2]["mismatch_abs"] < 1e-4  # the engine got the checkpoint's weights
    state = json.loads((loop.complete_checkpoints(out)[-1] / "loop.json").read_text())
    assert state["step"] == 3 and state["rows_started"] > 8  # data position moved on, not restarted

    summary = main.main(["--model", tiny_model, "--output_dir", str(tmp_path / "replay"), *SMALL,
                         "--steps", "2", "--replay_rollouts", str(dump), "--export_hf", "none"])
    assert summary["steps"] == 2


LONG_AGENT = '''
from agent import Env, Result

class Long(Env):
    """Two turns; the second samples 120 tokens, so requests are in flight at weight updates."""
    max_turns = 2

    @classmethod
    def prompts(cls, seed):
        while True:
            yield {"prompt": "3?7=", "label": "7"}

    async def step(self, state):
        if state.turn == 0:
            return Result(reward=0.0, observation="1", terminated=False,
                          sampling_params={"max_tokens": 120, "ignore_eos": True})
        return Result(reward=float(state.action.count("7")))
'''


def test_partial_rollout_trains_tokens_of_two_policy_versions(tiny_model, tmp_path):
    """Async + partial rollout really happens: trained tokens are stale, and some trajectory
    holds tokens of two policy versions (paused, reloaded, resumed mid-request)."""
    agent, dump = tmp_path / "long.py", tmp_path / "dump"
    agent.write_text(LONG_AGENT)
    main.main(["--model", tiny_model, "--agent", str(agent), "--output_dir", str(tmp_path / "run"), *SMALL,
               "--steps", "3", "--async_depth", "1", "--partial_rollout", "--export_hf", "none", "--no_plot",
               "--dump_rollouts", str(dump)])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["staleness"] for m in lines) > 0
    trajs = [json.loads(l) for f in sorted(dump.glob("step_*.jsonl")) for l in f.read_text().splitlines()]
    spans = [t for t in trajs if len({v for v, m in zip(t["versions"], t["mask"]) if m}) > 1]
    assert spans, "no trajectory spans a weight update"
    sampled = [[v for v, m in zip(t["versions"], t["mask"]) if m] for t in spans]
    assert all(v == sorted(v) for v in sampled)  # versions only grow along a sequence


# The estimators that change what the trainer holds (a critic; a reference model) run through
# the real loop; the others differ only in their advantage function, which test_estimators checks
# in closed form and test_algorithms through the real Trainer's SGD step.
@pytest.mark.parametrize("estimator", ["gae", "on_policy_distill"])
def test_estimators_with_extra_models_run_through_the_real_loop(tiny_model, tmp_path, estimator):
    extra = ["--kl_coef", "0.5", "--ref_model", tiny_model] if estimator == "on_policy_distill" else []
    summary = main.main(["--model", tiny_model, "--estimator", estimator, "--steps", "2", *SMALL, *extra,
                         "--output_dir", str(tmp_path / "run"), "--export_hf", "none", "--no_plot"])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and len(lines) == 2
    assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for m in lines for v in m.values())
    # the extra model is there and used: a critic's values, loss and optimizer step, or the KL to the teacher
    keys = ("value_mean", "value_loss", "critic_grad_norm") if estimator == "gae" else ("ref_kl_k3",)
    assert all(k in m for m in lines for k in keys)
