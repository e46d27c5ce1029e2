"""Per-token RL losses and their pieces: policy losses (PPO / GSPO / CISPO), loss aggregation that is invariant
to micro-batching and data parallelism, train/rollout importance-sampling correction, KL estimators, entropy,
clipped value loss and token log-probabilities from logits.

Conventions: tensors are [B, T] with `mask` 1 on the policy's action tokens; per-token outputs are exactly 0
(value and gradient) where mask == 0. Log-ratios are clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp.
Metrics are detached 0-dim tensors (masked means over action tokens).

To add a policy loss: AGENTS.md, "Add a loss" (a function and its `PolicyLoss` in POLICY_LOSSES).

Test: python -m pytest -q tests/test_losses.py
"""

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "reject", "clip", "trunc")
KL_ESTIMATORS = ("k1", "k2", "k3")
# Where each KL estimator is sound (main.validate refuses the rest): in the reward the gradient is
# E[grad log pi * k], grad KL(pi||ref) only for k1; as a loss it is grad E[k], a KL's for k2 and k3.
KL_PLACEMENTS = {"reward": {"k1": "KL(pi||ref)"}, "loss": {"k2": "KL(pi||ref)", "k3": "KL(ref||pi)"}}
MAX_LOG_RATIO = 20.0

Count = Union[int, float, Tensor, None]


def _mean(x: Tensor, m: Tensor) -> Tensor:
    """Detached mean of x over m (bool) entries; 0 when m is empty."""
    return (torch.where(m, x.detach().float(), 0).sum() / m.sum().clamp(min=1)).detach()


def _count(n: Count, like: Tensor) -> Tensor:
    # float32 even for bf16 losses: bf16 cannot represent large token counts exactly.
    return torch.as_tensor(n, dtype=torch.float32, device=like.device).clamp(min=1)


def ppo(log_ratio: Tensor, logprobs: Tensor, A: Tensor, m: Tensor, lo: float, hi: float,
        dual_clip: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-min(r A, clip(r, lo, hi) A), r = exp(logp - old); dual_clip=c caps the loss at -c A for A < 0.
    Returns (per-token loss, ratio, clipped) [B, T]."""
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T]
    loss1 = -ratio * A
    loss2 = -ratio.clamp(lo, hi) * A
    loss = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if dual_clip is not None:
        capped = (A < 0) & (loss > -dual_clip * A)
        loss = torch.where(capped, -dual_clip * A, loss)
        clipped = clipped | capped
    return loss, ratio, clipped


def gspo(log_ratio: Tensor, logprobs: Tensor, A: Tensor, m: Tensor, lo: float, hi: float,
         dual_clip: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipping on the GSPO-token ratio sg[s_i] * exp(logp - sg[logp]), where
    s_i = exp(mean over row i's action tokens of (logp - old)): its value is s_i on every token
    of the row, its gradient per token s_i * grad logp (GSPO, Zheng et al. 2025)."""
    seq = log_ratio.detach().sum(1) / m.sum(1).clamp(min=1)  # [B] mean log-ratio per row
    lp = torch.where(m, logprobs.float(), 0)
    return ppo(seq[:, None] + lp - lp.detach(), logprobs, A, m, lo, hi, dual_clip)  # [B, T]


def cispo(log_ratio: Tensor, logprobs: Tensor, A: Tensor, m: Tensor, lo: float,
          hi: float) -> tuple[Tensor, Tensor, Tensor]:
    """-sg[clip(r, lo, hi)] * A * logp (MiniMax-M1: lo = 0, the upper bound only); the gradient
    flows only through logp, so clipped tokens keep theirs."""
    ratio = torch.exp(log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T] detached
    loss = -ratio.clamp(lo, hi) * A * torch.where(m, logprobs.float(), 0)
    return loss, ratio, (ratio < lo) | (ratio > hi)


@dataclass(frozen=True)
class Setting:
    """A flag of an estimator's or a loss's own, declared in its registry entry (ESTIMATORS, POLICY_LOSSES): main.py
    adds --NAME, main.validate checks the bounds and refuses the flag unless the chosen entry declares it, and only
    that entry's function gets it, as a keyword. Entries that declare the same name share one Setting."""
    default: Any                 # None: off unless given
    help: str
    type: type = float
    low: Optional[float] = None  # bounds, inclusive (None: unbounded)
    high: Optional[float] = None
    low_open: bool = False       # low itself excluded

    def bounds(self) -> str:
        if self.high is None:
            return "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def check(self, name: str, value: Any):
        lo, hi = self.low, self.high
        if value is not None and ((lo is not None and (value < lo or (self.low_open and value == lo)))
                                  or (hi is not None and value > hi)):
            raise ValueError(f"--{name} must be {self.bounds()}, got {value}")


def own_settings(entry: str, declared: dict[str, Setting], given: dict) -> dict:
    """`given` checked against what `entry` declares (names, bounds), defaults filled in."""
    if unknown := sorted(set(given) - set(declared)):
        raise ValueError(f"{entry} has no setting {', '.join(unknown)} (its settings: "
                         f"{', '.join(declared) or 'none'})")
    out = {k: given.get(k, s.default) for k, s in declared.items()}
    for k, s in declared.items():
        s.check(k, out[k])
    return out


DUAL_CLIP = Setting(None, "dual-clip bound c: the loss of a negative-advantage token is capped at -c A", low=1,
                    low_open=True)


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and what main.validate and the trainer need to know: defaults, settings, refusals, inputs."""
    fn: Callable[..., tuple[Tensor, Tensor, Tensor]]  # (log_ratio, logprobs, A, m, lo, hi, **settings[, batch])
    eps_clip: Optional[tuple[Optional[float], float]]  # default --eps_clip LOW HIGH (LOW None: no lower
                                                       # bound); None: no clip range, --eps_clip refused
    loss_agg: str = "token_mean"             # default --loss_agg
    no_cp: Optional[str] = None              # why --cp_size > 1 (rows split across ranks) is refused
    settings: dict[str, Setting] = field(default_factory=dict)   # its own flags
    batch_input: Optional[Callable[..., Tensor]] = None  # (old, A, m, **settings) -> [B, T]: fn's `batch` (policy_loss)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(ppo, eps_clip=(0.2, 0.2), settings={"dual_clip": DUAL_CLIP}),
    # GSPO as published: the sequence-level objective averages rows (each row's tokens
    # averaged), and its clip range is that of a geometric-mean ratio, 3e-4 / 4e-4.
    "gspo": PolicyLoss(gspo, eps_clip=(3e-4, 4e-4), loss_agg="seq_mean_token_mean",
                       no_cp="its sequence ratio needs each row whole on one rank", settings={"dual_clip": DUAL_CLIP}),
    "cispo": PolicyLoss(cispo, eps_clip=(None, 0.2)),   # no dual clip: its weight is bounded already
}


def policy_loss(kind: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                eps_low: Optional[float] = 0.2, eps_high: float = 0.2, batch: Optional[Tensor] = None,
                **settings) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy loss [B, T] (minimise it) and metrics; `kind` names an entry of POLICY_LOSSES (ppo,
    gspo, cispo: see their functions), `settings` are that entry's own (e.g. dual_clip). The ratio's band is
    [1 - eps_low, 1 + eps_high]; eps_low=None (only for a loss whose default has no lower bound) leaves the
    lower bound out. An entry's `batch_input` (e.g. tokens ranked over the whole batch) reaches its fn as `batch`:
    these rows of it computed once on the step's whole batch (the trainer's), or, not given, on these rows."""
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; choices: {tuple(POLICY_LOSSES)}")
    spec = POLICY_LOSSES[kind]
    settings = own_settings(kind, spec.settings, settings)
    if eps_low is None and spec.eps_clip and spec.eps_clip[0] is not None:
        raise ValueError(f"{kind} needs eps_low (only a loss without a default lower bound may leave it out)")
    m, A = mask.bool(), advantages.float()
    # where() before anything else so padding (even -inf logprobs) cannot leak NaN into gradients.
    log_ratio = torch.where(m, logprobs.float() - old_logprobs.float(), 0)  # [B, T]
    if spec.batch_input is not None:   # not given: these rows are the whole batch
        settings["batch"] = spec.batch_input(old_logprobs.float(), A, m, **settings) if batch is None else batch
    lo, hi = (0.0 if eps_low is None else 1.0 - eps_low), 1.0 + eps_high
    loss, ratio, clipped = spec.fn(log_ratio, logprobs, A, m, lo, hi, **settings)
    return torch.where(m, loss, 0), {
        "clip_frac": _mean(clipped.float(), m),
        "ratio_mean": _mean(ratio, m),
        # k3 estimate of KL(old || new) from samples of old, per token.
        "approx_kl": _mean(kl(old_logprobs, logprobs.detach(), "k3"), m),
    }


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: str = "token_mean",
              num_tokens: Count = None, num_seqs: Count = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar. See LOSS_AGGS.

    Pass num_tokens / num_seqs = action-token / row count of the WHOLE optimizer step (all micro-batches,
    all data-parallel ranks): then summing the gradients over micro-batches and ranks (all_reduce SUM,
    not mean) gives the same step however the batch is split. Defaults are this batch's counts."""
    m = mask.bool()
    loss = torch.where(m, per_token_loss, 0)  # [B, T]
    if mode == "token_mean":
        return loss.sum() / _count(m.sum() if num_tokens is None else num_tokens, loss)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        per_row = loss.sum(1)  # [B]
        if mode == "seq_mean_token_mean":
            per_row = per_row / m.sum(1).clamp(min=1)
        return per_row.sum() / _count(m.shape[0] if num_seqs is None else num_seqs, loss)
    raise ValueError(f"unknown loss aggregation {mode!r}; choices: {LOSS_AGGS}")


@torch.no_grad()
def is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *,
               level: str, mode: str, low: float, high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Train/rollout mismatch importance weights [B, T] (detached) and metrics; levels and modes as in the README's IS
    table (off: weights = mask). ratio = exp(old_logprobs - rollout_logprobs), trainer over sampler. is_filtered_frac:
    the share of action tokens whose weight is not their ratio (zeroed by the gate, or bounded)."""
    for name, value, choices in (("level", level, IS_LEVELS), ("mode", mode, IS_MODES)):
        if value not in choices:
            raise ValueError(f"unknown IS {name} {value!r}; choices: {choices}")
    if level in ("seq", "geo") and mode not in ("mask", "reject"):
        raise ValueError(f"IS level {level!r} gates whole sequences and needs mode 'mask' or 'reject', got {mode!r}")
    if not (0.0 <= low <= high and high > 0.0):
        raise ValueError(f"need 0 <= low <= high and high > 0, got low={low}, high={high}")
    m = mask.bool()
    log_r = torch.where(m, old_logprobs.float() - rollout_logprobs.float(), 0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_r)  # [B, T]
    if level == "off":
        w, filtered = m.float(), torch.zeros_like(ratio, dtype=torch.bool)
    elif mode == "clip":
        w, filtered = ratio.clamp(low, high), (ratio < low) | (ratio > high)
    elif mode == "trunc":
        w, filtered = ratio.clamp(max=high), ratio > high
    else:  # mask / reject: a gate on the token's, or the whole row's, ratio
        gate = log_r
        if level in ("seq", "geo"):
            gate = log_r.sum(1, keepdim=True)  # [B, 1]
            if level == "geo":
                gate = gate / m.sum(1, keepdim=True).clamp(min=1)
        # Compare in log space: a long sequence's summed log-ratio would overflow exp.
        accept = ((gate >= (math.log(low) if low > 0 else -math.inf)) & (gate <= math.log(high))).expand_as(m)
        if mode == "mask":
            # A kept row's tokens keep their own ratio, truncated at HIGH as in trunc: a row's
            # product or geometric mean can pass the band while one token's ratio is far
            # outside it. (At token level the gate already keeps every weight <= HIGH.)
            w, filtered = ratio.clamp(max=high) * accept.float(), ~accept | (ratio > high)
        else:
            w, filtered = accept.float(), ~accept
    w = torch.where(m, w, 0)
    return w, {
        "is_filtered_frac": _mean(filtered.float(), m),
        # k3 estimate of KL(rollout || trainer) with samples from the rollout policy.
        "mismatch_k3": _mean(ratio - 1 - log_r, m),
        "mismatch_abs": _mean(log_r.abs(), m),
        "is_weight_mean": _mean(w, m),
    }


def kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi. [B, T], not masked.

    k1 = logp - ref (unbiased, can be negative), k2 = 0.5 (logp - ref)^2,
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0)."""
    d = logprobs.float() - ref_logprobs.float()  # [B, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d ** 2
    if estimator == "k3":
        r = (-d).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.exp(r) - r - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; choices: {KL_ESTIMATORS}")


def entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, computed in float32: [...]."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)  # [...]
    # H = lse - sum p z; one [..., V] temporary (p) instead of a kept log_softmax copy.
    return lse - (torch.softmax(z, dim=-1) * z).sum(-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: Optional[float]) -> Tensor:
    """Per-token 0.5 * max((v - R)^2, (old_v + clamp(v - old_v, -clip, clip) - R)^2); clip=None: unclipped."""
    v, R = values.float(), returns.float()
    loss = (v - R) ** 2
    if clip is not None:
        v_clip = old_values.float() + (v - old_values.float()).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - R) ** 2)
    return torch.where(mask.bool(), 0.5 * loss, 0)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) at `tokens`, in float32: [B, T] from [B, T, V] logits.

    Matches vLLM's processed logprobs. Uses gather - logsumexp so no full log_softmax is kept."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
