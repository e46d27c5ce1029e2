"""--lora_rank: peft adapters trained under FSDP2, the base as the KL reference, the live adapter in a real
vLLM engine through both sync paths (and partial rollout), checkpoints and both exports."""

import asyncio

import pytest
import torch

from fakes import tokens_out, trainer_logprobs
from generator import Generator
from test_algorithms import _trajectories
from test_engine import TEMPERATURE, _check_two_versions, _gap, _sample, trainer_cfg
from trainer import Trainer

import lora

LORA = {"lora_rank": 8, "lora_alpha": 32}


def _named(model, adapter: bool) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if (".lora_" in n) == adapter}


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model):
    t = Trainer(trainer_cfg(tiny_model, kl_coef=0.5, kl_loss=True, **LORA))
    optimized = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in t.model.named_parameters() if id(p) in optimized}
    assert names and all(".lora_" in n for n in names)
    assert len(names) == 2 * 7 * 2   # A and B of the 7 default targets in both layers
    assert isinstance(t.ref, lora.BaseView)
    base, adapter = _named(t.model, False), _named(t.model, True)
    plain = Trainer(trainer_cfg(tiny_model))    # the same initial weights, no adapter
    trajs = _trajectories()
    for _ in range(2):
        t.train_step(trajs)
    assert all(torch.equal(v, base[k]) for k, v in _named(t.model, False).items())
    assert any(not torch.equal(v, adapter[k]) for k, v in _named(t.model, True).items())
    import batches
    batch = batches.collate(trajs, t.pad_id, 1)
    scored, want = t._score(batch), plain._score(batch)["old"]
    assert torch.allclose(scored["ref"], want, atol=1e-6)          # adapters off: the base
    assert not torch.allclose(scored["old"], want, atol=1e-3)      # adapters on: trained away from it
    for k, v in _named(t.model, True).items():   # adapters_off leaves them trainable
        assert t.model.get_parameter(k).requires_grad


def test_checkpoint_restores_adapter_and_optimizer_without_the_base(tiny_model, tmp_path):
    import torch.distributed.checkpoint as dcp
    t = Trainer(trainer_cfg(tiny_model, **LORA))
    trajs = _trajectories()
    t.train_step(trajs)
    t.save_checkpoint(str(tmp_path / "ckpt"))
    saved = _named(t.model, True)
    saved_opt = {k: v["exp_avg"].clone() for k, v in t.optimizer.state_dict()["state"].items()}
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert any(".lora_" in k for k in keys) and not any("base_layer" in k or "embed_tokens" in k for k in keys)
    t.train_step(trajs)
    assert t.load_checkpoint(str(tmp_path / "ckpt")) == 1
    assert all(torch.equal(v, saved[k]) for k, v in _named(t.model, True).items())
    assert all(torch.equal(v["exp_avg"], saved_opt[k]) for k, v in t.optimizer.state_dict()["state"].items())


def test_flags_are_checked(tiny_model):
    for bad, why in (({"lora_alpha": 16}, "need --lora_rank"), ({"lora_rank": 1000}, "lora_rank must be <="),
                     ({"lora_rank": 8, "tp_size": 2, "train_workers": 2}, "--tp_size, --cp_size"),
                     ({"lora_rank": -1}, "must be >= 0"),
                     ({"lora_rank": 8, "lora_targets": ["q_proj", "qproj"]}, "targets qproj: not a linear layer"),
                     ({"lora_rank": 8, "lora_targets": ["lm_head"]}, "targets lm_head: .* choose from down_proj"),
                     ({"lora_rank": 8, "lora_targets": ["embed_tokens"]}, "targets embed_tokens")):
        with pytest.raises(ValueError, match=why):
            trainer_cfg(tiny_model, **bad)
    trainer_cfg(tiny_model, lora_rank=8, lora_targets=["q_proj", "down_proj"])   # real names pass


@pytest.fixture(scope="module")
def lora_engine(tiny_model, loop):
    async def make():
        return Generator(tiny_model, max_len=512, seed=0, adapter=lora.peft_config(trainer_cfg(tiny_model, **LORA)))
    gen = loop.run_until_complete(make())
    yield gen
    gen.shutdown()


def test_grouped_cpu_ops_equal_vllms_per_token_ops():
    """lora.use_grouped_cpu_ops replaces vLLM's CPU LoRA ops in the engine: same outputs for one adapter and
    for a mix (with -1, which those ops read as the last slot), scaling and add/assign kept."""
    import importlib
    from vllm.lora.ops.torch_ops import lora_ops
    vllm_ops = importlib.reload(lora_ops)   # vLLM's own, even if this process swapped them
    g = torch.Generator().manual_seed(0)
    for idx in (torch.zeros(7, dtype=torch.long), torch.tensor([0, 2, 1, 0, -1, 2, 0])):
        x, h = torch.randn(7, 12, generator=g), torch.randn(7, 4, generator=g)
        a, b = torch.randn(3, 1, 4, 12, generator=g), torch.randn(3, 1, 10, 4, generator=g)
        ours, theirs = torch.zeros(7, 4), torch.zeros(7, 4)
        lora._shrink(x, a, ours, idx, 0.5)
        vllm_ops.bgmv_shrink(x, a, theirs, idx, 0.5)
        torch.testing.assert_close(ours, theirs)
        for add in (True, False):
            ours = torch.randn(7, 30, generator=g)
            theirs = ours.clone()
            lora._expand_slice(h, b, ours, idx, 5, 10, add)
            vllm_ops.bgmv_expand_slice(h, b, theirs, idx, 5, 10, add)
            torch.testing.assert_close(ours, theirs)
    lora.use_grouped_cpu_ops()
    ours = torch.randn(7, 10, generator=g)
    theirs = ours.clone()
    lora_ops.bgmv_expand(h, b, ours, idx, True)           # the swapped-in op
    importlib.reload(lora_ops).bgmv_expand(h, b, theirs, idx, True)   # vLLM's again
    torch.testing.assert_close(ours, theirs)


def test_the_engine_samples_from_the_synced_adapter(lora_engine, loop, tiny_model, tiny_tokenizer):
    """Ray path: adapter-only blob; after a step the engine is stale, after the sync it matches the trainer."""
    import safetensors.torch
    t = Trainer(trainer_cfg(tiny_model, **LORA))
    loop.run_until_complete(lora_engine.update_weights(t.weights_blob(), 0))   # as launch does at start-up
    trajs = _sample(lora_engine, loop, tiny_tokenizer)
    assert _gap(t, trajs)[1] < 1e-4
    for _ in range(2):
        t.train_step(trajs)
    assert _gap(t, _sample(lora_engine, loop, tiny_tokenizer))[1] > 1e-3   # still the old adapter
    blob = t.weights_blob()
    assert all(".lora_" in k for k in safetensors.torch.load(blob))
    sync = loop.run_until_complete(lora_engine.update_weights(blob, t.version))
    assert sync["missing"] == [] and lora_engine.version == 2
    fresh = _sample(lora_engine, loop, tiny_tokenizer)
    assert all(v == 2 for tr in fresh for v, m in zip(tr["versions"], tr["mask"]) if m)
    worst, mean = _gap(t, fresh)
    assert mean < 1e-4 and worst < 1e-3, (mean, worst)
    assert set(loop.run_until_complete(lora_engine.engine.list_loras())) == {lora.ADAPTER_ID}   # one slot, replaced


def test_a_request_before_the_first_adapter_is_refused(lora_engine, loop, tiny_tokenizer):
    """With no adapter loaded a request runs on the base and, under --partial_rollout, stays there after the
    first update while its later tokens carry the new version: refused (launch loads version 0's first)."""
    saved, lora_engine.lora_request = lora_engine.lora_request, None
    try:
        with pytest.raises(RuntimeError, match="before its first adapter is loaded"):
            _sample(lora_engine, loop, tiny_tokenizer)
        with pytest.raises(RuntimeError, match="before its first adapter is loaded"):
            loop.run_until_complete(lora_engine.generate([0, 1, 2], {"max_tokens": 2}))
        assert loop.run_until_complete(lora_engine.warm_up()) == lora_engine.version   # start-up's warm-up may
    finally:
        lora_engine.lora_request = saved


def test_broadcast_sync_with_partial_rollout_and_both_exports(lora_engine, loop, tiny_model, tiny_tokenizer,
                                                              tmp_path):
    """Broadcast path, a request paused across the adapter swap: its tokens match the merged export of
    the version that sampled each. The peft-format export loads on the base and gives the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    t = Trainer(trainer_cfg(tiny_model, **LORA))
    t.cfg["sync_bucket_mb"] = 0   # every tensor its own bucket
    host, port = t.weight_sync_address()

    async def join():
        await asyncio.gather(asyncio.to_thread(t.join_weight_sync, host, port, 2),
                             lora_engine.join_weight_sync(host, port, 1, 2))
    loop.run_until_complete(join())

    async def broadcast():
        return (await asyncio.gather(asyncio.to_thread(t.broadcast_weights),
                                     lora_engine.update_weights(None, t.version)))
    loop.run_until_complete(broadcast())
    old = AutoModelForCausalLM.from_pretrained(t.export(str(tmp_path / "old")), dtype=torch.float32)
    t.train_step(_sample(lora_engine, loop, tiny_tokenizer))
    new = AutoModelForCausalLM.from_pretrained(t.export(str(tmp_path / "new")), dtype=torch.float32)
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "1?2="}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]
    lora_engine.partial_rollout = True
    try:
        async def scenario():
            task = asyncio.create_task(lora_engine.generate(prompt, {"temperature": TEMPERATURE, "max_tokens": 300,
                                                                     "ignore_eos": True}))
            await tokens_out(lora_engine, 2)
            sent, _ = await broadcast()
            return await task, sent
        out, sent = loop.run_until_complete(scenario())
    finally:
        lora_engine.partial_rollout = False
    assert sent == sum(v.numel() * 4 for v in lora.adapter_tensors(t.model).values())
    _check_two_versions(out, prompt, old, new, t.version)
    ids = torch.tensor([prompt + out["token_ids"]])
    with torch.no_grad():
        assert (old(ids).logits - new(ids).logits).abs().max() > 1e-2   # the two versions are told apart

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "new" / "adapter"))
    with torch.no_grad():
        merged, adapted = new(ids).logits, peft_model(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5)
    mine = torch.tensor(trainer_logprobs(t, [{"tokens": ids[0].tolist(), "mask": [1] * ids.shape[1],
                                              "logprobs": [0.0] * ids.shape[1], "versions": [0] * ids.shape[1],
                                              "reward": 0.0, "group": 0, "rollout_id": 0}])[0])
    ref = torch.log_softmax(merged[0, :-1] / TEMPERATURE, -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(mine, ref, atol=1e-4)


@pytest.mark.parametrize("adapter", [{}, LORA], ids=["full", "lora"])
def test_engine_old_logprobs_skip_a_forward_and_change_no_gradient(tiny_model, monkeypatch, adapter):
    """--old_logprobs engine (on-policy): the engine's logprobs (here the trainer's own plus a 1e-6
    engine-sized gap) replace the recomputed ones: one policy forward less, the same gradient at every
    mini-batch (the old policy is the step's first weights, which the engine sampled from)."""
    import trainer as trainer_module
    trajs = _trajectories()
    opts = dict(mini_batches=2, micro_batch_size=64, kl_coef=0.1, kl_loss=True, **adapter)   # the ref's forward still runs
    recompute, bypass = Trainer(trainer_cfg(tiny_model, **opts)), Trainer(trainer_cfg(tiny_model, old_logprobs="engine", **opts))
    for t, lp in zip(trajs, trainer_logprobs(recompute, trajs)):
        t["logprobs"] = [0.0] + [v + 1e-6 * (-1) ** k for k, v in enumerate(lp)]
    forwards, grads = [], []
    real_forward, real_step = Trainer._forward, trainer_module.optimizer_step
    monkeypatch.setattr(Trainer, "_forward", lambda self, *a, **kw: forwards.append(1) or real_forward(self, *a, **kw))
    monkeypatch.setattr(trainer_module, "optimizer_step", lambda model, *a: grads.append(
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])) or real_step(model, *a))
    full = recompute.train_step(trajs)
    n = len(forwards)
    fast = bypass.train_step(trajs)
    assert n - (len(forwards) - n) == 1   # one micro-batch: the old-logprob pass is the one skipped
    # the gap and entropy from the first mini-batch's forward (half the tokens), not old - sampled (0)
    assert 0.9e-6 < fast["mismatch_fresh_abs"] == fast["mismatch_abs"] < 1.1e-6 and "mismatch_max" not in fast
    assert 0 < fast["mismatch_k3"] < 1e-11 and abs(fast["entropy"] / full["entropy"] - 1) < 0.05
    assert len(grads) == 4 and all(g.abs().max() > 1e-3 for g in grads)
    for a, b in zip(grads[:2], grads[2:]):   # both mini-batches' updates
        assert (a - b).abs().max() < 1e-5 * a.abs().max()
    trajs[3]["versions"] = [v + 1 for v in trajs[3]["versions"]]
    with pytest.raises(RuntimeError, match="sampled by another policy version"):
        bypass.train_step(trajs)
    with pytest.raises(ValueError, match="--old_logprobs engine needs an on-policy step"):
        trainer_cfg(tiny_model, old_logprobs="engine", async_depth=1)
