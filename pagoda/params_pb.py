"""The parameter messages <-> ``pagoda.params`` dataclasses, generic over the table.

``SamplingParams`` (common.proto) and ``StoppingCriteria`` (generation.proto)
are rendered from the table, field for field, so one loop over the table rows
converts every field: a new row converts with no new code here.

Two readings of a message:

- ``params_from_pb``: the effective parameters (the executor hop, where the
  scheduler sets every field); an unset field takes the dataclass default.
- ``given_from_pb``: only what a client set (the client API), for
  ``scheduler_svc.api.validation`` to fill in and check.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from google.protobuf.message import Message

from pagoda.params import Params, SamplingParams, StoppingCriteria, group_of, rows
from pagoda.v1 import common_pb2, generation_pb2

P = TypeVar("P", SamplingParams, StoppingCriteria)

# The proto message of each dataclass (same name, rendered from the same rows).
MESSAGE_OF_CLASS: dict[type[Params], type[Message]] = {
    SamplingParams: common_pb2.SamplingParams,
    StoppingCriteria: generation_pb2.StoppingCriteria,
}


@overload
def params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams: ...
@overload
def params_to_pb(params: StoppingCriteria) -> generation_pb2.StoppingCriteria: ...
def params_to_pb(params: Params) -> Message:
    """The message of ``params`` with every field set (``None``, as unset logprobs, stays unset)."""
    cls = type(params)
    values = {row.name: value for row in rows(group_of(cls)) if (value := getattr(params, row.name)) is not None}
    return MESSAGE_OF_CLASS[cls](**values)


def params_from_pb(msg: Message, cls: type[P]) -> P:
    """The dataclass of ``msg``; a field the message leaves unset takes the dataclass default."""
    values: dict[str, Any] = {}
    for row in rows(group_of(cls)):
        if row.spec.has_presence and not msg.HasField(row.name):
            continue
        value = getattr(msg, row.name)
        values[row.name] = tuple(value) if row.spec.repeated else value
    return cls(**values)


def given_from_pb(msg: Message, cls: type[Params]) -> dict[str, Any]:
    """The fields a client set: those present, lists that are not empty, bools that are true.

    A field without presence cannot be told from its zero value, which the
    table makes its default, so leaving it out means the same.
    """
    given: dict[str, Any] = {}
    for row in rows(group_of(cls)):
        if row.spec.has_presence and not msg.HasField(row.name):
            continue
        value = getattr(msg, row.name)
        if row.spec.has_presence or value:
            given[row.name] = tuple(value) if row.spec.repeated else value
    return given
