"""Every estimator, loss, aggregation and KL/entropy/critic option through the real trainer.

Trajectories are made up (fixed token ids, made-up sampling logprobs), so no engine
is needed; tests/test_loop.py runs the same options through the real loop."""

import inspect
import itertools
import math
import random
from pathlib import Path

import pytest

from fakes import trainer_logprobs
from test_engine import trainer_cfg
from trainer import Trainer

import estimators
import losses


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


# Every estimator and every loss (by their entries: a new one is covered with no list to extend),
# then options.
CONFIGS = [{"estimator": name, **({"kl_coef": 0.5, "ref_model": "TINY"} if spec.teacher else {})}
           for name, spec in estimators.ESTIMATORS.items()] + [
    {"estimator": "grpo", "loss": name} for name in losses.POLICY_LOSSES] + [
    {"estimator": "reinforce_pp", "kl_coef": 0.1, "kl_in_reward": True},
    {"estimator": "grpo", "kl_coef": 0.1, "kl_loss": True, "kl_estimator": "k2"},
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
    if estimators.ESTIMATORS[overrides["estimator"]].critic:
        assert "value_loss" in metrics and "critic_grad_norm" in metrics
    if "kl_loss" in overrides:
        assert "kl_loss" in metrics and "ref_kl_k3" in metrics
    if overrides.get("loss_agg") == "seq_mean_token_mean":
        assert "entropy_loss" in metrics


ENTRIES = [("estimator", name) for name in estimators.ESTIMATORS] + [("loss", name) for name in losses.POLICY_LOSSES]


@pytest.mark.parametrize("flag, name", ENTRIES, ids=[f"{f}={n}" for f, n in ENTRIES])
def test_the_trainer_calls_the_chosen_entry_with_its_own_settings(tiny_model, monkeypatch, flag, name):
    """--estimator/--loss NAME reaches that entry's function, with each of its settings as given."""
    import dataclasses
    import functools
    from fakes import other_value
    registry = estimators.ESTIMATORS if flag == "estimator" else losses.POLICY_LOSSES
    spec, seen = registry[name], []

    @functools.wraps(spec.fn)   # keeps the signature: an estimator gets the inputs it names
    def spy(*args, **kw):
        seen.append(kw)
        return spec.fn(*args, **kw)
    monkeypatch.setitem(registry, name, dataclasses.replace(spec, fn=spy))
    given = {k: other_value(s) for k, s in spec.settings.items()}
    teacher = {"kl_coef": 0.5, "ref_model": tiny_model} if flag == "estimator" and spec.teacher else {}
    Trainer(trainer_cfg(tiny_model, **{flag: name}, **given, **teacher)).train_step(_trajectories())
    assert seen and all(kw[k] == v for kw in seen for k, v in given.items())


@pytest.mark.parametrize("name", ["grpo", "turn_reinforce"])
def test_reward_clip_bounds_the_rewards_and_each_turns_reward_the_estimator_gets(tiny_model, monkeypatch, name):
    import dataclasses
    import functools
    import inspect
    spec, seen = estimators.ESTIMATORS[name], []

    @functools.wraps(estimators.turn_reinforce)   # its signature: it is given the per-turn inputs
    def spy(rewards, mask, groups, **kw):
        seen.append((rewards, kw["turn_rewards"]))
        takes = inspect.signature(spec.fn).parameters
        return spec.fn(rewards, mask, groups, **{k: v for k, v in kw.items() if k in takes})
    monkeypatch.setitem(estimators.ESTIMATORS, name, dataclasses.replace(spec, fn=spy))
    trajs = _trajectories()
    for i, t in enumerate(trajs):   # two turns: rewards 3 and -2 (or 0 and 0); the second turn is the reply
        t["reward"] = 1.0 if t["reward"] else 0.0
        t["turns"] = [0] * 5 + [1] * (len(t["tokens"]) - 5)
        t["turn_rewards"] = [3.0, -2.0] if t["reward"] else [0.0, 0.0]
    Trainer(trainer_cfg(tiny_model, estimator=name, reward_clip=0.5)).train_step(trajs)
    rewards, turn_rewards = seen[0]
    assert rewards.abs().max() == 0.5
    assert turn_rewards.max() == 0.5 and turn_rewards.min() == -0.5   # each turn's, not only their sum


# ---------------------------------------------------------------- the training signal itself
# Plain SGD and no clipping (Adam and grad clipping hide a gradient's scale), so a weight
# update is exactly -lr * gradient and can be checked against what the flags say.

SIGNED = [name for name, spec in estimators.ESTIMATORS.items() if not spec.teacher]  # signed advantages from rewards


def _signal_trajectories(trainer=None, ratios=None, size=4):
    """2 groups x `size` (even) rollouts of 2 sampled tokens (distinct per rollout), rewards 1, -1, 0.5, -0.5,
    0.25, ... (group mean 0: every estimator's advantage has the reward's sign). Sampling logprobs are the
    trainer's own (IS ratio 1) unless `ratios` {row: ratio} says otherwise."""
    trajs = []
    for g in range(2):
        for i in range(size):
            prompt, reply = [2, 8 + g, 15, 12, 16, 0, 3], [5 + 2 * size * g + i, 5 + (2 * g + 1) * size + i]
            trajs.append({"tokens": prompt + reply, "mask": [0] * len(prompt) + [1] * len(reply),
                          "logprobs": [0.0] * (len(prompt) + len(reply)),
                          "versions": [-1] * len(prompt) + [0] * len(reply),
                          "reward": 0.5 ** (i // 2) * (-1) ** (i + g), "group": g, "rollout_id": i})
    if trainer is not None:
        for t, lp in zip(trajs, trainer_logprobs(trainer, trajs)):
            shift = math.log((ratios or {}).get(trajs.index(t), 1.0))
            t["logprobs"] = [0.0] + [x - shift if m else 0.0 for x, m in zip(lp, t["mask"][1:])]
    return trajs


def _sgd_trainer(model, lr=0.01, **overrides):
    import torch
    t = Trainer(trainer_cfg(model, mini_batches=1, grad_clip=1e9, **overrides))
    t.optimizer = torch.optim.SGD([p for p in t.model.parameters() if p.requires_grad], lr=lr)
    return t


def _flat(state):
    import torch
    return torch.cat([v.flatten().float() for _, v in sorted(state.items())])


def _sampled(trainer, trajs):
    return [[lp for lp, m in zip(row, t["mask"][1:]) if m] for row, t in zip(trainer_logprobs(trainer, trajs), trajs)]


def _spy_advantages(monkeypatch, name) -> list:
    """Wraps ESTIMATORS[name] (its signature kept: it gets the inputs it names); the list gets the advantages
    [B, T] of each step."""
    import dataclasses
    import functools
    spec, seen = estimators.ESTIMATORS[name], []

    @functools.wraps(spec.fn)
    def spy(*args, **kw):
        seen.append(spec.fn(*args, **kw))
        return seen[-1]
    monkeypatch.setitem(estimators.ESTIMATORS, name, dataclasses.replace(spec, fn=spy))
    return seen


@pytest.mark.parametrize("loss", losses.POLICY_LOSSES)
@pytest.mark.parametrize("estimator", SIGNED)
def test_one_sgd_step_moves_logprobs_with_the_advantage(tiny_model, monkeypatch, estimator, loss):
    """Rewards of both signs in every group: no advantage has the other sign than its reward, and after one
    SGD step the sampled tokens' logprob changes, weighted by the advantages the step trained with, sum to
    more than 0 (to first order the step is lr * |g|^2 along g = sum A grad log pi, for every estimator and
    loss; one token alone may move against a small advantage of its own when larger ones of the other sign
    outweigh it, so tokens are not checked one by one). A flipped sign anywhere between reward and update
    fails this: in the estimator the first part, after it the second."""
    seen = _spy_advantages(monkeypatch, estimator)
    t = _sgd_trainer(tiny_model, estimator=estimator, loss=loss)
    trajs = _signal_trajectories(t, size=max(4, estimators.ESTIMATORS[estimator].min_group + 1) // 2 * 2)
    before = _sampled(t, trajs)
    t.train_step(trajs)
    after = _sampled(t, trajs)
    adv = [[a for a, m in zip(row, tr["mask"][1:]) if m] for row, tr in zip(seen[0][0].tolist(), trajs)]
    assert all(a * tr["reward"] >= 0 for row, tr in zip(adv, trajs) for a in row) and any(map(any, adv)), adv
    moved = sum(a * (y - x) for row, b, c in zip(adv, before, after) for a, x, y in zip(row, b, c))
    assert moved > 1e-4 * sum(abs(a) for row in adv for a in row), (moved, adv, before, after)


def test_a_loss_s_whole_batch_input_is_computed_once_per_step_and_each_micro_batch_gets_its_rows(tiny_model,
                                                                                                monkeypatch):
    """`PolicyLoss.batch_input` (a loss that ranks the tokens of the whole batch): the trainer computes it once
    per step, before any update, from the whole batch's old logprobs, advantages and mask (the same for
    every mini-batch and epoch, however the step is split), and each micro-batch's loss gets its rows as `batch`."""
    import torch
    import batches
    calls, seen = [], []

    def whole(old, A, m):
        calls.append((old, A, m))
        return torch.where(m, old + 10 * A, 0)   # [B, T]: says which rows and tokens it holds

    def probe(log_ratio, logprobs, A, m, lo, hi, batch):
        seen.append(torch.where(m, logprobs.detach() - log_ratio + 10 * A - batch, 0))   # its own rows: 0
        return losses.ppo(log_ratio, logprobs, A, m, lo, hi)
    monkeypatch.setitem(losses.POLICY_LOSSES, "probe", losses.PolicyLoss(probe, (0.2, 0.2), batch_input=whole))
    t = Trainer(trainer_cfg(tiny_model, loss="probe", micro_batch_size=3, ppo_epochs=2))
    trajs = _trajectories()
    batch = batches.collate(trajs, t.pad_id, t.dims.cp)
    expected = t._score(batch)["old"]
    t.train_step(trajs)
    (old, A, m), = calls
    torch.testing.assert_close(old, expected)   # the old policy's, all rows
    assert torch.equal(m, batch["mask"] > 0) and (A != 0).any()
    assert len(seen) > 2 * 2 and all(d.abs().max() < 1e-5 for d in seen), [d.abs().max() for d in seen]


def test_is_mask_zeroes_out_of_band_tokens_and_weights_in_band_ones_by_their_ratio(tiny_model):
    """--is_mode mask (IcePop): a token whose ratio is outside --is_band adds no gradient; one
    inside adds its gradient times its ratio. SGD makes the update linear in those weights."""
    flags = {"is_level": "token", "is_mode": "mask", "is_band": [0.5, 2.0]}
    start = _flat(_sgd_trainer(tiny_model, **flags).full_state_dict())
    deltas = {}
    for name, ratios in (("all in", {}), ("row 0 out", {0: 4.0}), ("row 0 at 0.8", {0: 0.8})):
        t = _sgd_trainer(tiny_model, **flags)
        metrics = t.train_step(_signal_trajectories(t, ratios))
        deltas[name] = _flat(t.full_state_dict()) - start
    row0 = deltas["all in"] - deltas["row 0 out"]        # row 0's contribution at weight 1
    assert row0.norm() > 0.05 * deltas["all in"].norm(), "an out-of-band token must lose its gradient"
    in_band = deltas["row 0 at 0.8"] - deltas["row 0 out"]
    assert (in_band - 0.8 * row0).norm() < 1e-3 * row0.norm(), "an in-band token's gradient is scaled by its ratio"
    assert metrics["is_weight_mean"] == pytest.approx((0.8 * 2 + 14) / 16, abs=1e-4)


def test_a_checkpoint_with_dropout_trains_with_dropout_off(tiny_model, tmp_path):
    """Scoring runs in eval() and training in train(): a config's dropout would make the first
    ratio differ from 1 (the engine never drops). The trainer turns it off, so at the trainer's
    own logprobs every ratio of the first pass is 1 (nothing leaves a 1e-4 band), and an export
    keeps the checkpoint's config."""
    import json
    import shutil
    model = tmp_path / "dropout"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    t = _sgd_trainer(str(model), eps_clip=[1e-4, 1e-4])
    metrics = t.train_step(_signal_trajectories(t))
    assert metrics["clip_frac"] == 0.0, "the first pass must score what it trains: ratio 1"
    assert abs(metrics["is_weight_mean"] - 1.0) < 1e-5
    assert json.loads((Path(t.export(str(tmp_path / "export"))) / "config.json").read_text())["attention_dropout"] == 0.5


def test_moe_router_jitter_is_off_like_dropout():
    """Mixtral's router_jitter_noise scales the router's input by random noise in train() only,
    as dropout does: the trainer turns it off, so a train() forward is the eval() one."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    from trainer import dropout_fields, without_dropout
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, router_jitter_noise=0.5)
    assert dropout_fields(config) == {"router_jitter_noise": 0.5}
    torch.manual_seed(0)
    model = without_dropout(MixtralForCausalLM(config))
    ids = torch.arange(12)[None]
    with torch.no_grad():
        scored = model.eval()(ids).logits
        trained = [model.train()(ids).logits for _ in range(2)]
    assert all(torch.equal(scored, t) for t in trained)


def _two_epochs(model, loss, eps, epochs):
    t = _sgd_trainer(model, loss=loss, ppo_epochs=epochs, **({"eps_clip": eps} if eps else {}))  # else its own
    t.train_step(_signal_trajectories(t))
    return _flat(t.full_state_dict())


def test_each_policy_loss_gives_its_own_gradient_through_the_trainer(tiny_model):
    """In a second pass over the batch the ratios are no longer 1 and the losses part ways: every
    two losses' updates differ (each at its own clip range), so an ignored --loss fails."""
    updates = {name: _two_epochs(tiny_model, name, None, 2) for name in losses.POLICY_LOSSES}
    start = _start(tiny_model)
    for a, b in itertools.combinations(updates, 2):
        assert (updates[a] - updates[b]).norm() > 1e-3 * (updates[a] - start).norm(), f"{a} and {b} update alike"


def test_ppo_clips_and_cispo_keeps_the_clipped_tokens_gradient(tiny_model):
    """Tight band: every token moved past it in the first pass, so PPO's second pass has zero
    gradient while CISPO's (clipped weight x logprob) still moves. Wide band: nothing clips, so
    PPO equals CISPO (ratio x A x grad logprob)."""
    tight, wide = [1e-4, 1e-4], [0.99, 100.0]
    ppo1, ppo2 = _two_epochs(tiny_model, "ppo", tight, 1), _two_epochs(tiny_model, "ppo", tight, 2)
    assert (ppo2 - ppo1).abs().max() == 0, "PPO: clipped tokens give no gradient"
    cispo1, cispo2 = _two_epochs(tiny_model, "cispo", tight, 1), _two_epochs(tiny_model, "cispo", tight, 2)
    assert torch_allclose(ppo1, cispo1), "at ratio 1 (first pass) the losses agree"
    assert (cispo2 - cispo1).norm() > 0.1 * (cispo1 - _start(tiny_model)).norm(), "CISPO keeps clipped tokens' gradient"
    assert torch_allclose(_two_epochs(tiny_model, "ppo", wide, 2), _two_epochs(tiny_model, "cispo", wide, 2))


def _start(model):
    return _flat(Trainer(trainer_cfg(model)).full_state_dict())


def torch_allclose(a, b):
    return bool((a - b).abs().max() < 1e-6)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_loss_moves_the_policy_toward_the_reference(tiny_model, tmp_path_factory, estimator):
    """All rewards equal (GRPO advantages 0): the only gradient is --kl_loss, and one SGD step
    lowers the sampled tokens' KL estimate to a different reference model."""
    import trainer as trainer_mod
    ref = trainer_mod.build_tiny_model(str(tmp_path_factory.mktemp("ref") / "tiny-seed1"), seed=1)
    t = _sgd_trainer(tiny_model, lr=0.05, kl_coef=1.0, kl_loss=True, kl_estimator=estimator, ref_model=ref)
    trajs = [{**tr, "reward": 1.0} for tr in _signal_trajectories(t)]
    ref_lp = _sampled(Trainer(trainer_cfg(ref)), trajs)
    import torch
    from losses import kl
    est = lambda lp: float(kl(torch.tensor(lp), torch.tensor(ref_lp), estimator).sum())
    before = est(_sampled(t, trajs))
    metrics = t.train_step(trajs)
    assert metrics["kl_loss"] > 0 and metrics["advantage_abs"] == 0
    assert est(_sampled(t, trajs)) < 0.95 * before


def test_mini_batches_are_exactly_the_asked_number(tiny_model):
    """9 rollouts (some were dropped) and --mini_batches 4: four optimizer steps, not
    torch.chunk's three; fewer rollouts than mini-batches (3 left after drops) train in one
    mini-batch each, said in the metrics, not as empty steps nor an error that stops the run."""
    t = Trainer(trainer_cfg(tiny_model, mini_batches=4, ppo_epochs=2))
    trajs = _trajectories(n_groups=3, group_size=3)
    m = t.train_step(trajs)
    assert (m["optimizer_steps"], m["mini_batches"]) == (8, 4)
    before = _flat(t.full_state_dict())
    m = t.train_step(trajs[:3])
    assert (m["optimizer_steps"], m["mini_batches"]) == (6, 3)
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert (_flat(t.full_state_dict()) - before).norm() > 0


def test_dumped_per_token_advantages_and_trainer_logprobs_align_with_the_tokens(tiny_model, tmp_path):
    """With --dump_rollouts the step returns, per trajectory and per token (aligned to `tokens`,
    not to the predicted position), the advantage it trained with and its own logprob: zero off
    the mask, the reward's sign (grpo) and the sampling logprobs on it (on-policy)."""
    t = Trainer(trainer_cfg(tiny_model, estimator="grpo", dump_rollouts=tmp_path))
    trajs = _signal_trajectories(t)
    per_token = t.train_step(trajs)["per_token"]
    for i, traj in enumerate(trajs):
        adv, lp = per_token["advantages"][i], per_token["trainer_logprobs"][i]
        assert len(adv) == len(lp) == len(traj["tokens"])
        for a, x, sampled, m in zip(adv, lp, traj["logprobs"], traj["mask"]):
            if not m:
                assert a == x == 0.0
            else:
                assert a != 0 and math.copysign(1, a) == math.copysign(1, traj["reward"])
                assert abs(x - sampled) < 1e-4 and x < 0
    # --old_logprobs engine: the old logprobs are the sampled ones, so there is no trainer logprob to dump
    bypass = Trainer(trainer_cfg(tiny_model, estimator="grpo", dump_rollouts=tmp_path, old_logprobs="engine"))
    assert set(bypass.train_step(_signal_trajectories(bypass))["per_token"]) == {"advantages"}


# ---------------------------------------------------------------- segments: a rollout cut into rows
# The credit rule (docs/algorithms.md): group statistics are over rollouts, every segment of a rollout carries
# the rollout's advantage, and a per-sequence loss mean is over rollouts. So an unrewritten episode cut into
# segments at turn boundaries trains exactly as the whole episode: its tokens see the same context.
PER_TURN = {"turns", "turn_rewards", "states", "nodes"}   # estimators of per-turn credit read these instead
WHOLE_ROLLOUT = [n for n, s in estimators.ESTIMATORS.items() if not PER_TURN & set(inspect.signature(s.fn).parameters)]


def _episodes(turns=8):
    """2 groups x 4 rollouts of `turns` turns each: an action of 1-2 sampled tokens, then an observation."""
    rng, trajs = random.Random(0), []
    for g in range(2):
        for i in range(4):
            tokens, mask, ends = [2, 8 + g, 15, 12, 16, 0, 3], [0] * 7, []
            for _ in range(turns):
                action, observation = rng.randint(1, 2), rng.randint(1, 2)
                tokens += [rng.randrange(5, 23) for _ in range(action + observation)]
                mask += [1] * action + [0] * observation
                ends.append(len(tokens) - observation)   # a segment ends at its last action token
            trajs.append({"tokens": tokens, "mask": mask, "ends": ends, "reward": float(i % 3) - g / 2,
                          "group": g, "rollout_id": i})
    return trajs


def _cut(traj, k, rng):
    """The episode as k segments (k - 1 random turn boundaries): each segment's row is the context up to
    its last action, trained on its own turns' actions; all share the rollout's id and reward."""
    cuts = [0, *sorted(rng.sample(range(1, len(traj["ends"])), k - 1)), len(traj["ends"])]
    segments = []
    for a, b in zip(cuts, cuts[1:]):
        start, end = (traj["ends"][a - 1] if a else 0), traj["ends"][b - 1]
        segments.append({**traj, "tokens": traj["tokens"][:end], "mask": [0] * start + traj["mask"][start:end]})
    return segments


def _sampled_by(trainer, trajs):   # sampling logprobs and versions as the trainer's own: IS ratio 1
    for t in trajs:
        t.update(logprobs=[0.0] * len(t["tokens"]), versions=[0 if m else -1 for m in t["mask"]])
    for t, lp in zip(trajs, trainer_logprobs(trainer, trajs)):
        t["logprobs"] = [0.0] + [x if m else 0.0 for x, m in zip(lp, t["mask"][1:])]
    return trajs


@pytest.mark.parametrize("loss_agg", losses.LOSS_AGGS)
@pytest.mark.parametrize("estimator", WHOLE_ROLLOUT)
def test_an_episode_cut_into_segments_trains_as_the_whole_episode(tiny_model, tmp_path, estimator, loss_agg):
    """K = 1..8 segments per rollout at random turn boundaries: the same per-token advantages and the same
    update (fp32, plain SGD) as the uncut episodes, under every estimator of whole-rollout credit and every
    --loss_agg. Counting each segment as a sequence (seq_mean_*) or a group member would change both."""
    opts = {"estimator": estimator, "loss_agg": loss_agg, "dump_rollouts": tmp_path,
            **({"kl_coef": 0.5, "ref_model": tiny_model} if estimators.ESTIMATORS[estimator].teacher else {})}
    whole, cut, rng = _episodes(), [], random.Random(1)
    for t in whole:
        cut += _cut(t, rng.randint(1, 8), rng)
    assert len(cut) > 2 * len(whole)
    updates, advantages = [], []
    for trajs in (whole, cut):
        t = _sgd_trainer(tiny_model, **opts)
        before = _flat(t.full_state_dict())
        per_token = t.train_step(_sampled_by(t, trajs))["per_token"]["advantages"]
        updates.append(_flat(t.full_state_dict()) - before)
        # each trained token's advantage, by (rollout, position): a segment trains a position of its rollout
        advantages.append({(tr["group"], tr["rollout_id"], j): a for tr, row in zip(trajs, per_token)
                           for j, (a, m) in enumerate(zip(row, tr["mask"])) if m})
    assert advantages[0].keys() == advantages[1].keys()
    assert all(abs(advantages[0][k] - advantages[1][k]) < 1e-6 for k in advantages[0])
    assert updates[0].norm() > 0 or estimators.ESTIMATORS[estimator].teacher   # (a teacher = the policy: no KL)
    assert (updates[0] - updates[1]).abs().max() < 1e-6
