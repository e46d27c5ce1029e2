"""Shared fixtures: a tiny random-init model built once per session, offline."""

import asyncio
import os
import sys
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
# The same CPython 3.11.7 bug hit pydantic's docstring parsing when wandb's Settings class was
# first built while the loop and fault tests' threads were alive: build it up front, here.
try:
    import wandb.sdk.wandb_settings  # noqa: F401
except ImportError:
    pass


@pytest.fixture(scope="session", autouse=True)
def _default_output_dir_elsewhere(tmp_path_factory):
    """Tests that leave --output_dir at its default use a folder of their own: `python main.py`
    (the README's first command) leaves its records in runs/latest, which a new run refuses."""
    import main
    build = main.build_parser
    out = str(tmp_path_factory.mktemp("runs") / "latest")

    def parser():
        p = build()
        p.set_defaults(output_dir=out)
        return p
    parser.unpatched = build   # for the README flag reference, which prints the real defaults
    main.build_parser = parser
    yield
    main.build_parser = build


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


@pytest.fixture(scope="module")
def engine(tiny_model, loop):
    """A real vLLM engine on the tiny model, for a module's tests (test files may define their own)."""
    from generator import Generator

    async def make():
        return Generator(tiny_model, max_len=128, seed=0)
    gen = loop.run_until_complete(make())
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def server(loop):
    """The loopback chat server, started on the module's loop."""
    from server import ChatServer
    srv = ChatServer()
    loop.run_until_complete(srv.start())
    yield srv
    loop.run_until_complete(srv.stop())


def pytest_sessionfinish(session, exitstatus):
    session.config._molt_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process here, with pytest's exit status, once every report is written.

    Engines leave vLLM's ZeroMQ contexts and Ray's threads behind; the interpreter's own
    teardown then runs their finalizers in whatever order gc picks. That has hung forever
    (a context's term() waiting on sockets nobody closes) and aborted the process (libzmq's
    "pfd.revents & POLLIN" assertion) after every test had passed. Tests shut down their own
    engines and Ray; what is left is only finalizers, so skip them."""
    status = getattr(config, "_molt_exitstatus", None)
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
