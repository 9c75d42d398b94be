"""``pagoda.v1.StructuredOutput`` <-> ``pagoda.constraint.Constraint``, used on both hops."""

from __future__ import annotations

from typing import cast

from pagoda.constraint import Constraint, ConstraintKind
from pagoda.v1 import common_pb2


def constraint_to_pb(constraint: Constraint | None) -> common_pb2.StructuredOutput | None:
    """The message of ``constraint``; None stays None (the field is left unset)."""
    if constraint is None:
        return None
    if constraint.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.Choice(choices=constraint.choices))
    if constraint.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    msg = common_pb2.StructuredOutput()
    setattr(msg, constraint.kind, constraint.text)
    return msg


def constraint_from_pb(msg: common_pb2.StructuredOutput) -> Constraint | None:
    """The constraint a message holds, or None when no kind is set (or json_object is false)."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint(cast(ConstraintKind, kind), text=getattr(msg, kind))
