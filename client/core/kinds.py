"""How each ``pagoda.params`` row appears in the client: its Python type, from its proto type."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.params import ParamField

_SCALARS: dict[str, type] = {
    "float": float,
    "double": float,
    "int32": int,
    "int64": int,
    "uint32": int,
    "uint64": int,
    "bool": bool,
    "string": str,
}


@dataclass(frozen=True)
class Kind:
    """The client-side shape of one parameter.

    Attributes:
        scalar: the element type (``float``, ``int``, ``bool`` or ``str``).
        repeated: a list on the wire; the client takes any sequence (a bare
            string counts as one element).
    """

    scalar: type
    repeated: bool

    @property
    def annotation(self) -> str:
        """The option's type as written in ``ParamOptions`` (None leaves it unset)."""
        name = self.scalar.__name__
        if not self.repeated:
            return f"{name} | None"
        return "Sequence[str] | str | None" if self.scalar is str else f"Sequence[{name}] | None"


def kind_of(row: ParamField) -> Kind:
    """The ``Kind`` of a table row, from its ``proto_type`` (e.g. ``optional float``).

    Raises:
        ValueError: a proto type the client does not know how to send.
    """
    words = row.spec.proto_type.split()
    scalar = _SCALARS.get(words[-1])
    if scalar is None or len(words) > 2 or words[0] not in ("optional", "repeated", words[-1]):
        raise ValueError(f"parameter {row.name}: unsupported proto type {row.spec.proto_type!r}")
    return Kind(scalar, words[0] == "repeated")
