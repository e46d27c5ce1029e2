"""Hand-computed checks for estimators.py. Run: python -m pytest -q tests/test_estimators.py"""

import math

import pytest
import torch

from fakes import other_value

import estimators
from estimators import ESTIMATORS, group_stats, whiten


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def ids(x):
    return torch.tensor(x, dtype=torch.long)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=1e-5)


def compute_advantages(name: str, rewards: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, **kw):
    """ESTIMATORS[name], its inputs' shapes checked (the trainer builds them so)."""
    B = mask.shape[0]
    assert mask.dim() == 2 and rewards.shape == (B,) == groups.shape
    assert all(kw.get(k) is None or kw[k].shape == mask.shape for k in ("kl", "values"))
    own = ESTIMATORS[name].settings
    return ESTIMATORS[name](rewards, mask, groups, {k: v for k, v in kw.items() if k in own},
                            **{k: v for k, v in kw.items() if k not in own})


# Two rows with gapped action tokens, plus a row with no action token at all.
MASK = t([[1, 1, 0, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
REW = t([2.0, -1.0, 5.0])
GRP = ids([0, 1, 2])


def test_reinforce_gamma_one_broadcasts_reward():
    adv, ret = compute_advantages("reinforce", REW, MASK, GRP)
    expected = [[2, 2, 0, 2, 0], [0, -1, -1, 0, 0], [0, 0, 0, 0, 0]]
    close(adv, expected)
    close(ret, expected)


def test_reinforce_gamma_discounts_over_action_tokens_only():
    # Row 0: actions at 0, 1, 3; the gap at 2 does not count as a step.
    adv, _ = compute_advantages("reinforce", REW, MASK, GRP, gamma=0.5)
    close(adv, [[0.5, 1, 0, 2, 0], [0, -0.5, -1, 0, 0], [0, 0, 0, 0, 0]])


def test_reinforce_kl_in_reward():
    kl = t([[1, 2, 9, 3, 9], [9, 1, 1, 9, 9], [9, 9, 9, 9, 9]])  # 9s are off-mask, must be ignored
    # Row 0 token rewards: -0.1, -0.2, (gap), 2 - 0.3; row 1: -0.1, -1 - 0.1.
    adv, _ = compute_advantages("reinforce", REW, MASK, GRP, kl=kl, kl_coef=0.1)
    close(adv, [[1.4, 1.5, 0, 1.7, 0], [0, -1.2, -1.1, 0, 0], [0, 0, 0, 0, 0]])
    adv, _ = compute_advantages("reinforce", REW, MASK, GRP, kl=kl, kl_coef=0.1, gamma=0.5)
    close(adv, [[0.225, 0.65, 0, 1.7, 0], [0, -0.65, -1.1, 0, 0], [0, 0, 0, 0, 0]])


def test_reinforce_pp_whitens_over_batch_action_tokens():
    mask = t([[1, 1, 0, 0], [0, 1, 0, 0], [1, 0, 0, 1]])
    adv, ret = compute_advantages("reinforce_pp", t([1.0, 4.0, 1.0]), mask, ids([0, 1, 2]))
    # Action-token returns 1,1,4,1,1: mean 1.6, population std 1.2.
    close(ret, [[1, 1, 0, 0], [0, 4, 0, 0], [1, 0, 0, 1]])
    close(adv, [[-0.5, -0.5, 0, 0], [0, 2, 0, 0], [-0.5, 0, 0, -0.5]])


def test_reinforce_pp_kl_and_gamma():
    mask = t([[1, 0, 1, 1]])
    kl = t([[0.5, 9, 0, 1]])
    # Token rewards -0.5, (gap), 0, 3 - 1 -> returns with gamma 0.5: 0, 1, 2.
    adv, ret = compute_advantages("reinforce_pp", t([3.0]), mask, ids([0]), kl=kl, kl_coef=1.0, gamma=0.5)
    close(ret, [[0, 0, 1, 2]])
    s = math.sqrt(2 / 3)
    close(adv, [[-1 / s, 0, 0, 1 / s]])


def test_reinforce_pp_baseline():
    mask = t([[1], [1], [1], [1], [1]])
    adv, ret = compute_advantages("reinforce_pp_baseline", t([1, 3, 0, 0, 6]), mask, ids([0, 0, 1, 1, 1]))
    # Group means 2 and 2 -> -1, 1, -2, -2, 4; mean 0, variance 26/5.
    close(ret, [[-1], [1], [-2], [-2], [4]])
    s = math.sqrt(26 / 5)
    close(adv, [[-1 / s], [1 / s], [-2 / s], [-2 / s], [4 / s]])


def test_reinforce_pp_baseline_counts_segments_once():
    # Rollout (g0, id0) is cut into rows 0 and 1; group 0 mean is (2 + 0) / 2 = 1, not 4/3.
    mask = t([[1, 0], [0, 1], [1, 1], [1, 0], [0, 1]])
    adv, ret = compute_advantages("reinforce_pp_baseline", t([2, 2, 0, 4, 0]), mask, ids([0, 0, 0, 1, 1]),
                                  rollout_ids=ids([0, 0, 1, 0, 1]))
    close(ret, [[1, 0], [0, 1], [-1, -1], [2, 0], [0, -2]])
    s = math.sqrt(2.0)  # tokens 1, 1, -1, -1, 2, -2: mean 0, variance 12/6
    close(adv, [[1 / s, 0], [0, 1 / s], [-1 / s, -1 / s], [2 / s, 0], [0, -2 / s]])


def test_rloo_unequal_groups():
    mask = t([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1], [1, 1]])
    adv, ret = compute_advantages("rloo", t([1, 2, 6, 5, 3, 7]), mask, ids([0, 0, 0, 1, 1, 2]))
    # 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2, 5 - 3, 3 - 5, single-member group -> 0.
    close(adv, [[-3, -3], [-1.5, 0], [0, 4.5], [2, 2], [-2, -2], [0, 0]])
    close(ret, adv.tolist())


def test_rloo_counts_segments_once():
    mask = torch.ones(4, 2)
    adv, _ = compute_advantages("rloo", t([5, 5, 1, 3]), mask, ids([0, 0, 0, 0]), rollout_ids=ids([3, 3, 4, 5]))
    # Rollouts 5, 1, 3: 5 - 2, 1 - 4, 3 - 3.
    close(adv, [[3, 3], [3, 3], [-3, -3], [0, 0]])


def test_grpo_population_std():
    mask = t([[1, 0, 1]] * 6)
    adv, _ = compute_advantages("grpo", t([1, 2, 3, 0, 4, 5]), mask, ids([0, 0, 0, 1, 1, 2]))
    s0, s1 = math.sqrt(2 / 3) + 1e-6, 2 + 1e-6
    a = [-1 / s0, 0, 1 / s0, -2 / s1, 2 / s1, 0]
    close(adv, [[x, 0, x] for x in a])


def test_grpo_and_dr_grpo_count_segments_once():
    mask = torch.ones(4, 1)
    rew, grp, rid = t([1, 1, 2, 6]), ids([0, 0, 0, 0]), ids([7, 7, 8, 9])
    # Rollouts 1, 2, 6: mean 3, population variance (4 + 1 + 9) / 3.
    s = math.sqrt(14 / 3) + 1e-6
    adv, _ = compute_advantages("grpo", rew, mask, grp, rollout_ids=rid)
    close(adv, [[-2 / s], [-2 / s], [-1 / s], [3 / s]])
    adv, ret = compute_advantages("dr_grpo", rew, mask, grp, rollout_ids=rid)
    close(adv, [[-2], [-2], [-1], [3]])
    close(ret, [[-2], [-2], [-1], [3]])


def test_rollout_ids_are_scoped_to_groups():
    # The same rollout id in two groups names two different rollouts.
    adv, _ = compute_advantages("dr_grpo", t([1, 3, 10, 20]), torch.ones(4, 1), ids([0, 0, 1, 1]),
                                rollout_ids=ids([0, 1, 0, 1]))
    close(adv, [[-1], [1], [-5], [5]])


def test_segments_must_share_reward():
    with pytest.raises(ValueError, match="share the same reward"):
        compute_advantages("grpo", t([1, 2]), torch.ones(2, 1), ids([0, 0]), rollout_ids=ids([0, 0]))


def test_dr_grpo_plain():
    adv, _ = compute_advantages("dr_grpo", t([1, 2, 3, 0, 4, 5]), torch.ones(6, 1), ids([0, 0, 0, 1, 1, 2]))
    close(adv, [[-1], [0], [1], [-2], [2], [0]])


def test_gae_skips_observation_tokens():
    mask = t([[1, 1, 0, 1], [0, 1, 1, 0]])
    values = t([[0.5, 1.0, 9.0, 2.0], [7.0, 1.0, 2.0, 7.0]])  # off-mask values are ignored
    adv, ret = compute_advantages("gae", t([3.0, 1.0]), mask, ids([0, 1]), values=values, gamma=0.9, lam=0.8)
    # Row 0 over actions v=(0.5, 1, 2), r=(0, 0, 3):
    #   A2 = 3 - 2 = 1; A1 = (0.9*2 - 1) + 0.72*1 = 1.52; A0 = (0.9*1 - 0.5) + 0.72*1.52 = 1.4944.
    # Row 1 over v=(1, 2), r=(0, 1): A1 = 1 - 2 = -1; A0 = (0.9*2 - 1) + 0.72*(-1) = 0.08.
    close(adv, [[1.4944, 1.52, 0, 1.0], [0, 0.08, -1.0, 0]])
    close(ret, [[1.9944, 2.52, 0, 3.0], [0, 1.08, 1.0, 0]])


def test_gae_with_kl_in_reward():
    mask, values, kl = t([[0, 1, 1, 0]]), t([[5, 1, 2, 5]]), t([[5, 1, 2, 5]])
    adv, ret = compute_advantages("gae", t([1.0]), mask, ids([0]), values=values, kl=kl, kl_coef=0.5)
    # gamma = lam = 1: A_t = (sum of remaining rewards) - V_t; rewards -0.5, 1 - 1.
    close(adv, [[0, -1.5, -2, 0]])
    close(ret, [[0, -0.5, 0, 0]])


def test_on_policy_distill():
    adv, ret = compute_advantages("on_policy_distill", t([100.0]), t([[1, 0, 1]]), ids([0]),
                                  kl=t([[0.5, 9, -1]]), kl_coef=2.0)
    close(adv, [[-1, 0, 2]])
    close(ret, [[-1, 0, 2]])


# ---------------------------------------------------------------- per-turn credit, by hand
# Two rows of group 0 and one of group 1; turns of each token (-1: padding), one turn reward each.
TURNS = ids([[0, 0, 1, 1, 2], [0, 0, 1, -1, -1], [0, 1, 1, 2, -1]])
TMASK = t([[1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0]])
TREW = t([[0, 1, 2], [1, 0, 0], [4, 0, 0]])
TGRP = ids([0, 0, 1])


def test_turn_reinforce_per_turn_returns_and_baseline():
    adv, ret = compute_advantages("turn_reinforce", t([3, 1, 4]), TMASK, TGRP, turns=TURNS, turn_rewards=TREW,
                                  turn_gamma=0.5)
    # G: row 0 (0 + 0.5 * 1 + 0.25 * 2, 1 + 0.5 * 2, 2) = (1, 2, 2); row 1 (1, 0); row 2 (4, 0, 0).
    close(ret, [[1, 0, 2, 0, 2], [1, 0, 0, 0, 0], [4, 0, 0, 0, 0]])
    # Baselines by (group, turn): group 0 turn 0 mean 1, turn 1 mean 1, turn 2 only row 0; group 1 alone.
    # Before whitening: row 0 tokens 0, 1, 0; row 1 tokens 0, -1; row 2 tokens 0, 0, 0 (mean -0.25 over 8).
    raw = t([[0, 0, 1, 0, 0], [0, 0, -1, 0, 0], [0, 0, 0, 0, 0]])
    close(adv, whiten(raw, TMASK).tolist())
    assert adv[0, 2] > 0 > adv[1, 2]
    # Without turns: each run of action tokens is a turn, and the row's reward sits on its last one.
    adv, ret = compute_advantages("turn_reinforce", t([2, 6]), t([[1, 0, 1, 1], [1, 1, 0, 0]]), ids([0, 0]),
                                  turn_gamma=0.5)
    close(ret, [[1, 0, 2, 2], [6, 6, 0, 0]])


def test_gigpo_episode_plus_step_groups():
    # Group 0: three 2-turn rollouts; rows 0 and 1 reach the same state at turn 1 (state id 5), row 2 another.
    turns, mask = ids([[0, 0, 1, 1]] * 3), t([[1, 0, 1, 0]] * 3)
    rew, trew = t([1, 0, 1]), t([[0, 1], [0, 0], [0, 1]])
    states = ids([[0, 5], [0, 5], [0, 9]])
    adv, ret = compute_advantages("gigpo", rew, mask, ids([0, 0, 0]), turns=turns, turn_rewards=trew,
                                  states=states, turn_gamma=0.5, step_weight=2.0)
    s = math.sqrt(2 / 9) + 1e-6
    ae = [1 / 3 / s, -2 / 3 / s, 1 / 3 / s]                    # (R - 2/3) / std
    # Turn 0 (the prompt, all three): returns 0.5, 0, 0.5 -> (R_0 - 1/3) / (sqrt(2)/6).
    s0 = math.sqrt(2) / 6 + 1e-6
    a0 = [(1 / 6) / s0, -(1 / 3) / s0, (1 / 6) / s0]
    # Turn 1: rows 0, 1 form a step group (returns 1, 0: +-1 / 0.5); row 2 is alone: 0.
    a1 = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0]
    close(adv, [[ae[i] + 2 * a0[i], 0, ae[i] + 2 * a1[i], 0] for i in range(3)], atol=1e-4)
    close(ret, [[0.5, 0, 1, 0], [0, 0, 0, 0], [0.5, 0, 1, 0]])
    # With step_weight 0 it is grpo.
    adv, _ = compute_advantages("gigpo", rew, mask, ids([0, 0, 0]), turns=turns, turn_rewards=trew,
                                states=states, step_weight=0.0)
    close(adv, compute_advantages("grpo", rew, mask, ids([0, 0, 0]))[0].tolist())
    # Segments of one rollout count once in the episode term, as in grpo.
    seg = dict(rollout_ids=ids([0, 0, 1]), turns=turns, turn_rewards=trew, step_weight=0.0)
    adv, _ = compute_advantages("gigpo", t([1, 1, 0]), mask, ids([0, 0, 0]), **seg)
    close(adv, [[1, 0, 1, 0], [1, 0, 1, 0], [-1, 0, -1, 0]], atol=1e-4)


def test_branch_value_spans_between_branch_points():
    # Rollout A branched before turn 1 into rows 0 and 1 (they share nodes 0 and 1); rollout B is row 2.
    turns, mask = ids([[0, 0, 1, 1]] * 3), t([[1, 0, 1, 0], [0, 0, 1, 0], [1, 0, 1, 0]])
    rew, trew, nodes = t([1, 0, 1]), t([[0, 1], [0, 0], [0, 1]]), ids([[0, 1], [0, 1], [0, 2]])
    adv, ret = compute_advantages("branch_value", rew, mask, ids([0, 0, 0]), turns=turns, turn_rewards=trew,
                                  nodes=nodes, rollout_ids=ids([0, 1, 2]))
    # V(prompt) = 2/3 over the three rows, V(node 1) = (1 + 0) / 2, V(node 2) = 1.
    # Rows 0, 1 turn 0: r_0 + V(node 1) - V(prompt) = -1/6; turn 1: G_1 - V(node 1) = +-0.5.
    # Row 2: one span from the prompt to the end: 1 - 2/3. All divided by the reward std sqrt(2/9).
    s = math.sqrt(2 / 9) + 1e-6
    close(adv, [[-1 / 6 / s, 0, 0.5 / s, 0], [0, 0, -0.5 / s, 0], [1 / 3 / s, 0, 1 / 3 / s, 0]], atol=1e-4)
    close(ret, [[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    # Unbranched rows are grpo.
    adv, _ = compute_advantages("branch_value", rew, t([[1, 0, 1, 0]] * 3), ids([0, 0, 0]), turns=turns,
                                turn_rewards=trew, nodes=ids([[0, 1], [0, 2], [0, 3]]))
    close(adv, compute_advantages("grpo", rew, t([[1, 0, 1, 0]] * 3), ids([0, 0, 0]))[0].tolist())


def test_whiten():
    out = whiten(t([[1, 2, 100], [3, 0, 0]]), t([[1, 1, 0], [1, 0, 0]]))
    s = math.sqrt(2 / 3)
    close(out, [[-1 / s, 0, 0], [1 / s, 0, 0]])


def test_group_stats():
    mean, std, n = group_stats(t([1, 1, 3, 7]), ids([4, 4, 4, 9]), ids([0, 0, 1, 0]))
    close(mean, [2, 2, 2, 7])
    close(std, [1, 1, 1, 0])
    close(n, [2, 2, 2, 1])


# ---------------------------------------------------------------- every estimator by its entry
# These run over ESTIMATORS: a new estimator is covered with no list to extend, and what its
# entry declares (estimators.Spec) is checked against what its function does.

def _inputs(name, seed=0, B=6, T=7):
    """Random inputs of every kind the trainer offers, and the entry's settings at their defaults."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[:, 0] = 1.0  # every row has an action token
    kw = dict(values=torch.randn(B, T, generator=g), rollout_ids=None)
    if ESTIMATORS[name].no_kl_in_reward is None:
        kw.update(kl=torch.randn(B, T, generator=g), kl_coef=0.1)
    return torch.randn(B, generator=g), mask, kw


def _groups(name, B=6):
    """Groups of the entry's smallest signal-giving size (at least 2; the last one may be smaller)."""
    return torch.arange(B) // max(2, ESTIMATORS[name].min_group)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_shape_dtype_and_mask(name):
    rewards, mask, kw = _inputs(name)
    kw = {k: v.bfloat16() if torch.is_tensor(v) else v for k, v in kw.items()}
    adv, ret = ESTIMATORS[name](rewards.bfloat16(), mask.bfloat16(), _groups(name), **kw)
    for x in (adv, ret):
        assert x.shape == mask.shape and x.dtype == torch.float32
        assert torch.isfinite(x).all()
        assert (x[mask == 0] == 0).all()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_min_group_is_the_smallest_group_that_gives_a_signal(name):
    """`min_group` (--samples_per_prompt must reach it) holds exactly: groups one rollout smaller
    give all-zero advantages, groups of min_group do not. (No KL-in-reward here: a per-token
    penalty is signal of its own; a teacher's KL is its whole signal.)"""
    rewards, mask, kw = _inputs(name, B=12)
    if not ESTIMATORS[name].teacher:
        kw.pop("kl", None), kw.pop("kl_coef", None)
    n = ESTIMATORS[name].min_group
    if n > 1:
        adv, _ = ESTIMATORS[name](rewards, mask, torch.arange(12) // (n - 1), **kw)
        assert (adv == 0).all(), f"groups of {n - 1} must give no signal"
    adv, _ = ESTIMATORS[name](rewards, mask, torch.arange(12) // n, **kw)
    assert not (adv == 0).all(), f"groups of {n} must give a signal"


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_kl_in_reward_is_used_or_refused_as_declared(name):
    rewards, mask, kw = _inputs(name)
    grp, kl = _groups(name), torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    if ESTIMATORS[name].no_kl_in_reward:
        with pytest.raises(ValueError, match="does not support KL-in-reward"):
            ESTIMATORS[name](rewards, mask, grp, **kw, kl=kl, kl_coef=0.1)
    else:
        a, _ = ESTIMATORS[name](rewards, mask, grp, **kw)
        b, _ = ESTIMATORS[name](rewards, mask, grp, **{**kw, "kl": kw["kl"] + kl})
        assert not torch.equal(a, b), "the KL must reach the advantages"


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_critic_and_teacher_are_what_the_estimator_uses(name):
    """critic: the advantages need and use the critic's values; teacher: they are
    -kl_coef * (log pi - log pi_teacher) whatever the rewards; neither: rewards move them (every reward's
    sign flipped: an estimator that reads only the sign, or ranks, moves too, which a rescaling need not do)."""
    spec, (rewards, mask, kw) = ESTIMATORS[name], _inputs(name)
    grp = _groups(name)
    adv, _ = ESTIMATORS[name](rewards, mask, grp, **kw)
    other_values, _ = ESTIMATORS[name](rewards, mask, grp, **{**kw, "values": kw["values"] + 1.0})
    assert spec.critic == (not torch.equal(adv, other_values))
    if spec.critic:
        with pytest.raises(ValueError, match="needs critic values"):
            ESTIMATORS[name](rewards, mask, grp, **{**kw, "values": None})
    other_rewards, _ = ESTIMATORS[name](-rewards, mask, grp, **kw)
    assert spec.teacher == torch.equal(adv, other_rewards)
    if spec.teacher:
        close(adv, (-kw["kl_coef"] * kw["kl"] * mask).tolist())


SETTINGS = [(name, k) for name, spec in sorted(ESTIMATORS.items()) for k in spec.settings]


@pytest.mark.parametrize("name, setting", SETTINGS, ids=[f"{n}-{k}" for n, k in SETTINGS])
def test_each_declared_setting_reaches_its_estimator(name, setting):
    """A setting an entry declares changes its advantages (a flag the function ignores fails),
    and one out of its bounds is refused."""
    spec, (rewards, mask, kw) = ESTIMATORS[name], _inputs(name)
    s = spec.settings[setting]
    base, _ = spec(rewards, mask, _groups(name), {}, **kw)
    moved, _ = spec(rewards, mask, _groups(name), {setting: other_value(s)}, **kw)
    assert not torch.equal(base, moved)
    for bad in ((s.low - 1) if s.low is not None else None, (s.high + 1) if s.high is not None else None):
        if bad is not None:
            with pytest.raises(ValueError, match=f"--{setting} must be"):
                spec(rewards, mask, _groups(name), {setting: bad}, **kw)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_an_estimator_takes_only_trainer_inputs_and_its_own_settings(name):
    """Every keyword of its function is an input the trainer offers or a setting its entry declares
    (a setting declared in the function alone would never get its flag), and settings of others
    are refused."""
    import inspect
    spec, offered = ESTIMATORS[name], set(estimators.INPUTS)
    keywords = [p for p in inspect.signature(spec.fn).parameters.values() if p.kind == p.KEYWORD_ONLY]
    assert {p.name for p in keywords} <= offered | set(spec.settings)
    assert set(spec.settings) <= {p.name for p in keywords}
    rewards, mask, kw = _inputs(name)
    with pytest.raises(ValueError, match="has no setting"):
        spec(rewards, mask, _groups(name), {"not_a_setting": 1.0}, **kw)


def test_errors():
    m, r, g = torch.ones(2, 3), t([1.0, 2.0]), ids([0, 0])
    with pytest.raises(ValueError, match="gae needs critic values"):
        compute_advantages("gae", r, m, g)
    with pytest.raises(ValueError, match="on_policy_distill needs kl"):
        compute_advantages("on_policy_distill", r, m, g, kl_coef=1.0)
    with pytest.raises(ValueError, match="on_policy_distill needs kl_coef > 0"):
        compute_advantages("on_policy_distill", r, m, g, kl=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="reinforce_pp: kl_coef=0.1 needs kl"):
        ESTIMATORS["reinforce_pp"](r, m, g, kl_coef=0.1)
    with pytest.raises(ValueError, match="grpo does not support KL-in-reward"):
        compute_advantages("grpo", r, m, g, kl=torch.zeros(2, 3), kl_coef=0.1)
