"""pagoda.by_name: fields copied by name between dataclasses and proto messages."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pagoda.by_name import copy_by_name
from pagoda.v1 import generation_pb2


@dataclasses.dataclass(frozen=True)
class _Info:
    model_name: str
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool = False


def test_a_dataclass_from_a_message_gets_tuples():
    msg = generation_pb2.ModelInfo(model_name="m", eos_token_ids=[2, 3], has_chat_template=True)
    copied = copy_by_name(_Info, msg)
    assert copied == _Info("m", (2, 3), True) and type(copied.eos_token_ids) is tuple


def test_a_message_from_the_first_source_with_each_field_then_given_values():
    limits = SimpleNamespace(model_name="limits", max_model_len=64, vocab_size=100, max_prompt_tokens=63)
    model = SimpleNamespace(
        model_name="model",
        architecture="a",
        dtype="d",
        max_model_len=512,
        max_new_tokens=16,
        kv_cache_dtype="int8",
        quantization="none",
        batch_invariant=True,
    )
    msg = copy_by_name(generation_pb2.ModelInfo, limits, model, eos_token_ids=(1,), has_chat_template=True, loras=[])
    assert (msg.model_name, msg.architecture, msg.max_model_len, msg.max_new_tokens) == ("limits", "a", 64, 16)
    assert msg.kv_cache_dtype == "int8" and msg.batch_invariant
    assert (list(msg.eos_token_ids), msg.has_chat_template) == ([1], True)


def test_a_field_no_source_has_is_named():
    with pytest.raises(AttributeError, match=r"ModelInfo\.architecture: not given"):
        copy_by_name(generation_pb2.ModelInfo, _Info("m", ()))
