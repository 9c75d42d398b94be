"""One sequence failing inside the executor fails alone.

Three layers: the ModelRunner (a bad entry among good ones, over several
steps), a real executor process driven over gRPC with a hand-built plan, and
the whole system, where a proxy between scheduler and executor corrupts one
request's block table: that request gets INTERNAL naming its id, the others in
the same step finish exactly, and no KV block leaks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterator

import grpc
import pytest
from support.leases import leased_execute
from support.pool import wait_pool_whole
from support.tiny_model import hf_greedy

from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.launch.launcher import LOOPBACK, free_port
from pagoda.params import SamplingParams
from pagoda.step_pb import plan_from_pb, result_from_pb
from pagoda.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from pagoda_client import Client, PagodaError
from security.system import SecureSystem

GREEDY = SamplingParams(temperature=0.0)
PROMPT_A, PROMPT_B = (5, 17, 42, 99, 7, 300, 12), (8, 9, 10, 11, 200, 201)
NUM_STEPS = 4


@pytest.fixture(scope="module")
def runner(security_model_dir) -> ModelRunner:
    return ModelRunner(
        str(security_model_dir),
        dtype="float32",
        device="cpu",
        block_size=16,
        kv_cache_memory_bytes=2**18,
        attention_backend="torch",
    )


def _new(seq_id: int, tokens, blocks, num_scheduled=None, num_computed=0) -> t.NewSequence:
    num_scheduled = len(tokens) - num_computed if num_scheduled is None else num_scheduled
    return t.NewSequence(
        seq_id, f"r{seq_id}", tuple(tokens), len(tokens), GREEDY, tuple(blocks), num_computed, num_scheduled
    )


BAD_ENTRIES = {
    "block-id-out-of-range": _new(9, PROMPT_B, [10**6]),
    "block-id-negative": _new(9, PROMPT_B, [-1]),
    "too-many-tokens-scheduled": _new(9, PROMPT_B, [2], num_scheduled=len(PROMPT_B) + 5),
    "too-few-blocks": _new(9, PROMPT_B * 3, [2]),
    "computed-beyond-tokens": _new(9, PROMPT_B, [2], num_scheduled=1, num_computed=len(PROMPT_B) + 1),
    "token-id-outside-vocab": _new(9, (*PROMPT_B, 384), [2]),
    "token-id-negative": _new(9, (-7, *PROMPT_B), [2]),
    "unknown-sequence": t.ScheduledSequence(9, 1),
}


def _run_steps(runner: ModelRunner, bad: object | None) -> tuple[dict[int, list[int]], list[t.SeqError]]:
    """Prefill A and B (plus `bad` in the first step), then decode; tokens per sequence and errors."""
    runner.reset()
    tokens: dict[int, list[int]] = {1: [], 2: []}
    errors: list[t.SeqError] = []
    new = (_new(1, PROMPT_A, [0]), _new(2, PROMPT_B, [1]))
    first = t.StepPlan(
        1,
        new_seqs=new + ((bad,) if isinstance(bad, t.NewSequence) else ()),
        scheduled_seqs=(bad,) if isinstance(bad, t.ScheduledSequence) else (),
    )
    steps = [first] + [
        t.StepPlan(s, scheduled_seqs=(t.ScheduledSequence(1, 1), t.ScheduledSequence(2, 1)))
        for s in range(2, NUM_STEPS + 1)
    ]
    for step in steps:
        out = runner.execute(step)
        errors += out.errors
        for o in out.outputs:
            tokens[o.seq_id] += o.token_ids
    return tokens, errors


@pytest.mark.parametrize("fault", list(BAD_ENTRIES))
def test_runner_fails_the_bad_sequence_alone(runner, fault):
    clean, clean_errors = _run_steps(runner, None)
    assert not clean_errors and all(len(v) == NUM_STEPS for v in clean.values())
    tokens, errors = _run_steps(runner, BAD_ENTRIES[fault])
    assert [e.seq_id for e in errors] == [9], errors
    assert tokens == clean
    assert not runner.has_sequence(9)


# --- a real executor process, driven directly over gRPC ---------------------------------------------


def _pb_new(seq_id: int, tokens, blocks) -> executor_pb2.NewSequence:
    return executor_pb2.NewSequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        sampling=common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0),
        block_ids=blocks,
        num_computed_tokens=0,
        num_scheduled_tokens=len(tokens),
    )


@pytest.mark.integration
def test_executor_process_fails_one_sequence_of_a_step(security_model_dir, tmp_path):
    plans = [
        executor_pb2.StepPlan(
            step_id=1,
            new_seqs=[
                _pb_new(1, PROMPT_A, [0]),
                _pb_new(7, PROMPT_B, [10**6]),
                _pb_new(8, (1, 2, 384), [3]),
                _pb_new(2, PROMPT_B, [1]),
            ],
        ),
        executor_pb2.StepPlan(
            step_id=2,
            scheduled_seqs=[
                executor_pb2.ScheduledSequence(seq_id=1, num_scheduled_tokens=1),
                executor_pb2.ScheduledSequence(seq_id=7, num_scheduled_tokens=1),
                executor_pb2.ScheduledSequence(seq_id=2, num_scheduled_tokens=1),
            ],
        ),
    ]
    with SecureSystem(security_model_dir, tmp_path, with_scheduler=False) as system:
        with grpc.insecure_channel(system.executor.address) as channel:
            results = leased_execute(channel, plans)
    first, second = results
    assert {e.seq_id for e in first.errors} == {7, 8}
    assert "out of range" in {e.seq_id: e.message for e in first.errors}[7]
    assert [e.seq_id for e in second.errors] == [7] and "unknown sequence" in second.errors[0].message
    tokens = {o.seq_id: list(o.token_ids) for o in first.outputs}
    for o in second.outputs:
        tokens[o.seq_id] += o.token_ids
    assert tokens == {
        1: hf_greedy(security_model_dir, list(PROMPT_A), 2),
        2: hf_greedy(security_model_dir, list(PROMPT_B), 2),
    }


@pytest.mark.integration
def test_executor_process_reads_compact_plans_and_refuses_one_that_does_not_add_up(security_model_dir, tmp_path):
    """Compact columns in and out of a real executor give the tokens of whole entries; a compact plan whose
    columns differ in length ends its stream with INVALID_ARGUMENT, and the executor serves the next stream."""
    first = executor_pb2.StepPlan(step_id=1, new_seqs=[_pb_new(1, PROMPT_A, [0]), _pb_new(2, PROMPT_B, [1])])
    plans = [first] + [
        executor_pb2.StepPlan(step_id=step, compact_seq_ids=[2, 1], compact_num_tokens=[1, 1], compact_results=True)
        for step in (2, 3)
    ]
    broken = executor_pb2.StepPlan(step_id=2, compact_seq_ids=[2, 1], compact_num_tokens=[1], compact_results=True)
    with SecureSystem(security_model_dir, tmp_path, with_scheduler=False) as system:
        with grpc.insecure_channel(system.executor.address) as channel:
            described = executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=10)
            assert described.compact_steps
            results = leased_execute(channel, plans)
            with pytest.raises(grpc.RpcError) as info:
                leased_execute(channel, [first, broken])
            again = leased_execute(channel, plans)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "step 2" in info.value.details() and "columns differ" in info.value.details()
    assert not results[0].compact_seq_ids  # the first plan did not ask for compact results
    assert [list(r.compact_seq_ids) for r in results[1:]] == [[2, 1], [2, 1]] and not results[1].outputs
    tokens: dict[int, list[int]] = {}
    for result in results:
        for output in result_from_pb(result).outputs:
            tokens.setdefault(output.seq_id, []).extend(output.token_ids)
    assert tokens == {
        1: hf_greedy(security_model_dir, list(PROMPT_A), 3),
        2: hf_greedy(security_model_dir, list(PROMPT_B), 3),
    }
    assert [result_from_pb(r).outputs for r in again] == [result_from_pb(r).outputs for r in results]


# --- the whole system, with one request's plan corrupted on the wire ----------------------------------


@dataclasses.dataclass
class Poisoning:
    step_id: int
    seq_id: int
    other_seq_ids: list[int]


class PoisonProxy(executor_pb2_grpc.ExecutorServicer):
    """Forwards the scheduler's Executor calls; the sequence of `poison_request_id`
    gets a block id the executor does not have, so the executor fails it."""

    def __init__(self, poison_request_id: str) -> None:
        self.poison_request_id = poison_request_id
        self.upstream = ""
        self.poisonings: list[Poisoning] = []
        self.results: dict[int, executor_pb2.StepResult] = {}
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        executor_pb2_grpc.add_ExecutorServicer_to_server(self, self.server)
        self.address = f"{LOOPBACK}:{free_port()}"
        self.server.add_insecure_port(self.address)

    def Describe(self, request, context):
        with grpc.insecure_channel(self.upstream) as channel:
            return executor_pb2_grpc.ExecutorStub(channel).Describe(request, timeout=10)

    def Acquire(self, request, context):
        with grpc.insecure_channel(self.upstream) as channel:
            return executor_pb2_grpc.ExecutorStub(channel).Acquire(request, timeout=10)

    def Execute(self, request_iterator, context) -> Iterator[executor_pb2.StepResult]:
        lease = [(k, v) for k, v in context.invocation_metadata() if k.startswith("x-pagoda-")]
        with grpc.insecure_channel(self.upstream) as channel:
            call = executor_pb2_grpc.ExecutorStub(channel).Execute(self._rewrite(request_iterator), metadata=lease)
            context.add_callback(call.cancel)
            for result in call:
                self.results[result.step_id] = result
                yield result

    def _rewrite(self, plans: Iterator[executor_pb2.StepPlan]) -> Iterator[executor_pb2.StepPlan]:
        for plan in plans:
            for seq in plan.new_seqs:
                if seq.request_id == self.poison_request_id:
                    seq.block_ids[0] = 10**6
                    others = [s.seq_id for s in plan.new_seqs if s.seq_id != seq.seq_id]
                    self.poisonings.append(
                        Poisoning(
                            plan.step_id, seq.seq_id, others + [s.seq_id for s in plan_from_pb(plan).scheduled_seqs]
                        )
                    )
            yield plan


@pytest.mark.integration
def test_request_failing_in_the_executor_gets_internal_and_others_continue(security_model_dir, tmp_path):
    proxy = PoisonProxy("poison-1")
    proxy.server.start()
    prompts = [list(PROMPT_A), list(PROMPT_B), [30, 31, 32, 33]]
    system = SecureSystem(security_model_dir, tmp_path, executor_route=proxy.address)
    proxy.upstream = system.executor.address
    try:
        with system, Client(system.target, timeout=120, max_retries=0) as client:
            started = threading.Barrier(len(prompts) + 1)

            def long_request(prompt: list[int]) -> list[int]:
                tokens: list[int] = []
                for delta in client.stream(token_ids=prompt, max_tokens=60, temperature=0, ignore_eos=True):
                    if delta.token_ids and not tokens:
                        started.wait(timeout=60)
                    tokens += delta.token_ids
                return tokens

            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(long_request, p) for p in prompts]
                started.wait(timeout=60)  # every long request is decoding now
                with pytest.raises(PagodaError) as info:
                    client.generate(token_ids=[40, 41, 42], max_tokens=5, request_id="poison-1")
                outputs = [f.result() for f in futures]
            _check_isolation(client, proxy, info.value, prompts, outputs, security_model_dir)
            assert '"request_id": "poison-1"' in system.scheduler.log_text()
    finally:
        proxy.server.stop(None)


def _check_isolation(client, proxy, error, prompts, outputs, model_dir) -> None:
    assert error.code == grpc.StatusCode.INTERNAL and "poison-1" in error.message
    assert len(proxy.poisonings) == 1
    poisoning = proxy.poisonings[0]
    assert poisoning.other_seq_ids, "the poisoned sequence should share its step with the others"
    result = proxy.results[poisoning.step_id]
    assert [e.seq_id for e in result.errors] == [poisoning.seq_id]
    assert {o.seq_id for o in result_from_pb(result).outputs} >= set(poisoning.other_seq_ids)
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(model_dir, prompt, 60)
    wait_pool_whole(client, 10)
