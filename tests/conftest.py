"""Shared fixtures: a tiny random-init model built once per session, offline."""

import asyncio
import gc
import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# hypothesis's pytest plugin imports its package lazily in the end-of-session summary; with
# vLLM/Ray threads still alive that compile once failed on CPython 3.11.7 ("SystemError: AST
# constructor recursion depth mismatch") after every test had passed. Import it up front.
try:
    import hypothesis.internal.observability  # noqa: F401
except ImportError:
    pass


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    import trainer
    return trainer.build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def tiny_moe(tiny_model, tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (4 experts, top-2) with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
    out = tmp_path_factory.mktemp("models") / "tiny-moe"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                            max_position_embeddings=256, tie_word_embeddings=True,
                            eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    for gate in (b.mlp.gate for b in model.model.layers):
        torch.nn.init.normal_(gate.weight, std=0.5)  # zeros would tie every expert choice
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module: vLLM's async engine binds to the loop it first runs on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def pytest_unconfigure(config):
    """Engines leave ZeroMQ contexts behind (vLLM's client sockets). pytest's final gc.collect()
    would run their __del__, whose term() waits forever for sockets nobody closes anymore (the
    suite once hung there after all tests passed): close them, not lingering, first."""
    zmq = sys.modules.get("zmq")
    if zmq is None:
        return
    with warnings.catch_warnings():  # isinstance() on some torch objects warns of deprecations
        warnings.simplefilter("ignore")
        contexts = [obj for obj in gc.get_objects() if isinstance(obj, zmq.Context) and not obj.closed]
    for ctx in contexts:
        try:
            ctx.destroy(linger=0)  # its sockets close first, so a later term() has nothing to wait for
        except zmq.ZMQError:       # e.g. "Bad address" from term() of a context vLLM already tore down
            pass

