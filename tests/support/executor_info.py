"""An ``ExecutorInfo`` for tests that need one without an executor."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagoda.step import ExecutorInfo


def executor_info(**overrides: Any) -> ExecutorInfo:
    """Every field set, none to its default, then ``overrides``.

    str fields hold their name, ints 7, string tuples ("a", "b"), other tuples (1, 2).
    """
    values = {
        f.name: {"str": f.name, "int": 7, "bool": True, "tuple[str, ...]": ("a", "b")}.get(str(f.type), (1, 2))
        for f in dataclasses.fields(ExecutorInfo)
    }
    return ExecutorInfo(**{**values, **overrides})
