"""Resume on the wire, real processes: a scheduler and an executor on the tiny model.

A fault-free stream is run once; then, at every point where a client could
have lost it (after each response), the request is resumed with what was
delivered so far, and the continuation must be exactly the rest of the
fault-free stream: token ids, text (stop strings across the boundary,
multi-byte characters split over tokens), logprobs, usage. Bad resume input
is INVALID_ARGUMENT naming the field, and the server keeps serving.
"""

from __future__ import annotations

import grpc
import pytest

from pagoda.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 42, 99, 100, 7, 250, 31, 8]
CASES = {
    "greedy": {"sampling": {"temperature": 0.0}, "stopping": {"max_tokens": 40, "ignore_eos": True}},
    "seeded": {"sampling": {"temperature": 0.8, "seed": 1234}, "stopping": {"max_tokens": 40, "ignore_eos": True}},
    "logprobs": {"sampling": {"temperature": 0.8, "seed": 99, "logprobs": 2}, "stopping": {"max_tokens": 30}},
}


def _request(case: dict, **fields: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIdsInput(token_ids=PROMPT),
        sampling=common_pb2.SamplingParams(**case["sampling"]),
        stopping=generation_pb2.StoppingCriteria(**case["stopping"]),
        **fields,
    )


def _call(stub, request: generation_pb2.GenerateRequest) -> list[generation_pb2.GenerateResponse]:
    return list(stub.Generate(request, timeout=60))


def _tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def _logprobs(responses) -> list[tuple[int, float, tuple[int, ...]]]:
    return [
        (e.sampled.token_id, e.sampled.logprob, tuple(t.token_id for t in e.top)) for r in responses for e in r.logprobs
    ]


@pytest.fixture(scope="module")
def stub(tiny_system):
    with grpc.insecure_channel(tiny_system.target) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _with_stop_string(stub, case: dict) -> dict:
    """The case plus a stop string found in the middle of its fault-free text, spanning several tokens."""
    text = "".join(r.text for r in _call(stub, _request(case)))
    middle = len(text) // 2
    stop = text[middle : middle + 4]
    assert len(stop) == 4 and text.find(stop) == middle, "pick another seed: the stop string occurs earlier"
    return {**case, "stopping": {**case["stopping"], "stop": [stop]}}


def _cases(stub) -> dict[str, dict]:
    return {**CASES, "stop-string": _with_stop_string(stub, CASES["seeded"])}


@pytest.mark.parametrize("name", [*CASES, "stop-string"])
def test_resuming_after_any_response_continues_the_fault_free_stream(stub, name):
    case = _cases(stub)[name]
    fault_free = _call(stub, _request(case, request_id=f"ff-{name}"))
    seed = fault_free[0].seed
    assert fault_free[0].HasField("seed") and fault_free[-1].finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
    assert [r.output_index for r in fault_free] == [len(_tokens(fault_free[:j])) for j in range(len(fault_free))]
    for j in range(len(fault_free) + 1):
        delivered = _tokens(fault_free[:j])
        request = _request(case, request_id=f"ff-{name}")
        request.sampling.seed = seed
        request.resume.request_id = f"ff-{name}"
        request.resume.delivered_token_ids.extend(delivered)
        resumed = _call(stub, request)
        where = f"resumed after response {j} ({len(delivered)} tokens)"
        assert delivered + _tokens(resumed) == _tokens(fault_free), where
        assert "".join(r.text for r in fault_free[:j] + resumed) == "".join(r.text for r in fault_free), where
        assert (resumed[0].output_index, resumed[0].seed, list(resumed[0].prompt_token_ids)) == (
            len(delivered),
            seed,
            PROMPT,
        )
        expected_logprobs = _logprobs(fault_free[j:])
        got_logprobs = _logprobs(resumed)
        assert [(t, top) for t, _, top in got_logprobs] == [(t, top) for t, _, top in expected_logprobs], where
        assert [lp for _, lp, _ in got_logprobs] == pytest.approx([lp for _, lp, _ in expected_logprobs], abs=1e-4)
        last, expected_last = resumed[-1], fault_free[-1]
        assert (last.finish_reason, last.stop_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == (
            expected_last.finish_reason,
            expected_last.stop_reason,
            expected_last.usage.prompt_tokens,
            expected_last.usage.completion_tokens,
        ), where


@pytest.mark.parametrize(
    "stopping,delivered,prompt,message",
    [
        ({"max_tokens": 8}, [5, 384], PROMPT, "resume.delivered_token_ids: token id 384 is outside the vocabulary"),
        ({"max_tokens": 4}, [5, 6, 7, 8, 9], PROMPT, "resume.delivered_token_ids: 5 delivered tokens, more than"),
        ({}, [5] * 30, [7] * 1000, "resume.delivered_token_ids: prompt (1000 tokens) + delivered (30 tokens) exceeds"),
    ],
    ids=["outside-vocabulary", "more-than-max-tokens", "beyond-context"],
)
def test_bad_resume_input_is_invalid_argument_naming_the_field(stub, stopping, delivered, prompt, message):
    request = generation_pb2.GenerateRequest(
        request_id="bad-1",
        token_ids=generation_pb2.TokenIdsInput(token_ids=prompt),
        sampling=common_pb2.SamplingParams(seed=1),
        stopping=generation_pb2.StoppingCriteria(**stopping),
        resume=generation_pb2.ResumeFrom(request_id="bad-1", delivered_token_ids=delivered),
    )
    with pytest.raises(grpc.RpcError) as caught:
        _call(stub, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(message)
    after = _call(stub, _request(CASES["greedy"]))
    assert len(_tokens(after)) == 40
    status = stub.GetStatus(generation_pb2.GetStatusRequest(), timeout=10)
    assert status.num_running == 0 and status.num_waiting == 0
