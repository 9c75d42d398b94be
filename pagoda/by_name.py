"""Copies between types that name their fields alike: dataclasses, proto messages, plain objects.

The plain types on both hops mirror their proto messages field for field, so a
conversion copies by name and spells out only the fields whose type differs
(a nested message, a map). Pure Python: no protobuf import needed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar, cast

T = TypeVar("T")


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, wants a tuple) of each field of a dataclass or a proto message class."""
    if dataclasses.is_dataclass(cls):
        return tuple((f.name, str(f.type).startswith("tuple[")) for f in dataclasses.fields(cls))
    message: Any = cls  # a generated message class (its descriptor lists the fields)
    return tuple((f.name, False) for f in message.DESCRIPTOR.fields)


def copy_by_name(cls: type[T], *sources: object, **given: Any) -> T:
    """A ``cls`` whose fields come from ``given``, else from the first of ``sources`` with that attribute.

    A dataclass's tuple fields get tuples (a message's repeated fields are lists).

    Raises:
        AttributeError: a field that ``given`` lacks and no source has (named).
    """
    values = dict(given)
    for name, wants_tuple in _layout(cast(type, cls)):  # mypy: a type[T] is hashable
        if name not in given:
            value = _first(sources, name, cls)
            values[name] = tuple(value) if wants_tuple else value
    factory: Any = cls
    return cast(T, factory(**values))


def _first(sources: tuple[object, ...], name: str, cls: type) -> Any:
    """The attribute ``name`` of the first source that has it (one lookup each: this runs per new sequence)."""
    for source in sources:
        try:
            return getattr(source, name)
        except AttributeError:
            continue
    raise AttributeError(f"{cls.__name__}.{name}: not given and not an attribute of any source")
