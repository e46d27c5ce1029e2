"""Batch layout: trajectories -> [B, T] tensors -> each rank's micro-batches -> model inputs.

`collate` pads token-exact trajectories (never re-tokenized) into tensors aligned to the
predicted token; `split_rows` shares rows among ranks by tokens, groups kept together; `plan` is a
rank's micro-batches of one optimizer step (--micro_batch_size or --micro_batch_tokens);
`layout` is one micro-batch's inputs: padded (CP chunks), a group's prefix tree once (--share_prefix)
or packed (--packing), logits kept only where actions are; `scatter` puts the outputs back on the grid:

    python -m pytest -q tests/test_parallel.py -k "micro or pack or split or share or tree"
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


def split_rows(rows: torch.Tensor, cost: torch.Tensor, groups: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`rows` in n runs of near-equal cost, ordered by group: a group is cut only where a run ends, so a
    rank's rows of a group still share their prompt in `layout` (each run's cost <= an nth + one row's)."""
    order = torch.argsort(groups, stable=True)
    rows, cost = rows[order], cost[order].double()
    middle = cost.cumsum(0) - cost / 2
    part = (middle * n / cost.sum().clamp(min=1)).long().clamp(max=n - 1)
    return [rows[part == i] for i in range(n)]

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


def plan(cfg: dict, dims, rows: torch.Tensor, lengths: torch.Tensor, groups: torch.Tensor) -> list[torch.Tensor]:
    """This rank's micro-batches of `rows` (one optimizer step): rows split across data
    ranks by tokens, then into micro-batches; padded with empty ones to the max count."""
    parts = split_rows(rows, lengths[rows], groups[rows], dims.dp_shard)
    per_rank = [micro_batches(cfg, p, lengths) for p in parts]
    n = max(len(m) for m in per_rank)
    mine = per_rank[dims.dp_rank]
    return mine + [rows[:0]] * (n - len(mine))


def mini_batches(groups: torch.Tensor, n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """n mini-batches of whole groups (sharing a prompt in `layout`), in a random order, near-equal in rows."""
    _, of, sizes = groups.unique(return_inverse=True, return_counts=True)
    order = torch.randperm(len(sizes), generator=generator)
    if len(sizes) < n:   # too few groups: n near-equal runs of rows, by group (chunk may give fewer)
        return list(torch.argsort(order[of], stable=True).tensor_split(n))
    load, part, slots = [0] * n, torch.empty_like(sizes), torch.randperm(n, generator=generator).tolist()
    for g in order[torch.argsort(sizes[order], descending=True, stable=True)].tolist():   # largest first
        part[g] = i = min(slots, key=load.__getitem__)      # part [groups]: the mini-batch with the fewest rows
        load[i] += int(sizes[g])
    return list(torch.argsort(part[of], stable=True).split(load))


def share_pays(lengths: list[int], owned: list[int], hidden: int) -> bool:
    """Whether one row of a group's prefix tree (each row's tokens that no earlier row shares: `owned`) costs less
    than a row each: it saves sum(lengths) - sum(owned) token passes (a decoder layer's ~24 hidden^2 flops each)
    and adds attention scores (sum(owned)^2 under a dense mask against sum(lengths^2); ~4 hidden flops each)."""
    extra = sum(owned) ** 2 - sum(n * n for n in lengths)
    return (sum(lengths) - sum(owned)) * 6 * hidden > extra


def layout(batch: dict, idx: torch.Tensor, packing: bool, cp: int, cp_rank: int, replay: bool,
           share: int = 0) -> dict:
    """Model inputs (on CPU) of the rows `idx`, the columns `keep` whose logits are needed (action tokens'), and
    `where` [b, T] that puts the [b', K] outputs back on the grid (1 + flat index, 0: none). padded: [b, Tm] rows
    (Tm a multiple of cp), each CP rank a chunk. share (the hidden size; 0 = off): a group's rows make one row, their
    prefix tree, where `share_pays`: each row's span (the positions no earlier row shares) sees itself causally and
    the spans that hold its earlier positions; positions as in the row. packed: every span in one [1, N] row."""
    L, T, n_rows = batch["lengths"][idx], batch["input_ids"].shape[1], len(idx)
    cols = torch.arange(T)
    own = cols[None, :] < L[:, None]
    model_of = torch.full((n_rows, T), -1)                                    # grid cell -> flat model position
    inp = {}
    if not (packing or share):
        Tm = -(-int(L.max()) // cp) * cp
        c0, c1 = cp_rank * Tm // cp, (cp_rank + 1) * Tm // cp
        n = c1 - c0
        src_r, src_t = torch.arange(n_rows)[:, None].expand(-1, n), torch.arange(c0, c1)[None].expand(n_rows, -1)
        model_of[:, c0:c1] = torch.arange(n_rows * n).view(n_rows, n)
        own &= (cols >= c0) & (cols < c1)
        if cp > 1:
            inp["position_ids"] = src_t
    else:
        owner = torch.arange(n_rows)[:, None].repeat(1, T)   # [b, T]: the row whose span [start, L) holds row j's t
        start, groups = torch.zeros(n_rows, dtype=torch.long), batch["groups"][idx]
        for g in groups.unique() if share else []:
            js = (groups == g).nonzero()[:, 0]
            ids, tgt, ok = batch["input_ids"][idx[js]], batch["targets"][idx[js]], own[js]
            # rows j, k share position t iff their input ids through t and target t agree: lcp [g, g] positions
            eq = (ids[:, None] == ids[None]) & (tgt[:, None] == tgt[None]) & ok[:, None] & ok[None]   # [g, g, T]
            lcp = torch.nn.functional.pad(~eq, (0, 1), value=True).byte().argmax(-1)   # the first t not shared
            shared = lcp.tril(-1).amax(1)                                      # row j's positions an earlier row has
            if share_pays(L[js].tolist(), (L[js] - shared).tolist(), share):
                first = (lcp[:, :, None] > cols).byte().argmax(1)              # [g, T]: the first row sharing t
                owner[js], start[js] = torch.where(own[js], js[first], -1), shared
        tree = owner[:, 0].tolist()                                            # a tree: the rows sharing position 0
        rows = [[j for j in range(n_rows) if tree[j] == r] for r in dict.fromkeys(tree)]
        rows = [sum(rows, [])] if packing else rows                           # a model row per tree, or one row
        n = max(int((L[js] - start[js]).sum()) for js in rows)
        src_r, src_t = torch.zeros(len(rows), n, dtype=torch.long), torch.zeros(len(rows), n, dtype=torch.long)
        for r, js in enumerate(rows):
            c = r * n
            for j, t0, t1 in zip(js, start[js].tolist(), L[js].tolist()):
                src_r.view(-1)[c:c + t1 - t0], src_t.view(-1)[c:c + t1 - t0] = j, torch.arange(t0, t1)
                model_of[j, t0:t1] = torch.arange(c, c + t1 - t0)
                c += t1 - t0
        model_of = torch.where(own, model_of[owner, cols], -1)                 # a shared cell: its owner's position
        # causal, and only where the key is the query's row's own token there (padding: row 0's position 0)
        sees = owner[:, src_t] == src_r                                        # [b, R, n]: for a query of row j
        see = sees.transpose(0, 1)[torch.arange(len(rows))[:, None], src_r]    # [R, n, n]
        inp.update(position_ids=src_t, attention_mask=(see & torch.ones(n, n, dtype=torch.bool).tril())[:, None])
    need = own & (batch["mask"][idx] > 0) & (model_of >= 0)
    keep = (model_of[need] % n).unique()
    keep = keep if len(keep) else torch.tensor([0])                           # an empty micro-batch: one column
    col = torch.full((n,), -1)
    col[keep] = torch.arange(len(keep))
    flat = (model_of // n) * len(keep) + col[model_of % n]
    where = torch.where((model_of >= 0) & (col[model_of % n] >= 0) & own, flat + 1, 0)
    rows_g = idx[src_r]
    inp["input_ids"] = batch["input_ids"][rows_g, src_t]
    routing = batch.get("routing") if replay else None
    return {"inputs": inp, "targets": batch["targets"][rows_g, src_t][:, keep], "where": where, "own": own,
            "keep": keep, "replay": routing[rows_g, src_t].flatten(0, 1) if routing is not None else None}


def scatter(v: torch.Tensor, x: dict, device) -> torch.Tensor:
    """Differentiable gather of a micro-batch's outputs [b', K] onto the [b, T] grid of its rows (zeros
    elsewhere; a shared position's value goes to every row that shares it)."""
    flat = torch.cat([torch.zeros(1, dtype=v.dtype, device=v.device), v.flatten()])
    return flat[x["where"].to(device)]
