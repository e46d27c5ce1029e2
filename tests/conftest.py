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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    import trainer
    return trainer.build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module: vLLM's async engine binds to the loop it first runs on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
