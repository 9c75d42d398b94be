"""An ``ExecutorInfo`` for tests that need one without an executor."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagoda.step import ExecutorInfo, GroupRank, LoraAdapter


def executor_info(**overrides: Any) -> ExecutorInfo:
    """Every field set, none to its default, then ``overrides``.

    str fields hold their name, ints 7, floats 0.5, string tuples ("a", "b"), adapters one, group ranks two,
    other tuples (1, 2).
    """
    adapters = (LoraAdapter("lora-a", "/adapters/a", 8, ("q_proj", "v_proj"), "f1"),)
    ranks = (
        GroupRank(0, "host-a", 101, "layers 0-1, q heads 0-1", 2**28, 2**22),
        GroupRank(1, "host-b", 202, "layers 0-1, q heads 2-3", 2**28 + 1, 2**22, "ok"),
    )
    kinds = {
        "str": None,
        "int": 7,
        "float": 0.5,
        "bool": True,
        "tuple[str, ...]": ("a", "b"),
        "tuple[LoraAdapter, ...]": adapters,
        "tuple[GroupRank, ...]": ranks,
    }
    values = {
        f.name: f.name if str(f.type) == "str" else kinds.get(str(f.type), (1, 2))
        for f in dataclasses.fields(ExecutorInfo)
    }
    return ExecutorInfo(**{**values, **overrides})
