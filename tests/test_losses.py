"""Hand-computed checks for losses.py. Run: python -m pytest -q tests/test_losses.py"""

import itertools
import math
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fakes import other_value
from losses import (IS_LEVELS, IS_MODES, LOSS_AGGS, POLICY_LOSSES, aggregate, entropy, is_weights, kl,
                    policy_loss, token_logprobs, value_loss)

LN = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual.float(), t(expected), atol=atol, rtol=1e-5)


def leaf(x):
    return t(x).requires_grad_(True)


def grad_of(kind, lp, old, adv, mask, **kw):
    """Per-token loss and d(token_mean loss)/d logprobs."""
    lp = leaf(lp)
    loss, metrics = policy_loss(kind, lp, t(old), t(adv), t(mask), **kw)
    aggregate(loss, t(mask), "token_mean").backward()
    return loss.detach(), lp.grad, metrics


# ---------------------------------------------------------------- PPO

def test_ppo_values_metrics_and_grad():
    old = [-1.0, -2.0, -0.5, -1.2, -3.0]
    ratios = [1.5, 0.5, 1.1, 1.0, 50.0]  # last token is off-mask
    lp = [o + LN(r) for o, r in zip(old, ratios)]
    adv, mask = [1.0, -1.0, 2.0, -3.0, 5.0], [1, 1, 1, 1, 0]
    loss, grad, m = grad_of("ppo", [lp], [old], [adv], [mask])
    # 1.5*1 vs 1.2*1 -> -1.2 (clipped); -0.5 vs -0.8 -> 0.8 (clipped); 2.2 unclipped; 3 unclipped.
    close(loss, [[-1.2, 0.8, -2.2, 3.0, 0.0]])
    # Unclipped tokens: d(-r A)/dlogp = -r A, divided by 4 action tokens; clipped and masked: 0.
    close(grad, [[0.0, 0.0, -2.2 / 4, 3.0 / 4, 0.0]])
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 1.0) / 4)
    close(m["approx_kl"], ((0.5 - LN(1.5)) + (-0.5 - LN(0.5)) + (0.1 - LN(1.1))) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_ppo_pessimistic_side_is_not_clipped():
    # ratio 1.5 with A < 0: max(1.5, 1.2) = 1.5 keeps the gradient -A r = 1.5.
    loss, grad, m = grad_of("ppo", [[LN(1.5)]], [[0.0]], [[-1.0]], [[1]])
    close(loss, [[1.5]])
    close(grad, [[1.5]])
    close(m["clip_frac"], 0.0)


def test_ppo_asymmetric_eps():
    # Bounds [0.9, 1.28]: ratio 1.25 with A = 1 is inside (grad -1.25 / 2);
    # ratio 0.85 with A = -1 gives max(0.85, 0.9) = 0.9, clipped, zero gradient.
    loss, grad, _ = grad_of("ppo", [[LN(1.25), LN(0.85)]], [[0.0, 0.0]], [[1.0, -1.0]], [[1, 1]],
                            eps_low=0.1, eps_high=0.28)
    close(loss, [[-1.25, 0.9]])
    close(grad, [[-1.25 / 2, 0.0]])


def test_ppo_dual_clip_caps_negative_advantages():
    ratios = [5.0, 2.0, 3.01, 2.99, 5.0]
    adv = [-1.0, -1.0, -1.0, -1.0, 1.0]
    lp = [[LN(r) for r in ratios]]
    loss, grad, m = grad_of("ppo", lp, [[0.0] * 5], [adv], [[1] * 5], dual_clip=3.0)
    # A<0: min(max(r, 0.8), 3); just above the cap the loss is exactly 3 with zero gradient,
    # just below it is r with gradient r. A>0 is untouched by dual clip: -1.2, no gradient.
    close(loss, [[3.0, 2.0, 3.0, 2.99, -1.2]])
    close(grad, [[0.0, 2.0 / 5, 0.0, 2.99 / 5, 0.0]])
    close(m["clip_frac"], 3 / 5)
    loss, _, _ = grad_of("ppo", lp, [[0.0] * 5], [adv], [[1] * 5])
    close(loss, [[5.0, 2.0, 3.01, 2.99, -1.2]])


# ---------------------------------------------------------------- GSPO

def test_gspo_sequence_ratio_and_token_gradient():
    # Per-token log-ratios; 7.0 and 9.0 are off-mask and must not enter the sequence mean.
    lr = [[0.2, -0.1, 7.0, 0.5], [0.6, 0.4, 9.0, 9.0], [0.6, 0.4, 9.0, 9.0]]
    old = [[-1.0, -2.0, -3.0, -0.5], [-0.3, -0.7, -1.0, -1.0], [-0.3, -0.7, -1.0, -1.0]]
    lp = [[o + r for o, r in zip(orow, rrow)] for orow, rrow in zip(old, lr)]
    mask = [[1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    adv = [[1.0] * 4, [2.0] * 4, [-2.0] * 4]
    loss, grad, m = grad_of("gspo", lp, old, adv, mask, eps_low=0.3, eps_high=0.3)
    s0, s1 = math.exp(0.2), math.exp(0.5)  # exp(mean log-ratio): 1.2214 (inside), 1.6487 (> 1.3)
    # Row 1 (A > 0) is clipped to 1.3; row 2 (A < 0) takes max(2 s1, 2.6) = 2 s1, unclipped.
    close(loss, [[-s0, -s0, 0, -s0], [-2.6, -2.6, 0, 0], [2 * s1, 2 * s1, 0, 0]])
    # Every token of a row gets the same gradient -A s_i / N (N = 7), although token ratios differ.
    close(grad, [[-s0 / 7, -s0 / 7, 0, -s0 / 7], [0, 0, 0, 0], [2 * s1 / 7] * 2 + [0, 0]])
    close(m["clip_frac"], 2 / 7)
    close(m["ratio_mean"], (3 * s0 + 4 * s1) / 7)
    k3 = [math.exp(x) - 1 - x for x in (0.2, -0.1, 0.5, 0.6, 0.4, 0.6, 0.4)]
    close(m["approx_kl"], sum(k3) / 7)


# ---------------------------------------------------------------- CISPO

@pytest.mark.parametrize("eps_low, w, clipped", [
    (None, [1.2, 0.5, 1.1], 1),   # MiniMax-M1: only the upper bound 1 + eps_high
    (0.2, [1.2, 0.8, 1.1], 2),    # asked for: both bounds
])
def test_cispo_gradient_only_through_logprobs(eps_low, w, clipped):
    old = [-1.0, -2.0, -0.5, -3.0]
    ratios = [1.5, 0.5, 1.1, 30.0]
    lp = [o + LN(r) for o, r in zip(old, ratios)]
    adv, mask = [1.0, -1.0, 2.0, 0.5], [1, 1, 1, 0]
    loss, grad, m = grad_of("cispo", [lp], [old], [adv], [mask], eps_low=eps_low)
    # w = the clipped ratio, treated as a constant
    close(loss, [[-w[0] * 1.0 * lp[0], -w[1] * -1.0 * lp[1], -w[2] * 2.0 * lp[2], 0.0]])
    # If the ratio carried gradient, extra terms -w A logp would appear here.
    close(grad, [[-w[0] / 3, w[1] / 3, -2 * w[2] / 3, 0.0]])
    close(m["clip_frac"], clipped / 3)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1) / 3)


# ---------------------------------------------------------------- shared

def _settings(kind):
    """Every setting the loss declares, away from its default (so each is exercised)."""
    return {k: other_value(s) for k, s in POLICY_LOSSES[kind].settings.items()}


@pytest.mark.parametrize("kind", POLICY_LOSSES)
def test_masked_positions_zero_even_with_inf(kind):
    inf = float("inf")
    lp = leaf([[-0.5, -inf, -1.0, -inf], [-0.2, -0.4, 60.0, -inf]])
    old = t([[-0.7, -inf, -1.1, 0.0], [-0.3, -0.1, -60.0, -inf]])
    mask = t([[1, 0, 1, 0], [1, 1, 0, 0]])
    loss, m = policy_loss(kind, lp, old, t([[1.0, 5.0, -1.0, 5.0], [0.5, -0.5, 5.0, 5.0]]), mask, **_settings(kind))
    aggregate(loss, mask, "seq_mean_token_mean").backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert (loss[mask == 0] == 0).all() and (lp.grad[mask == 0] == 0).all()
    assert (lp.grad[mask == 1] != 0).any()
    assert all(torch.isfinite(v) for v in m.values())


def _random_step(seed=0, B=8, T=12, spread=0.5):
    """Off-policy inputs: log-ratios ~ N(0, spread), advantages ~ N(0, 1), a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + spread * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    return lp, old, torch.randn(B, T, generator=g), mask


def _grad(kind, lp, old, adv, mask, **kw):
    lp = lp.clone().requires_grad_(True)
    spec = POLICY_LOSSES[kind]
    eps = spec.eps_clip or (None, 0.0)
    loss, _ = policy_loss(kind, lp, old, adv, mask, eps_low=eps[0], eps_high=eps[1], **kw)
    aggregate(loss, mask, spec.loss_agg).backward()
    return lp.grad


@pytest.mark.parametrize("kind", POLICY_LOSSES)
def test_on_policy_every_loss_gives_the_policy_gradient(kind):
    """At ratio 1 (the first pass over a batch) a policy loss's gradient is the policy gradient
    A * grad log pi under its own aggregation: a flipped sign or a scaled gradient fails this."""
    _, old, adv, mask = _random_step()
    grad = _grad(kind, old, old, adv, mask, **_settings(kind))
    expected = _grad("ppo", old, old, adv, mask) if POLICY_LOSSES[kind].loss_agg == "token_mean" else None
    per_row = mask.sum(1, keepdim=True).clamp(min=1) * mask.shape[0]
    want = {"token_mean": -adv * mask / mask.sum(), "seq_mean_token_mean": -adv * mask / per_row,
            "seq_mean_token_sum": -adv * mask / mask.shape[0]}[POLICY_LOSSES[kind].loss_agg]
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5)
    if expected is not None:
        torch.testing.assert_close(grad, expected)


def test_off_policy_each_loss_gives_its_own_gradient():
    """Off policy (ratios spread around 1) every two losses differ: a copy of another loss, or a
    loss the dispatcher ignores, fails this."""
    step = _random_step()
    grads = {kind: _grad(kind, *step) for kind in POLICY_LOSSES}
    for a, b in itertools.combinations(grads, 2):
        assert (grads[a] - grads[b]).abs().max() > 1e-4, f"{a} and {b} give the same gradient"


SETTINGS = [(kind, k) for kind, spec in POLICY_LOSSES.items() for k in spec.settings]


@pytest.mark.parametrize("kind, setting", SETTINGS, ids=[f"{n}-{k}" for n, k in SETTINGS])
def test_each_declared_setting_reaches_its_loss(kind, setting):
    """A setting a loss declares changes its gradient off policy (a flag the function ignores
    fails), and one out of its bounds is refused."""
    lp, old, adv, mask = _random_step(spread=2.0)
    s = POLICY_LOSSES[kind].settings[setting]
    assert (_grad(kind, lp, old, adv, mask) - _grad(kind, lp, old, adv, mask, **{setting: other_value(s)})).abs().max() > 1e-6
    for bad in ((s.low - 1) if s.low is not None else None, (s.high + 1) if s.high is not None else None,
                s.low if s.low_open else None):
        if bad is not None:
            with pytest.raises(ValueError, match=f"--{setting} must be"):
                _grad(kind, lp, old, adv, mask, **{setting: bad})


def test_log_ratio_is_clamped():
    loss, m = policy_loss("ppo", t([[0.0]]), t([[-1000.0]]), t([[-1.0]]), t([[1]]))
    close(loss, [[math.exp(20.0)]], atol=1e4)
    assert torch.isfinite(m["approx_kl"])


def test_policy_loss_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown policy loss 'sapo'.*cispo"):
        policy_loss("sapo", x, x, x, x)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss("ppo", x, x, x, x, dual_clip=0.5)
    with pytest.raises(ValueError, match="cispo has no setting dual_clip"):
        policy_loss("cispo", x, x, x, x, dual_clip=3.0)
    with pytest.raises(ValueError, match="ppo needs eps_low"):
        policy_loss("ppo", x, x, x, x, eps_low=None)


@pytest.mark.parametrize("kind", POLICY_LOSSES)
def test_each_loss_refuses_what_its_entry_refuses(kind):
    spec, x = POLICY_LOSSES[kind], torch.zeros(1, 2)
    for name in {n for s in POLICY_LOSSES.values() for n in s.settings} - set(spec.settings):
        with pytest.raises(ValueError, match=f"{kind} has no setting {name}"):
            policy_loss(kind, x, x, x, x, **{name: 3.0})
    if spec.eps_clip and spec.eps_clip[0] is not None:
        with pytest.raises(ValueError, match=f"{kind} needs eps_low"):
            policy_loss(kind, x, x, x, x, eps_low=None)
    eps = spec.eps_clip or (None, 0.0)
    policy_loss(kind, x, x, x, x, eps_low=eps[0], eps_high=eps[1])  # its defaults work


# ---------------------------------------------------------------- aggregation

def test_aggregate_values():
    loss, mask = t([[1, 2, 3], [4, 5, 6]]), t([[1, 1, 0], [1, 0, 0]])
    close(aggregate(loss, mask, "token_mean"), 7 / 3)
    close(aggregate(loss, mask, "token_mean", num_tokens=10), 0.7)
    close(aggregate(loss, mask, "token_mean", num_tokens=torch.tensor(10)), 0.7)
    close(aggregate(loss, mask, "seq_mean_token_mean"), (1.5 + 4) / 2)
    close(aggregate(loss, mask, "seq_mean_token_mean", num_seqs=5), 1.1)
    close(aggregate(loss, mask, "seq_mean_token_sum"), (3 + 4) / 2)
    close(aggregate(loss, mask, "seq_mean_token_sum", num_seqs=7), 1.0)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(loss, mask, "mean")
    assert LOSS_AGGS == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _batch(B=6, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.35).float()
    mask[0] = 1.0  # make rows unequal in length so naive per-micro-batch means would differ
    return lp, old, adv, mask


def _whole(kind, old, adv, mask):
    """The entry's whole-batch input at its default settings (None: it declares none), as the trainer computes it."""
    spec = POLICY_LOSSES[kind]
    return spec.batch_input and spec.batch_input(old, adv, mask.bool(), **{k: s.default for k, s in spec.settings.items()})


@pytest.mark.parametrize("kind", POLICY_LOSSES)
@pytest.mark.parametrize("mode", LOSS_AGGS)
def test_microbatch_invariance(kind, mode):
    """Split into micro-batches as the trainer splits a step (a whole-batch input computed once on the whole
    batch, each micro-batch given its rows of it), the gradient is the whole batch's."""
    lp, old, adv, mask = _batch()
    full = lp.clone().requires_grad_(True)
    aggregate(policy_loss(kind, full, old, adv, mask)[0], mask, mode).backward()

    whole, split = _whole(kind, old, adv, mask), lp.clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, _ = policy_loss(kind, split[rows], old[rows], adv[rows], mask[rows],
                              batch=None if whole is None else whole[rows])
        aggregate(loss, mask[rows], mode, num_tokens=mask.sum(), num_seqs=6).backward()
    torch.testing.assert_close(split.grad, full.grad, atol=1e-6, rtol=1e-5)


def _model_batch(seed=0, B=4, T=6, D=5, V=7):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, V, generator=g)
    x = torch.randn(B, T, D, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = token_logprobs(x @ W, tokens) + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]]).float()
    return W, x, tokens, old, adv, mask


def _step_grad(W, x, tokens, old, adv, mask, mode, num_tokens, num_seqs):
    W = W.clone().requires_grad_(True)
    lp = token_logprobs(x @ W, tokens, temperature=0.7)
    loss, _ = policy_loss("ppo", lp, old, adv, mask, dual_clip=3.0)
    aggregate(loss, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs).backward()
    return W.grad


def _dist_worker(rank, world, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        W, x, tokens, old, adv, mask = _model_batch()
        rows = slice(rank * 2, rank * 2 + 2)  # each rank takes half the rows
        grads = {}
        for mode in LOSS_AGGS:
            g = _step_grad(W, x[rows], tokens[rows], old[rows], adv[rows], mask[rows], mode,
                           num_tokens=mask.sum(), num_seqs=4)
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
            grads[mode] = g
        if rank == 0:
            torch.save(grads, path)
    finally:
        dist.destroy_process_group()


def test_data_parallel_invariance_two_gloo_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "grads.pt")
        mp.spawn(_dist_worker, args=(2, port, path), nprocs=2, join=True)
        grads = torch.load(path)
    W, x, tokens, old, adv, mask = _model_batch()
    for mode in LOSS_AGGS:
        single = _step_grad(W, x, tokens, old, adv, mask, mode, None, None)
        torch.testing.assert_close(grads[mode], single, atol=1e-6, rtol=1e-5)
    # Sanity: the halves have different token counts, so local normalisation would not match.
    assert mask[:2].sum() != mask[2:].sum()


# ---------------------------------------------------------------- importance sampling

# Ratios old/rollout on action tokens: row 0 -> 2, 0.5, 1; row 1 -> 1.5, 0.25 (gap between).
ROLL = t([[-1.0, -2.0, -0.5, 0.0], [-1.5, 0.0, -0.3, 0.0]])
RATIO = [[2.0, 0.5, 1.0, 1.0], [1.5, 100.0, 0.25, 1.0]]
OLD = ROLL + torch.log(t(RATIO))
OLD[0, 3] = -float("inf")  # off-mask garbage must not matter
IS_MASK = t([[1, 1, 1, 0], [1, 0, 1, 0]])


def _is(level, mode):
    return is_weights(OLD, ROLL, IS_MASK, level=level, mode=mode, low=0.6, high=1.8)


@pytest.mark.parametrize("level,mode,weights,filtered", [
    ("off", "mask", [[1, 1, 1, 0], [1, 0, 1, 0]], 0.0),
    # mask (IcePop) keeps the ratio where the gate passes; reject gives 1 there.
    ("token", "mask", [[0, 0, 1, 0], [1.5, 0, 0, 0]], 3 / 5),
    ("token", "reject", [[0, 0, 1, 0], [1, 0, 0, 0]], 3 / 5),
    ("token", "clip", [[1.8, 0.6, 1, 0], [1.5, 0, 0.6, 0]], 3 / 5),
    ("token", "trunc", [[1.8, 0.5, 1, 0], [1.5, 0, 0.25, 0]], 1 / 5),
    # seq: products 1 (accept) and 0.375 (reject); geo: 1 and sqrt(0.375) = 0.612 (both accepted).
    # The gate is per row; an accepted row keeps each token's own ratio under mask, truncated
    # at HIGH (the 2 -> 1.8, counted as filtered like trunc's).
    ("seq", "mask", [[1.8, 0.5, 1, 0], [0, 0, 0, 0]], 3 / 5),
    ("seq", "reject", [[1, 1, 1, 0], [0, 0, 0, 0]], 2 / 5),
    ("geo", "mask", [[1.8, 0.5, 1, 0], [1.5, 0, 0.25, 0]], 1 / 5),
    ("geo", "reject", [[1, 1, 1, 0], [1, 0, 1, 0]], 0.0),
])
def test_is_weights(level, mode, weights, filtered):
    w, m = _is(level, mode)
    close(w, weights)
    close(m["is_filtered_frac"], filtered)
    close(m["is_weight_mean"], sum(map(sum, weights)) / 5)
    k3 = sum(r - 1 - LN(r) for r in (2.0, 0.5, 1.0, 1.5, 0.25)) / 5
    close(m["mismatch_k3"], k3)
    close(m["mismatch_abs"], (LN(2) + LN(2) + 0 + LN(1.5) + LN(4)) / 5)


def test_is_weights_detached_and_errors():
    old = OLD.clone().requires_grad_(True)
    w, _ = is_weights(old, ROLL, IS_MASK, level="token", mode="clip", low=0.5, high=2.0)
    assert not w.requires_grad
    for level in ("seq", "geo"):
        for mode in ("clip", "trunc"):
            with pytest.raises(ValueError, match="needs mode 'mask' or 'reject'"):
                _is(level, mode)
    with pytest.raises(ValueError, match="unknown IS level"):
        _is("row", "mask")
    with pytest.raises(ValueError, match="unknown IS mode"):
        _is("token", "drop")
    with pytest.raises(ValueError, match="low <= high"):
        is_weights(OLD, ROLL, IS_MASK, level="token", mode="mask", low=2.0, high=1.0)
    assert IS_LEVELS == ("off", "token", "seq", "geo") and IS_MODES == ("mask", "reject", "clip", "trunc")


def test_is_mask_bounds_tokens_inside_a_kept_row():
    """A row's gate can pass while one of its tokens is far outside the band: one token at
    ratio 100 in a 1000-token row (geometric mean 1.005), or 100 next to 0.01 (product 1). The
    row is kept; the token's weight is its ratio truncated at HIGH, never 100."""
    lr = torch.zeros(1, 1000)
    lr[0, 7] = LN(100.0)
    w, m = is_weights(lr, torch.zeros(1, 1000), torch.ones(1, 1000), level="geo", mode="mask", low=0.5, high=2.0)
    assert w[0, 7] == 2.0 and (w[0, :7] == 1).all() and (w[0, 8:] == 1).all()
    close(m["is_filtered_frac"], 1 / 1000)
    w, _ = is_weights(t([[LN(100.0), LN(0.01)]]), torch.zeros(1, 2), torch.ones(1, 2), level="seq", mode="mask",
                      low=0.5, high=2.0)
    close(w, [[2.0, 0.01]])
    assert float(w.max()) <= 2.0


def test_is_seq_long_sequence_does_not_overflow():
    # Summed log-ratio 100 * 0.5 = 50, i.e. ratio e^50 > high = 1e10 -> reject. A clamped
    # exp(min(50, 20)) = 4.9e8 would wrongly pass; the comparison must happen in log space.
    args = (torch.full((1, 100), 0.5), torch.zeros(1, 100), torch.ones(1, 100))
    w, _ = is_weights(*args, level="seq", mode="reject", low=0.0, high=1e10)
    assert (w == 0).all()
    w, _ = is_weights(*args, level="seq", mode="reject", low=0.0, high=1e30)
    assert (w == 1).all()


# ---------------------------------------------------------------- kl, entropy, value, logprobs

def test_kl_estimators():
    lp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    close(kl(lp, ref, "k1"), [[0.5, -1.0]])
    close(kl(lp, ref, "k2"), [[0.125, 0.5]])
    close(kl(lp, ref, "k3"), [[math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1]])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl(lp, ref, "k4")


def test_entropy():
    close(entropy(t([[0.0, LN(3)], [1.0, 1.0]])), [-(0.25 * LN(0.25) + 0.75 * LN(0.75)), LN(2)])
    z = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)) * 4
    p = torch.softmax(z, -1)
    torch.testing.assert_close(entropy(z), -(p * torch.log(p)).sum(-1))
    assert entropy(z.bfloat16()).dtype == torch.float32


def test_value_loss():
    v, old, R, mask = t([[1.0, 2.0, 2.0, 9.0]]), t([[0.5, 2.5, 1.9, 0.0]]), t([[2.0, 1.0, 0.0, 0.0]]), t([[1, 1, 1, 0]])
    # Clipped v: 0.5 + 0.2 = 0.7 -> (1.3)^2 > 1; 2.5 - 0.2 = 2.3 -> 1.69 > 1; 1.9 + 0.1 = 2.0 -> 4 = 4.
    close(value_loss(v, old, R, mask, 0.2), [[0.845, 0.845, 2.0, 0.0]])
    close(value_loss(v, old, R, mask, None), [[0.5, 0.5, 2.0, 0.0]])


def test_token_logprobs():
    logits, tok = t([[[0.0, LN(3)], [0.0, LN(3)]]]), torch.tensor([[1, 0]])
    close(token_logprobs(logits, tok), [[LN(0.75), LN(0.25)]])
    # At temperature 0.5 the logits become (0, 2 ln 3): probabilities 1/10, 9/10.
    close(token_logprobs(logits, tok, temperature=0.5), [[LN(0.9), LN(0.1)]])

    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 13, generator=g) * 3
    tokens = torch.randint(0, 13, (2, 3), generator=g)
    a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    out = token_logprobs(a, tokens, temperature=0.7)
    ref = torch.log_softmax(b / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, tokens, temperature=0.0)


# ---------------------------------------------------------------- where each KL estimator goes

def _kl_grads(theta, ref):
    """Exact expected gradients (enumerating a categorical policy softmax(theta)) of each
    estimator in each placement, and the gradients of the two KLs."""
    def grad(f):
        th = theta.clone().requires_grad_(True)
        logp = torch.log_softmax(th, -1)
        return torch.autograd.grad(f(logp, logp.exp().detach()), th)[0]
    out = {"KL(pi||ref)": grad(lambda lp, p: (lp.exp() * (lp - ref)).sum()),
           "KL(ref||pi)": grad(lambda lp, p: (ref.exp() * (ref - lp)).sum())}
    for est in ("k1", "k2", "k3"):
        # reward: the policy gradient of the penalty, E_pi[grad log pi * k] (k a constant);
        # loss: grad E_pi[k] with the samples fixed (the gradient flows through log pi in k).
        out["reward", est] = grad(lambda lp, p: (p * lp * kl(lp, ref, est).detach()).sum())
        out["loss", est] = grad(lambda lp, p: (p * kl(lp, ref, est)).sum())
    return out


def test_kl_placements_follow_the_kl_gradient():
    """Every (placement, estimator) that main.validate accepts has the gradient of the KL it
    claims (cosine > 0.99); every refused one points elsewhere (or nowhere, k1 as a loss)."""
    from losses import KL_ESTIMATORS, KL_PLACEMENTS
    cos = torch.nn.functional.cosine_similarity
    g = torch.Generator().manual_seed(0)
    closest = {}  # refused pair -> its best cosine with either KL, per random policy
    for _ in range(20):
        theta, ref = torch.randn(6, generator=g) * 1.5, torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
        grads = _kl_grads(theta, ref)
        for where in ("reward", "loss"):
            for est in KL_ESTIMATORS:
                v = grads[where, est]
                if est in KL_PLACEMENTS[where]:
                    assert cos(v, grads[KL_PLACEMENTS[where][est]], 0) > 0.99, (where, est)
                else:
                    best = 0.0 if v.norm() < 1e-6 else max(float(cos(v, grads[k], 0)) for k in ("KL(pi||ref)", "KL(ref||pi)"))
                    closest.setdefault((where, est), []).append(best)
    assert set(closest) == {("reward", "k2"), ("reward", "k3"), ("loss", "k1")}
    for pair, best in closest.items():  # k1 as a loss: no gradient; k2/k3 in the reward: some policy sees them point away
        assert min(best) < 0.5, pair
