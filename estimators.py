"""Advantage estimators: one scalar reward per row -> per-token advantages and returns.

Every estimator is a function

    advantages, returns = fn(rewards, mask, groups, *, <the inputs it uses>, <its own settings>)

rewards [B]; mask [B, T] (1 on the policy's own action tokens, gaps allowed for multi-turn observations);
groups [B] (rows of one prompt share an id). The trainer offers every input below, and a function gets only the
ones its signature names (`Spec.__call__`), so a new input reaches a new estimator without touching the others:
rollout_ids [B] (segments of one rollout share an id and a reward, and group baselines count each rollout once);
kl [B, T] = log pi - log pi_ref and kl_coef (KL-in-reward, or a teacher's KL); values [B, T] critic values. Its
own settings (gamma, lam, ...) are declared in its entry (`Spec.settings`, a `losses.Setting` each): main.py
makes them flags, and only the estimators that declare them get them. Both outputs are float32 [B, T], zero off
the mask. Token-level recursions (discounting, GAE) run per row over action tokens only: non-action tokens are
transparent. A segment is treated as its own trajectory whose reward sits on its last action token.

To add an estimator: AGENTS.md, "Add an estimator" (a function and its `Spec` in ESTIMATORS).

Test: python -m pytest -q tests/test_estimators.py
"""

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from losses import Setting, own_settings

OptT = Optional[Tensor]
Pair = tuple[Tensor, Tensor]  # (advantages [B, T], returns [B, T])


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over entries where mask == 1 (population std); 0 elsewhere."""
    m = mask.bool()
    n = m.sum().clamp(min=1)
    mean = torch.where(m, x, 0).sum() / n
    var = torch.where(m, (x - mean) ** 2, 0).sum() / n
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), 0)


def group_stats(rewards: Tensor, groups: Tensor, rollout_ids: OptT = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: (mean, population std, count) of its group, counting each rollout once."""
    rewards = rewards.float()
    if rollout_ids is None:
        r, g, inv = rewards, groups, torch.arange(len(rewards), device=rewards.device)
    else:
        # A rollout is (group, rollout id), so ids only need to be unique within a group.
        keys, inv = torch.unique(torch.stack([groups, rollout_ids], 1), dim=0, return_inverse=True)
        r = torch.zeros(len(keys), device=rewards.device).scatter_(0, inv, rewards)  # [R]
        g = keys[:, 0]
        if not torch.allclose(r[inv], rewards):
            raise ValueError("rows sharing a rollout id (within a group) must share the same reward")
    _, gi = torch.unique(g, return_inverse=True)  # [R] dense group index
    n = torch.bincount(gi).float()  # [G]
    mean = torch.zeros_like(n).index_add_(0, gi, r) / n
    var = torch.zeros_like(n).index_add_(0, gi, (r - mean[gi]) ** 2) / n
    return mean[gi][inv], var.sqrt()[gi][inv], n[gi][inv]


def _token_rewards(name: str, seq_reward: Tensor, mask: Tensor, kl: OptT, kl_coef: float) -> Tensor:
    """Sequence reward on the last action token plus -kl_coef * kl on every action token. [B, T]"""
    if kl_coef != 0.0 and kl is None:
        raise ValueError(f"{name}: kl_coef={kl_coef} needs kl (log pi - log pi_ref), got kl=None")
    m = mask.bool()
    last = m.shape[1] - 1 - m.flip(1).int().argmax(1)  # [B] each row's last action token (none: masked below)
    r = torch.zeros(m.shape, device=m.device).scatter_(1, last[:, None], seq_reward.float()[:, None]) * m
    if kl_coef != 0.0:
        r = r - kl_coef * torch.where(mask.bool(), kl.float(), 0)
    return r


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over action tokens; other tokens carry G unchanged."""
    m = mask.bool()
    r = torch.where(m, token_rewards, 0)
    if gamma == 1.0:  # plain reverse cumsum, no Python loop
        return torch.where(m, r.flip(1).cumsum(1).flip(1), 0)
    out, run = torch.zeros_like(r), torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        run = torch.where(m[:, t], r[:, t] + gamma * run, run)
        out[:, t] = run
    return torch.where(m, out, 0)


def _broadcast(per_row: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    adv = torch.where(mask.bool(), per_row.float()[:, None], 0)  # [B, T]
    return adv, adv.clone()


def reinforce(rewards: Tensor, mask: Tensor, groups: Tensor, *,
              kl: OptT = None, kl_coef: float = 0.0, gamma: float = 1.0) -> Pair:
    """Discounted return of reward (+ KL-in-reward), no baseline; advantages = returns."""
    ret = _discounted_returns(_token_rewards("reinforce", rewards, mask, kl, kl_coef), mask, gamma)
    return ret, ret.clone()


def reinforce_pp(rewards: Tensor, mask: Tensor, groups: Tensor, *,
                 kl: OptT = None, kl_coef: float = 0.0, gamma: float = 1.0) -> Pair:
    """REINFORCE++: discounted return of reward + KL-in-reward, whitened over the batch's action tokens."""
    ret = _discounted_returns(_token_rewards("reinforce_pp", rewards, mask, kl, kl_coef), mask, gamma)
    return whiten(ret, mask), ret


def reinforce_pp_baseline(rewards: Tensor, mask: Tensor, groups: Tensor, *,
                          rollout_ids: OptT = None, kl: OptT = None, kl_coef: float = 0.0, gamma: float = 1.0) -> Pair:
    """REINFORCE++ with the group mean (per rollout) subtracted from the reward before returns and whitening."""
    mean, _, _ = group_stats(rewards, groups, rollout_ids)
    r = _token_rewards("reinforce_pp_baseline", rewards.float() - mean, mask, kl, kl_coef)  # [B, T]
    ret = _discounted_returns(r, mask, gamma)
    return whiten(ret, mask), ret


def rloo(rewards: Tensor, mask: Tensor, groups: Tensor, *, rollout_ids: OptT = None) -> Pair:
    """Reward minus the mean of the other rollouts of its group; 0 for a group of one rollout."""
    mean, _, n = group_stats(rewards, groups, rollout_ids)
    # r - (n*mean - r)/(n-1) == n/(n-1) * (r - mean)
    adv = torch.where(n > 1, n / (n - 1).clamp(min=1) * (rewards.float() - mean), 0)
    return _broadcast(adv, mask)


def grpo(rewards: Tensor, mask: Tensor, groups: Tensor, *, rollout_ids: OptT = None) -> Pair:
    """(reward - group mean) / (group std + 1e-6), population std (unbiased=False), per rollout."""
    mean, std, _ = group_stats(rewards, groups, rollout_ids)
    return _broadcast((rewards.float() - mean) / (std + 1e-6), mask)


def dr_grpo(rewards: Tensor, mask: Tensor, groups: Tensor, *, rollout_ids: OptT = None) -> Pair:
    """Dr. GRPO: reward - group mean (per rollout), no std normalisation."""
    mean, _, _ = group_stats(rewards, groups, rollout_ids)
    return _broadcast(rewards.float() - mean, mask)


def gae(rewards: Tensor, mask: Tensor, groups: Tensor, *,
        values: OptT = None, kl: OptT = None, kl_coef: float = 0.0, gamma: float = 1.0, lam: float = 1.0) -> Pair:
    """GAE(gamma, lam) over action tokens only, V after the last action = 0; returns = A + V. No whitening."""
    if values is None:
        raise ValueError("gae needs critic values, got values=None")
    m = mask.bool()
    r = _token_rewards("gae", rewards, mask, kl, kl_coef)  # [B, T]
    v = torch.where(m, values.float(), 0)  # [B, T]
    adv = torch.zeros_like(r)
    next_v, next_a = torch.zeros_like(r[:, 0]), torch.zeros_like(r[:, 0])  # [B]
    for t in reversed(range(r.shape[1])):
        # Non-action tokens keep next_v / next_a, so the recursion skips observations.
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        next_a = torch.where(m[:, t], a, next_a)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        adv[:, t] = next_a
    adv = torch.where(m, adv, 0)
    return adv, torch.where(m, adv + v, 0)


def on_policy_distill(rewards: Tensor, mask: Tensor, groups: Tensor, *, kl: OptT = None, kl_coef: float = 0.0) -> Pair:
    """Per-token advantage -kl_coef * (log pi_student - log pi_teacher); reward ignored."""
    if kl is None:
        raise ValueError("on_policy_distill needs kl = student - teacher logprobs, got kl=None")
    if kl_coef <= 0.0:
        raise ValueError(f"on_policy_distill needs kl_coef > 0 (got {kl_coef}); advantages would be all zero")
    adv = torch.where(mask.bool(), -kl_coef * kl.float(), 0)
    return adv, adv.clone()


# ---------------------------------------------------------------- per-turn credit (inputs: batches.turn_batch)

def _turn_view(rewards: Tensor, mask: Tensor, turns: OptT, turn_rewards: OptT, gamma: float) -> tuple[Tensor, ...]:
    """(turn of each token [B, T], G [B, K] the return from each turn, valid [B, K]). Without `turns` each run of
    action tokens is a turn; without `turn_rewards` the reward sits on the last turn."""
    m = mask.bool()
    if turns is None:
        starts = m & ~torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], 1)   # first token of each run
        turns = starts.long().cumsum(1) - 1                                    # [B, T]
    n = turns.max(1).values + 1                                                # [B] turns per row
    if turn_rewards is None:
        turn_rewards = torch.zeros(len(n), max(int(n.max()), 1), device=mask.device).scatter_(
            1, (n - 1).clamp(min=0)[:, None], (rewards.float() * (n > 0))[:, None])
    valid = torch.arange(turn_rewards.shape[1], device=mask.device) < n[:, None]
    R = turn_rewards.float()
    return turns.clamp(min=0), _discounted_returns(R, torch.ones_like(R), gamma), valid


def _on_tokens(x: Tensor, turns: Tensor, mask: Tensor) -> Tensor:
    """[B, K] per turn -> [B, T] on each action token of the turn."""
    return torch.where(mask.bool(), x.gather(1, turns), 0)


def _keyed_stats(x: Tensor, groups: Tensor, keys: OptT, valid: Tensor) -> list[Tensor]:
    """(mean, std, count) [B, K] of x over valid turns of one (group, key); no keys: only turn 0 is shared."""
    B, K = x.shape
    if keys is None:
        k = torch.arange(K, device=x.device)
        keys = torch.where(k == 0, 0, 1 + torch.arange(B, device=x.device)[:, None] * K + k)
    g = groups[:, None].expand(B, K)
    _, kid = torch.unique(torch.stack([g[valid], keys[valid]], 1), dim=0, return_inverse=True)
    return [torch.zeros_like(x).masked_scatter(valid, s) for s in group_stats(x[valid], kid)]


def turn_reinforce(rewards: Tensor, mask: Tensor, groups: Tensor, *,
                   turns: OptT = None, turn_rewards: OptT = None, turn_gamma: float = 1.0) -> Pair:
    """REINFORCE++ with per-turn returns: G_k = sum_{j>=k} turn_gamma^(j-k) r_j over the rollout's turn rewards,
    minus the mean G_k of its group's rollouts that have a turn k, whitened over the batch's action tokens."""
    tok, G, valid = _turn_view(rewards, mask, turns, turn_rewards, turn_gamma)
    mean, _, _ = _keyed_stats(G, groups, torch.arange(G.shape[1], device=G.device).expand_as(G), valid)
    return whiten(_on_tokens(G - mean, tok, mask), mask), _on_tokens(G, tok, mask)


def gigpo(rewards: Tensor, mask: Tensor, groups: Tensor, *, rollout_ids: OptT = None, turns: OptT = None,
          turn_rewards: OptT = None, states: OptT = None, turn_gamma: float = 1.0, step_weight: float = 1.0) -> Pair:
    """GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training"), F_norm = std:
        episode level  A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / std_j R(tau_j)   over the group's rollouts
        step level     R_t^(i) = sum_{k>=t} gamma^(k-t) r_k^(i)    (gamma: --turn_gamma)
                       G^S(s) = {(a_t^(i), R_t^(i)) : s_t^(i) = s}  the group's turns from the anchor state s
                       A^S(a_t^(i)) = (R_t^(i) - mean G^S(s)) / std G^S(s)
        combined       A(a_t^(i)) = A^E(tau_i) + omega * A^S(a_t^(i))   (omega: --step_weight), on every token of
    turn t. s_t is `states` (Result.state_key of the step before, else the observation; turn 0: the prompt); a
    state only one turn starts from gives A^S = 0. std + 1e-6 as in grpo."""
    tok, G, valid = _turn_view(rewards, mask, turns, turn_rewards, turn_gamma)
    s_mean, s_std, _ = _keyed_stats(G, groups, states, valid)
    step = _on_tokens((G - s_mean) / (s_std + 1e-6), tok, mask)               # [B, T]
    return grpo(rewards, mask, groups, rollout_ids=rollout_ids)[0] + step_weight * step, _on_tokens(G, tok, mask)


def branch_value(rewards: Tensor, mask: Tensor, groups: Tensor, *, rollout_ids: OptT = None, turns: OptT = None,
                 turn_rewards: OptT = None, nodes: OptT = None) -> Pair:
    """Monte-Carlo values from branched rollouts (--branches; VinePPO's idea, Kazemnejad et al., 2024): V(s) = the
    mean return of the rows through node s (the same tokens before the turn). The turns from one branch point a
    (a node whose rows go on to different nodes or end) to the next c share the value change they made:
    A = r_a + ... + r_{c-1} + V(s_c) - V(s_a) (V = 0 at the end), / the group's reward std. No branches: grpo."""
    tok, G, valid = _turn_view(rewards, mask, turns, turn_rewards, 1.0)
    (B, K), pad = G.shape, torch.zeros(len(G), 1, device=G.device)
    V, _, n = _keyed_stats(G, groups, nodes, valid)
    G, V, k = torch.cat([G, pad], 1), torch.cat([V, pad], 1), torch.arange(K, device=G.device).expand(B, K)  # 0: end
    n_next = torch.cat([n[:, 1:], pad], 1).clamp(min=1)                         # rows through the next node
    start = valid & ((k == 0) | (n > n_next))                                   # turn 0 and branch points
    a = torch.where(start, k, 0).cummax(1).values                              # [B, K] its span's first turn
    after = torch.cat([torch.where(start, k, K)[:, 1:], pad.long() + K], 1).flip(1).cummin(1).values.flip(1)
    c = torch.minimum(after, valid.sum(1, keepdim=True))                        # [B, K] the next span's first
    adv = G.gather(1, a) - G.gather(1, c) + V.gather(1, c) - V.gather(1, a)
    _, std, _ = group_stats(rewards, groups, rollout_ids)
    return _on_tokens(adv / (std[:, None] + 1e-6), tok, mask), _on_tokens(G[:, :K], tok, mask)


@dataclass(frozen=True)
class Spec:
    """An estimator and what the rest of the code needs to know about it (main.validate refuses flags by these,
    the trainer builds a critic or a teacher by them). Calling a Spec calls its function with the inputs it names
    and its own settings (defaults filled, bounds checked)."""
    fn: Callable[..., Pair]
    min_group: int = 1                     # the smallest group it gives a signal for: --samples_per_prompt >= it
    no_kl_in_reward: Optional[str] = None  # why a KL penalty in the reward is refused (it takes no kl_coef)
    critic: bool = False                   # needs critic values: a value model is trained (--critic_*)
    teacher: bool = False                  # the advantage is -kl_coef * (log pi - log pi_teacher): needs
                                           # --ref_model and --kl_coef > 0, and takes no other KL term
    settings: dict[str, Setting] = field(default_factory=dict)   # its own flags (losses.Setting)

    def __call__(self, rewards: Tensor, mask: Tensor, groups: Tensor, settings: Optional[dict] = None,
                 **inputs) -> Pair:
        takes = inspect.signature(self.fn).parameters
        if unknown := sorted(set(inputs) - set(INPUTS)):
            raise ValueError(f"{', '.join(unknown)}: not an estimator input ({', '.join(INPUTS)}); settings go in "
                             "settings=")
        if inputs.get("kl_coef", 0.0) != 0.0 and "kl_coef" not in takes:  # refuse rather than silently drop it
            raise ValueError(f"{self.fn.__name__} does not support KL-in-reward (kl_coef={inputs['kl_coef']}): it "
                             f"{self.no_kl_in_reward}; use a KL loss term instead")
        own = own_settings(self.fn.__name__, self.settings, settings or {})
        return self.fn(rewards, mask, groups, **{k: v for k, v in inputs.items() if k in takes}, **own)


# What the trainer offers every estimator (Trainer.train_step); each function takes the ones it names.
INPUTS = ("rollout_ids", "kl", "kl_coef", "values", "turns", "turn_rewards", "states", "nodes")
GAMMA = Setting(1.0, "discount over action tokens", low=0, high=1)
TURN_GAMMA = Setting(1.0, "discount across turns (per-turn returns)", low=0, high=1)
_GROUP_NORMALIZED = "normalizes a sequence reward within its group"
ESTIMATORS: dict[str, Spec] = {
    "reinforce": Spec(reinforce, settings={"gamma": GAMMA}),
    "reinforce_pp": Spec(reinforce_pp, settings={"gamma": GAMMA}),
    "reinforce_pp_baseline": Spec(reinforce_pp_baseline, min_group=2, settings={"gamma": GAMMA}),
    "rloo": Spec(rloo, min_group=2, no_kl_in_reward=_GROUP_NORMALIZED),
    "grpo": Spec(grpo, min_group=2, no_kl_in_reward=_GROUP_NORMALIZED),
    "dr_grpo": Spec(dr_grpo, min_group=2, no_kl_in_reward=_GROUP_NORMALIZED),
    "gae": Spec(gae, critic=True, settings={"gamma": GAMMA, "lam": Setting(1.0, "GAE lambda", low=0, high=1)}),
    "on_policy_distill": Spec(on_policy_distill, teacher=True),
    "turn_reinforce": Spec(turn_reinforce, min_group=2, no_kl_in_reward="takes per-turn rewards only",
                           settings={"turn_gamma": TURN_GAMMA}),
    "gigpo": Spec(gigpo, min_group=2, no_kl_in_reward=_GROUP_NORMALIZED, settings={
        "turn_gamma": TURN_GAMMA, "step_weight": Setting(1.0, "weight of the step-level advantage", low=0)}),
    "branch_value": Spec(branch_value, min_group=2, no_kl_in_reward=_GROUP_NORMALIZED),
}
