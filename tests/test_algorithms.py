"""Every estimator, loss, aggregation and KL/entropy/critic option through the real trainer.

Trajectories are made up (fixed token ids, made-up sampling logprobs), so no engine
is needed; tests/test_loop.py runs the same options through the real loop."""

import math

import pytest

from test_engine import trainer_cfg
from trainer import Trainer

import estimators


def _trajectories(n_groups=2, group_size=4):
    trajs = []
    for g in range(n_groups):
        for i in range(group_size):
            prompt = [2, 8 + g, 15, 12, 16, 0, 3]
            reply = [5 + (i % 10), 6 + i % 3] + ([0] if i % 2 else [])  # unequal lengths
            trajs.append({"tokens": prompt + reply, "mask": [0] * len(prompt) + [1] * len(reply),
                          "logprobs": [0.0] * len(prompt) + [-3.0] * len(reply),
                          "versions": [-1] * len(prompt) + [0] * len(reply),
                          "reward": float((i + g) % 3 == 0), "group": g, "rollout_id": i})
    return trajs


CONFIGS = [{"estimator": name} for name in estimators.ESTIMATORS if name not in ("on_policy_distill",)] + [
    {"estimator": "on_policy_distill", "kl_coef": 0.5, "ref_model": "TINY"},
    {"estimator": "reinforce_pp", "kl_coef": 0.1, "kl_in_reward": True},
    {"estimator": "grpo", "kl_coef": 0.1, "kl_loss": True, "kl_estimator": "k2"},
    {"estimator": "grpo", "loss": "gspo", "eps_clip": [3e-4, 4e-4]},
    {"estimator": "grpo", "loss": "cispo", "eps_clip": [1.0, 4.0]},
    {"estimator": "dr_grpo", "loss_agg": "seq_mean_token_sum", "dual_clip": 3.0},
    {"estimator": "rloo", "loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01},
    {"estimator": "grpo", "is_level": "geo", "is_mode": "mask", "is_band": [0.5, 2.0]},
    {"estimator": "gae", "gamma": 0.99, "lam": 0.95, "reward_clip": 0.5},
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_train_step_runs_and_reports_finite_metrics(tiny_model, overrides):
    overrides = {k: (tiny_model if v == "TINY" else v) for k, v in overrides.items()}
    t = Trainer(trainer_cfg(tiny_model, **overrides))
    metrics = t.train_step(_trajectories())
    assert t.version == 1
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["optimizer_steps"] == 2
    if overrides.get("estimator") == "gae":
        assert "value_loss" in metrics and "critic_grad_norm" in metrics
    if "kl_loss" in overrides:
        assert "kl_loss" in metrics and "ref_kl_k3" in metrics
    if overrides.get("loss_agg") == "seq_mean_token_mean":
        assert "entropy_loss" in metrics
