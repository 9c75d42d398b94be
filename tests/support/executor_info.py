"""An ``ExecutorInfo`` for tests that need one without an executor."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagoda.step import ExecutorInfo, LoraAdapter


def executor_info(**overrides: Any) -> ExecutorInfo:
    """Every field set, none to its default, then ``overrides``.

    str fields hold their name, ints 7, string tuples ("a", "b"), adapters one, other tuples (1, 2).
    """
    adapters = (LoraAdapter("lora-a", "/adapters/a", 8, ("q_proj", "v_proj"), "f1"),)
    kinds = {"str": None, "int": 7, "bool": True, "tuple[str, ...]": ("a", "b"), "tuple[LoraAdapter, ...]": adapters}
    values = {
        f.name: f.name if str(f.type) == "str" else kinds.get(str(f.type), (1, 2))
        for f in dataclasses.fields(ExecutorInfo)
    }
    return ExecutorInfo(**{**values, **overrides})
