"""Request parameters: one table that every layer reads.

``SamplingParams`` and ``StoppingCriteria`` are the effective parameters of a
request (defaults applied, ranges checked). Each field carries a ``Param`` in
its metadata, and that entry drives every other place the parameter appears:

- the proto messages of the same names (``scripts/gen_proto.py`` renders them
  from this table; field numbers and wire types are here);
- the proto <-> dataclass conversion on both hops;
- the scheduler's defaults and range checks (``INVALID_ARGUMENT`` naming the field);
- the OpenAI HTTP body (``http``) and the CLI flags (``cli``);
- the client's keyword arguments.

Adding a parameter is one field here, its use (e.g. in the sampler) and a test;
the rest follows from the table. Pure Python: no torch, numpy or protobuf.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

Group = Literal["sampling", "stopping"]
# The Python type of one value of a parameter, from its proto scalar type.
Kind = Literal["float", "int", "bool", "str"]
_KIND_OF_PROTO_SCALAR: dict[str, Kind] = {
    "float": "float",
    "double": "float",
    "int32": "int",
    "int64": "int",
    "uint32": "int",
    "uint64": "int",
    "sint32": "int",
    "sint64": "int",
    "bool": "bool",
    "string": "str",
}

# The seed default: the scheduler draws one, so every request is reproducible.
RANDOM_SEED = "random"
MAX_SEED = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Bound:
    """A closed or open numeric bound; ``limit`` names a server limit instead of a number."""

    value: float = 0.0
    inclusive: bool = True
    limit: str = ""


@dataclasses.dataclass(frozen=True)
class Param:
    """How one request parameter appears in every layer.

    Attributes:
        number: the proto field number in its message.
        proto_type: the proto declaration, e.g. ``optional float``.
        help: one line for the CLI, the proto comment and the docs.
        unset: what the server applies when a client leaves the field unset
            (``RANDOM_SEED`` for the seed); ``None`` for "no value" (logprobs).
        low, high: the accepted range (``None``: unbounded).
        finite: reject NaN and infinities.
        http: the OpenAI body field (``""``: not a plain HTTP field; the
            HTTP edge maps it by hand, as logprobs).
        http_unset: the HTTP default when it differs from gRPC's (OpenAI
            samples at temperature 1 by default; the gRPC API is greedy).
        cli: expose as ``--flag`` on ``pagoda generate``/``chat``.
        aliases: values accepted and mapped before the range check
            (top_k -1 means 0, "disabled").
    """

    number: int
    proto_type: str
    help: str
    unset: Any = None
    low: Bound | None = None
    high: Bound | None = None
    finite: bool = True
    http: str = ""
    http_unset: Any = None
    cli: bool = True
    aliases: tuple[tuple[Any, Any], ...] = ()

    @property
    def has_presence(self) -> bool:
        """Whether the proto tells "unset" from a value (``optional``); else unset is the zero value."""
        return self.proto_type.startswith("optional ")

    @property
    def repeated(self) -> bool:
        """Whether the field is a list (a tuple in the dataclasses)."""
        return self.proto_type.startswith("repeated ")

    @property
    def value_kind(self) -> Kind:
        """The Python type of one value: ``float``, ``int``, ``bool`` or ``str``."""
        return _KIND_OF_PROTO_SCALAR[self.proto_type.rsplit(" ", 1)[-1]]

    def check(self, name: str, value: Any, limits: Callable[[str], float]) -> str | None:
        """Why ``value`` is out of range, or None when it is fine.

        Args:
            name: the field name (used only in messages).
            value: the value after ``aliases`` were applied.
            limits: looks up a named server limit for a ``Bound.limit``.
        """
        if isinstance(value, (tuple, list, str, bool)) or value is None:
            return None
        if self.finite and isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        for bound, is_low in ((self.low, True), (self.high, False)):
            if bound is None:
                continue
            edge = limits(bound.limit) if bound.limit else bound.value
            ok = (
                (value >= edge if bound.inclusive else value > edge)
                if is_low
                else (value <= edge if bound.inclusive else value < edge)
            )
            if not ok:
                # A named limit is the operator's choice, not the parameter's meaning: say so.
                beyond = f" ({'below' if is_low else 'above'} the limit of {_fmt(edge)})" if bound.limit else ""
                return f"must be {self.requirement(limits)}, got {value}{beyond}"
        return None

    def requirement(self, limits: Callable[[str], float]) -> str:
        """What an accepted value is, e.g. ``in (0, 1]``, ``>= 0`` or ``>= 0 or -1`` (with aliases)."""
        low, high = self.low, self.high
        if low is not None and high is not None:
            text = "in " + self.describe_range(limits)
        elif low is not None:
            text = (">= " if low.inclusive else "> ") + _fmt(limits(low.limit) if low.limit else low.value)
        elif high is not None:
            text = ("<= " if high.inclusive else "< ") + _fmt(limits(high.limit) if high.limit else high.value)
        else:
            text = "any value"
        return text + "".join(f" or {given}" for given, _ in self.aliases)

    def describe_range(self, limits: Callable[[str], float]) -> str:
        """``[0, 1]``-style text of the accepted range."""
        low, high = self.low, self.high
        left = (
            "(-inf"
            if low is None
            else ("[" if low.inclusive else "(") + _fmt(limits(low.limit) if low.limit else low.value)
        )
        right = (
            "inf)"
            if high is None
            else _fmt(limits(high.limit) if high.limit else high.value) + ("]" if high.inclusive else ")")
        )
        return f"{left}, {right}"

    def resolve_alias(self, value: Any) -> Any:
        """``value`` with its alias applied (top_k -1 -> 0)."""
        for given, meant in self.aliases:
            if value == given and type(value) is type(given):
                return meant
        return value


def _fmt(value: float) -> str:
    if value == MAX_SEED + 1:
        return "2^63"
    return str(int(value)) if float(value).is_integer() else str(value)


def param(default: Any, spec: Param) -> Any:
    """A dataclass field whose metadata is its table entry."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for sequence defaults (the dataclasses are frozen)")
    return dataclasses.field(default=default, metadata={"param": spec})


def optional_float(default: float, number: int, help: str, http: str, low: Bound, high: Bound | None = None) -> Any:
    """The row of an ``optional float`` whose unset value is its default, with a range."""
    return param(default, Param(number, "optional float", help, unset=default, http=http, low=low, high=high))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Effective sampling parameters of one sequence, as the executor applies them."""

    temperature: float = param(
        1.0,
        Param(
            1, "optional float", "0 is greedy (argmax)", unset=0.0, http="temperature", http_unset=1.0, low=Bound(0.0)
        ),
    )
    top_p: float = optional_float(
        1.0, 2, "nucleus sampling mass in (0, 1]; 1 disables", "top_p", Bound(0.0, inclusive=False), Bound(1.0)
    )
    top_k: int = param(
        0,
        Param(
            3,
            "optional int32",
            "keep the k most likely tokens; 0 or -1 disables",
            unset=0,
            http="top_k",
            aliases=((-1, 0),),
            low=Bound(0),
        ),
    )
    min_p: float = optional_float(
        0.0, 4, "drop tokens below min_p times the top probability", "min_p", Bound(0.0), Bound(1.0)
    )
    repetition_penalty: float = optional_float(
        1.0, 5, "Hugging Face repetition penalty (> 0; 1 disables)", "repetition_penalty", Bound(0.0, inclusive=False)
    )
    presence_penalty: float = optional_float(
        0.0, 6, "OpenAI presence penalty in [-2, 2]", "presence_penalty", Bound(-2.0), Bound(2.0)
    )
    frequency_penalty: float = optional_float(
        0.0, 7, "OpenAI frequency penalty in [-2, 2]", "frequency_penalty", Bound(-2.0), Bound(2.0)
    )
    seed: int = param(
        0,
        Param(
            8,
            "optional uint64",
            "random stream seed; the stream depends only on (seed, position); unset: the server draws one",
            unset=RANDOM_SEED,
            http="seed",
            low=Bound(0),
            high=Bound(MAX_SEED + 1, inclusive=False),
        ),
    )
    logprobs: int | None = param(
        None,
        Param(
            9,
            "optional int32",
            "top alternatives returned with each token's logprob; unset: none, 0: the sampled token's only",
            unset=None,
            low=Bound(0),
            high=Bound(limit="max_logprobs"),
        ),
    )
    prompt_logprobs: int | None = param(
        None,
        Param(
            10,
            "optional int32",
            "each prompt token's logprob given the ones before it (the model's, before any sampling parameter), "
            "with this many top alternatives; unset: none. The prompt is then computed, not read from the prefix "
            "cache",
            unset=None,
            low=Bound(0),
            high=Bound(limit="max_logprobs"),
        ),
    )


@dataclasses.dataclass(frozen=True)
class StoppingCriteria:
    """When a request stops (EOS too, unless ignore_eos)."""

    max_tokens: int = param(
        16,
        Param(
            1,
            "optional int32",
            "new tokens to generate at most (server default when unset)",
            http="max_tokens",
            low=Bound(1),
            high=Bound(limit="max_new_tokens"),
        ),
    )
    stop: tuple[str, ...] = param(
        (), Param(2, "repeated string", "stop when the output contains one of these (not returned)")
    )
    stop_token_ids: tuple[int, ...] = param(
        (),
        Param(
            3, "repeated int32", "stop when one of these token ids is sampled (it is returned)", http="stop_token_ids"
        ),
    )
    ignore_eos: bool = param(False, Param(4, "bool", "keep generating past EOS (benchmarks)", http="ignore_eos"))
    include_stop_str_in_output: bool = param(
        False,
        Param(5, "bool", "keep the matched stop string in the returned text", http="include_stop_str_in_output"),
    )


# One of the two parameter dataclasses (both are built from their table rows).
Params = SamplingParams | StoppingCriteria
PARAM_CLASSES: dict[Group, type[SamplingParams] | type[StoppingCriteria]] = {
    "sampling": SamplingParams,
    "stopping": StoppingCriteria,
}


@dataclasses.dataclass(frozen=True)
class ParamField:
    """One row of the table: a field name, its group, Python type and ``Param``."""

    name: str
    group: Group
    type: str
    spec: Param
    default: Any

    @property
    def unset(self) -> Any:
        """What the server applies when a client leaves the field unset.

        ``spec.unset`` where the proto tracks presence; otherwise the proto
        cannot tell unset from its zero value, which is the dataclass default.
        """
        return self.spec.unset if self.spec.has_presence else self.default


def group_of(cls: type[Params]) -> Group:
    """The group whose dataclass is ``cls``."""
    return "sampling" if cls is SamplingParams else "stopping"


def rows(group: Group) -> tuple[ParamField, ...]:
    """The table rows of one group, in declaration order (computed once per dataclass)."""
    cls = PARAM_CLASSES[group]
    found = _ROWS.get(cls)
    if found is None:
        found = _ROWS[cls] = tuple(
            ParamField(f.name, group, str(f.type), f.metadata["param"], f.default) for f in dataclasses.fields(cls)
        )
    return found


_ROWS: dict[type, tuple[ParamField, ...]] = {}


def out_of_range(values: Params, limits: Callable[[str], float] | None = None) -> str | None:
    """``"<field> must be ..."`` for the first field of ``values`` outside its table range, or None.

    Args:
        values: effective parameters (aliases already applied).
        limits: looks up a named server limit; without it a bound that names
            one is not checked (the executor does not know the operator's limits).
    """
    lookup = limits if limits is not None else (lambda name: math.inf)
    for row in rows(group_of(type(values))):
        reason = row.spec.check(row.name, getattr(values, row.name), lookup)
        if reason is not None:
            return f"{row.name} {reason}"
    return None


def fields(group: Group | None = None) -> Iterator[ParamField]:
    """Every table row (of one group, or all), in declaration order."""
    for name in PARAM_CLASSES:
        if group is None or name == group:
            yield from rows(name)


def field(name: str) -> ParamField:
    """The table row of one parameter.

    Raises:
        KeyError: no such parameter.
    """
    for row in fields():
        if row.name == name:
            return row
    raise KeyError(name)


def names(group: Group | None = None) -> tuple[str, ...]:
    """Parameter names (of one group, or all)."""
    return tuple(row.name for row in fields(group))
