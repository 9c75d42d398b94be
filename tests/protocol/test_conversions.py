"""pagoda.params_pb and pagoda.step_pb: every message converts both ways without loss.

The parameter conversions are generic over the table, so these tests pick a
non-default value for every row: a new row is covered with no new test code.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.executor_info import executor_info

from pagoda import params, step
from pagoda.params_pb import given_from_pb, params_from_pb, params_to_pb
from pagoda.step_pb import info_from_pb, info_to_pb, plan_from_pb, plan_to_pb, result_from_pb, result_to_pb


def _other_value(row: params.ParamField) -> Any:
    """A value of the row's type that is not its default (exact in float32)."""
    other = {"float": 0.25, "int": 3, "bool": True, "str": "x"}[row.spec.value_kind]
    if row.spec.repeated:
        return (other, other)
    return other if other != row.default else {"float": 0.5, "int": 4}[row.spec.value_kind]


@pytest.mark.parametrize("cls", [params.SamplingParams, params.StoppingCriteria])
def test_every_row_round_trips(cls):
    for row in params.rows(params.group_of(cls)):
        value = cls(**{row.name: _other_value(row)})
        msg = params_to_pb(value)
        assert params_from_pb(msg, cls) == value, row.name
        assert given_from_pb(msg, cls)[row.name] == getattr(value, row.name), row.name
        assert type(msg).FromString(msg.SerializeToString()) == msg


@pytest.mark.parametrize("cls", [params.SamplingParams, params.StoppingCriteria])
def test_given_holds_only_what_was_set(cls):
    empty = type(params_to_pb(cls()))()
    assert given_from_pb(empty, cls) == {}
    assert params_from_pb(empty, cls) == cls()


def test_logprobs_unset_stays_unset_and_zero_stays_zero():
    assert not params_to_pb(params.SamplingParams()).HasField("logprobs")
    zero = params_to_pb(params.SamplingParams(logprobs=0))
    assert zero.HasField("logprobs") and params_from_pb(zero, params.SamplingParams).logprobs == 0
    assert given_from_pb(zero, params.SamplingParams)["logprobs"] == 0


def test_plan_round_trips():
    sampling = params.SamplingParams(temperature=0.5, top_k=7, seed=2**63 - 1, logprobs=2)
    plan = step.StepPlan(
        step_id=9,
        new_seqs=(
            step.NewSequence(1, "req-1", (5, 6, 7), 2, sampling, (3, 4), 1, 2),
            step.NewSequence(2, "req-2", (8,), 1, params.SamplingParams(), (), 0, 1),
            step.NewSequence(
                5,
                "req-5",
                (1,) * 9,
                9,
                sampling,
                (6, 2, 8),
                8,
                1,
                loads=(step.BlockLoad(2**64 - 1, 2), step.BlockLoad(7, 8)),
            ),
        ),
        scheduled_seqs=(step.ScheduledSequence(3, 1), step.ScheduledSequence(4, 16, (9, 10))),
        dropped_seq_ids=(11, 12),
        epoch=2**48 + 5,
        saves=(step.BlockSave(3, 2**63 + 1, (5, 6, 7, 8)), step.BlockSave(4, 0, (1, 2, 3, 4))),
    )
    assert plan_from_pb(plan_to_pb(plan)) == plan


def test_result_round_trips():
    entry = step.LogprobEntry(step.TokenLogprob(5, -0.5), (step.TokenLogprob(5, -0.5), step.TokenLogprob(6, -1.25)))
    result = step.StepResult(
        step_id=3,
        incarnation_id="inc",
        outputs=(step.SeqOutput(1, (5,), (entry,)), step.SeqOutput(2, (7,))),
        errors=(step.SeqError(9, "bad block"), step.SeqError(10, "tier miss", (2**64 - 1, 3))),
        timings=step.StepTimings(1, 2, 3, 4, 5, 6, 7),
        num_scheduled_tokens=17,
        draining=True,
        tier_added=(1, 2**64 - 1),
        tier_removed=(3,),
        tier_reset=True,
    )
    assert result_from_pb(result_to_pb(result)) == result


def test_compact_plans_and_results_round_trip_in_order():
    plan = step.StepPlan(
        step_id=4,
        scheduled_seqs=(
            step.ScheduledSequence(3, 1),
            step.ScheduledSequence(4, 16, (9, 10)),
            step.ScheduledSequence(2**64 - 1, 1),
            step.ScheduledSequence(7, 1, (), (5, 6, 7)),
            step.ScheduledSequence(8, 1, (11,), (), 2),
            step.ScheduledSequence(1, 300),
        ),
        dropped_seq_ids=(2,),
        epoch=3,
    )
    msg = plan_to_pb(plan, compact=True)
    assert [s.seq_id for s in msg.scheduled_seqs] == [4, 7, 8]  # only those with blocks or drafts go whole
    assert plan_from_pb(type(msg).FromString(msg.SerializeToString())) == plan
    assert not plan_to_pb(plan).compact_seq_ids and plan_from_pb(plan_to_pb(plan)) == plan
    entry = step.LogprobEntry(step.TokenLogprob(5, -0.5), (step.TokenLogprob(6, -1.25),))
    outputs = (
        step.SeqOutput(1, (5,)),
        step.SeqOutput(2, (5, 6, 7), (entry, entry, entry)),
        step.SeqOutput(3, (), (), (entry,), 4),
        step.SeqOutput(4, (8, 9)),
        step.SeqOutput(2**64 - 1, (2**31 - 1,)),
    )
    result = step.StepResult(step_id=4, incarnation_id="inc", outputs=outputs, num_scheduled_tokens=9)
    msg = result_to_pb(result, compact=True)
    assert [o.seq_id for o in msg.outputs] == [2, 3]
    assert list(msg.compact_token_ids) == [5, 5, 6, 7, 8, 9, 2**31 - 1]
    assert result_from_pb(type(msg).FromString(msg.SerializeToString())) == result
    # A scheduler that does not read compact results (its plans leave compact_results unset) gets whole ones.
    assert not result_to_pb(result).compact_seq_ids and result_from_pb(result_to_pb(result)) == result


def test_a_compact_message_that_does_not_add_up_is_refused():
    plan = plan_to_pb(step.StepPlan(1, scheduled_seqs=(step.ScheduledSequence(3, 1),)), compact=True)
    plan.compact_num_tokens.append(1)
    with pytest.raises(ValueError, match="columns differ"):
        plan_from_pb(plan)
    stray = plan_to_pb(step.StepPlan(1, scheduled_seqs=(step.ScheduledSequence(3, 1, (4,)),)), compact=True)
    stray.compact_seq_ids[0] = 9
    with pytest.raises(ValueError, match=r"sequences \[3\] are not in its columns"):
        plan_from_pb(stray)
    result = result_to_pb(step.StepResult(1, outputs=(step.SeqOutput(3, (5, 6)),)), compact=True)
    result.compact_token_ids.pop()
    with pytest.raises(ValueError, match="do not add up"):
        result_from_pb(result)


def test_executor_info_round_trips_with_its_kernels():
    info = executor_info(
        kernels=(("attention", "cpp"), ("gemm", "amx-panel")), kv_offload="disk 1 GiB", tier_hashes=(5, 2**64 - 1)
    )
    msg = info_to_pb(info)
    assert dict(msg.kernels) == {"attention": "cpp", "gemm": "amx-panel"}
    assert info_from_pb(msg) == info


def test_executor_info_round_trips_an_executor_groups_ranks():
    ranks = (
        step.GroupRank(0, "vm", 1533, "layers 0-1, q heads 0-1, kv heads 0-0, vocab 0-191", 280 * 2**20, 2**21),
        step.GroupRank(1, "vm", 1820, "layers 0-1, q heads 2-3, kv heads 1-1, vocab 192-383", 2**31 + 7, 2**21),
    )
    info = executor_info(
        kernels=(), tensor_parallel_size=2, pipeline_parallel_size=1, group_ranks=ranks, group_last_contact_s=0.75
    )
    msg = info_to_pb(info)
    assert [(r.rank, r.pid, r.shard, r.health) for r in msg.group_ranks] == [
        (0, 1533, ranks[0].shard, "ok"),
        (1, 1820, ranks[1].shard, "ok"),
    ]
    assert (msg.tensor_parallel_size, msg.pipeline_parallel_size, msg.group_last_contact_s) == (2, 1, 0.75)
    assert info_from_pb(msg) == info


def test_executor_info_of_a_plain_executor_lists_no_ranks_and_older_sizes_read_as_one():
    plain = executor_info(kernels=(), tensor_parallel_size=1, pipeline_parallel_size=1, group_ranks=())
    assert info_from_pb(info_to_pb(plain)).group_ranks == ()
    older = info_to_pb(plain)  # an executor from before groups leaves the sizes unset
    older.ClearField("tensor_parallel_size")
    older.ClearField("pipeline_parallel_size")
    described = info_from_pb(older)
    assert (described.tensor_parallel_size, described.pipeline_parallel_size) == (1, 1)
