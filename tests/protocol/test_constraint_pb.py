"""The constraint crosses both hops unchanged: client request -> engine, plan -> executor."""

from __future__ import annotations

import pytest

from pagoda.constraint import Constraint
from pagoda.constraint_pb import constraint_from_pb, constraint_to_pb
from pagoda.params import SamplingParams
from pagoda.step import NewSequence, StepPlan
from pagoda.step_pb import plan_from_pb, plan_to_pb
from pagoda.v1 import common_pb2, generation_pb2
from scheduler_svc.api.convert import request_from_pb

CONSTRAINTS = [
    None,
    Constraint("json_schema", text='{"type": "object"}'),
    Constraint("json_object"),
    Constraint("regex", text="a|b"),
    Constraint("grammar", text='start: "x"'),
    Constraint("choice", choices=("one", "two words")),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_new_sequence_carries_the_constraint(constraint):
    new = NewSequence(7, "r", (1, 2, 3), 2, SamplingParams(seed=4), (0,), 0, 3, constraint)
    plan = StepPlan(1, new_seqs=(new,))
    assert plan_from_pb(plan_to_pb(plan)) == plan


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_generate_request_carries_the_constraint(constraint):
    msg = generation_pb2.GenerateRequest(text="hi")
    if constraint is not None:
        msg.structured.CopyFrom(constraint_to_pb(constraint))
    assert request_from_pb(msg, "r", None).structured == constraint


def test_json_object_false_is_no_constraint():
    assert constraint_from_pb(common_pb2.StructuredOutput(json_object=False)) is None
    assert constraint_from_pb(common_pb2.StructuredOutput()) is None
