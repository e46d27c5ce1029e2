"""Batch layout: trajectories -> [B, T] tensors -> each rank's micro-batches -> model inputs.

`collate` pads token-exact trajectories (never re-tokenized) into tensors aligned to the
predicted token; `split_rows` shares rows among ranks by tokens; `plan` is a
rank's micro-batches of one optimizer step (--micro_batch_size or --micro_batch_tokens);
`layout` is one micro-batch's inputs, padded (CP chunks) or packed (--packing); `scatter` puts
a micro-batch's outputs back on the [B, T] grid, differentiably. Pure functions of tensors:

    python -m pytest -q tests/test_parallel.py -k "micro or pack or split"
"""

import torch

def collate(trajectories: list[dict], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad trajectories; every [B, T] tensor is aligned to *predicted* tokens: position t holds
    token t+1 and what is known about it. T is rounded up to a multiple of `multiple` (the CP degree).
    An optional "routing" field ([len(tokens)][layers][k] expert ids recorded at sampling) becomes
    "routing" [B, T, layers, k], aligned to the input positions."""
    T = -(-(max(len(t["tokens"]) for t in trajectories) - 1) // multiple) * multiple + 1

    def pad(key, value, dtype):
        return torch.tensor([t[key] + [value] * (T - len(t[key])) for t in trajectories], dtype=dtype)

    tokens = pad("tokens", pad_id, torch.long)                # [B, T+1]
    batch = {
        "input_ids": tokens[:, :-1],                          # [B, T]
        "targets": tokens[:, 1:],                             # [B, T]
        "lengths": torch.tensor([len(t["tokens"]) - 1 for t in trajectories]),  # [B] real positions
        "mask": pad("mask", 0, torch.float32)[:, 1:],         # [B, T] 1 = sampled by the policy
        "rollout_logprobs": pad("logprobs", 0.0, torch.float32)[:, 1:],
        "versions": pad("versions", -1, torch.long)[:, 1:],
        "rewards": torch.tensor([t["reward"] for t in trajectories], dtype=torch.float32),
        "groups": torch.tensor([t["group"] for t in trajectories], dtype=torch.long),
        "rollout_ids": torch.tensor([t["rollout_id"] for t in trajectories], dtype=torch.long),
    }
    if all(len(t.get("turns", ())) == len(t["tokens"]) and len(t.get("turn_rewards", ())) == t["turns"][-1] + 1
           for t in trajectories):
        batch.update(turn_batch(trajectories, T))
    if any(t.get("images") for t in trajectories):              # a VLM's rows: images in pad order
        batch["images"] = [list(t.get("images") or []) for t in trajectories]
    if all(t.get("routing") is not None for t in trajectories):
        L, k = len(trajectories[0]["routing"][0]), len(trajectories[0]["routing"][0][0])
        routing = torch.zeros(len(trajectories), T, L, k, dtype=torch.long)   # [B, T, layers, k]
        for i, t in enumerate(trajectories):
            r = torch.tensor(t["routing"], dtype=torch.long)[:T]
            routing[i, :len(r)] = r
        batch["routing"] = routing
    return batch


def turn_batch(trajectories: list[dict], T: int) -> dict[str, torch.Tensor]:
    """Per-turn credit (estimators.INPUTS): "turns" [B, T] each predicted token's turn (-1: padding),
    "turn_rewards" [B, K]; ids [B, K] (-1 past a row's end) of "nodes", (group, tokens before the turn: branches
    share their prefix's), and, if every row has them, of "states", (group, Result.state_key or observation)."""
    K, ids = max(len(t["turn_rewards"]) for t in trajectories), {}

    def key_ids(keys: list) -> list[int]:
        return [ids.setdefault(k, len(ids)) for k in keys] + [-1] * (K - len(keys))
    out = {"turns": torch.tensor([t["turns"][1:] + [-1] * (T - len(t["turns"])) for t in trajectories]),
           "turn_rewards": torch.tensor([t["turn_rewards"] + [0.0] * (K - len(t["turn_rewards"]))
                                         for t in trajectories], dtype=torch.float32),
           "nodes": torch.tensor([key_ids([(t["group"], hash(tuple(t["tokens"][:t["turns"].index(k)])))
                                           for k in range(len(t["turn_rewards"]))]) for t in trajectories])}
    if all(t.get("states") for t in trajectories):
        out["states"] = torch.tensor([key_ids([(t["group"], "state", s) for s in t["states"][:len(t["turn_rewards"])]])
                                      for t in trajectories])
    return out


def split_rows(rows: torch.Tensor, cost: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Greedy split of `rows` into n parts of near-equal cost (largest first); order kept inside."""
    parts: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for j in sorted(range(len(rows)), key=lambda j: -int(cost[j])):
        i = loads.index(min(loads))
        parts[i].append(j)
        loads[i] += int(cost[j])
    return [rows[sorted(p)] for p in parts]

def micro_batches(cfg: dict, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Split rows into micro-batches by --micro_batch_tokens (tokens in the compute:
    packed = sum of lengths, padded = rows x longest) or else --micro_batch_size rows."""
    budget = cfg.get("micro_batch_tokens")
    if not budget:
        return list(rows.split(cfg["micro_batch_size"]))
    out, cur = [], []
    for r in rows.tolist():
        nxt = cur + [r]
        cost = (sum(int(lengths[i]) for i in nxt) if cfg.get("packing")
                else len(nxt) * max(int(lengths[i]) for i in nxt))
        if cur and cost > budget:
            out.append(torch.tensor(cur))
            nxt = [r]
        cur = nxt
    return out + ([torch.tensor(cur)] if cur else [])


def plan(cfg: dict, dims, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """This rank's micro-batches of `rows` (one optimizer step): rows split across data
    ranks by tokens, then into micro-batches; padded with empty ones to the max count."""
    parts = split_rows(rows, lengths[rows], dims.dp_shard)
    per_rank = [micro_batches(cfg, p, lengths) for p in parts]
    n = max(len(m) for m in per_rank)
    mine = per_rank[dims.dp_rank]
    return mine + [rows[:0]] * (n - len(mine))


def layout(batch: dict, idx: torch.Tensor, packing: bool, cp: int, cp_rank: int, replay: bool) -> dict:
    """Model inputs (on CPU) of the rows `idx` and how to put outputs back on the [b, T] grid.

    padded: [b, Tm] rows (Tm = longest row, a multiple of cp), each CP rank takes one
    contiguous chunk of positions. packed: one [1, N] row, position ids reset per sample
    and a block-diagonal causal mask (no attention across samples, no padding)."""
    L, T = batch["lengths"][idx], batch["input_ids"].shape[1]
    routing = batch.get("routing") if replay else None
    cols = torch.arange(T)
    if packing:
        r = torch.arange(len(idx)).repeat_interleave(L)                        # [N] row of each token
        pos = torch.cat([torch.arange(int(l)) for l in L])                     # [N] reset per sample
        rows_g, grid = idx[r], (r, pos)                                        # grid: where outputs go
        seg_same = r[:, None] == r[None, :]
        attn = (seg_same & torch.ones(len(r), len(r), dtype=torch.bool).tril())[None, None]  # [1, 1, N, N]
        inp = {"input_ids": batch["input_ids"][rows_g, pos][None], "position_ids": pos[None], "attention_mask": attn}
        tgt = batch["targets"][rows_g, pos][None]                              # [1, N]
        rep = routing[rows_g, pos] if routing is not None else None            # [N, layers, k]
        own = cols[None, :] < L[:, None]
    else:
        Tm = -(-int(L.max()) // cp) * cp
        c0, c1 = cp_rank * Tm // cp, (cp_rank + 1) * Tm // cp
        grid = (slice(None), slice(c0, c1))
        inp = {"input_ids": batch["input_ids"][idx, c0:c1]}
        if cp > 1:
            inp["position_ids"] = torch.arange(c0, c1)[None].expand(len(idx), -1)
        tgt = batch["targets"][idx, c0:c1]
        rep = routing[idx, c0:c1].flatten(0, 1) if routing is not None else None
        own = (cols[None, :] < L[:, None]) & (cols >= c0) & (cols < c1)

    def unpack(x):                                                             # [1, N] or [b, c1-c0] -> [b, T]
        out = torch.zeros(len(idx), T, dtype=x.dtype)
        out[grid] = (x[0] if packing else x).cpu()
        return out
    return {"inputs": inp, "targets": tgt, "unpack": unpack, "own": own, "replay": rep}


def scatter(v: torch.Tensor, x: dict, device) -> torch.Tensor:
    """Differentiable put of a micro-batch output ([b, n] padded chunk or [1, N] packed) on
    the [b, T] grid of its rows (zeros elsewhere)."""
    probe = x["unpack"](torch.arange(1, v.numel() + 1, dtype=torch.long).view_as(v))  # where each value goes
    where = probe.to(device).flatten()
    flat = torch.cat([torch.zeros(1, dtype=v.dtype, device=v.device), v.flatten()])
    return flat[where].view(probe.shape)
