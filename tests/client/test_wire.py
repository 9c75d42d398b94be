"""Request building, metadata, retry policy and the health codec."""

from __future__ import annotations

import grpc
import pytest

from pagoda.launch.health import ServingStatus, decode_response, encode_request
from pagoda.v1 import generation_pb2
from pagoda_client.core import convert, requests
from pagoda_client.core.retry import RetryPolicy
from pagoda_client.errors import PagodaError
from pagoda_client.results import FinishReason, GenerationResult

_DEFAULTS = dict(
    prompt=None,
    token_ids=None,
    messages=None,
    max_tokens=None,
    temperature=None,
    top_p=None,
    top_k=None,
    min_p=None,
    repetition_penalty=None,
    presence_penalty=None,
    frequency_penalty=None,
    seed=None,
    logprobs=None,
    stop=None,
    stop_token_ids=None,
    ignore_eos=False,
    include_stop_str_in_output=False,
    priority=0,
    cache_salt="",
    request_id=None,
    skip_special_tokens=None,
)


def _request(**overrides) -> generation_pb2.GenerateRequest:
    options = {**_DEFAULTS, **overrides}
    return requests.build_generate_request(options.pop("prompt"), options)


def test_text_request_sets_only_given_fields():
    request = _request(prompt="hi", max_tokens=5, temperature=0.0, seed=7, stop="x", request_id="r1")
    assert request.WhichOneof("input") == "text" and request.text == "hi"
    assert request.request_id == "r1"
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.seed == 7
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("logprobs")
    assert request.stopping.max_tokens == 5 and list(request.stopping.stop) == ["x"]
    assert not request.HasField("skip_special_tokens")


def test_token_ids_and_chat_requests():
    request = _request(token_ids=[3, 4, 5], ignore_eos=True, stop_token_ids=[9], logprobs=0, priority=-2)
    assert list(request.token_ids.token_ids) == [3, 4, 5]
    assert request.stopping.ignore_eos and list(request.stopping.stop_token_ids) == [9]
    assert request.sampling.HasField("logprobs") and request.sampling.logprobs == 0
    assert request.priority == -2
    request = _request(messages=[{"role": "user", "content": "hey"}], skip_special_tokens=False)
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "hey")]
    assert request.HasField("skip_special_tokens") and not request.skip_special_tokens
    assert not request.stopping.HasField("max_tokens")


@pytest.mark.parametrize("inputs", [{}, {"prompt": "a", "token_ids": [1]}, {"prompt": "a", "messages": []}])
def test_exactly_one_input(inputs):
    with pytest.raises(ValueError):
        _request(**inputs)


def test_metadata():
    assert requests.call_metadata(None) == ()
    assert requests.call_metadata("k", "r9") == (("authorization", "Bearer k"), ("x-request-id", "r9"))


def test_backoff_grows_and_is_bounded():
    policy = RetryPolicy(max_retries=3, initial_backoff_s=0.2, max_backoff_s=1.0)
    for attempt, ceiling in enumerate([0.2, 0.4, 0.8, 1.0, 1.0]):
        for _ in range(20):
            assert ceiling * 0.5 <= policy.backoff_s(attempt) <= ceiling
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 2)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, 3)
    assert not policy.should_retry(grpc.StatusCode.DEADLINE_EXCEEDED, 0)


def test_deltas_fold_into_a_result():
    first = generation_pb2.GenerateResponse(request_id="r", text="Hel", token_ids=[1, 2], prompt_token_ids=[7, 8])
    last = generation_pb2.GenerateResponse(
        request_id="r",
        text="lo",
        token_ids=[3],
        finish_reason=generation_pb2.FINISH_REASON_LENGTH,
        usage=generation_pb2.Usage(prompt_tokens=2, completion_tokens=3, cached_tokens=0),
        timings=generation_pb2.Timings(queue_ns=1_000_000, time_to_first_token_ns=5_000_000, total_ns=9_000_000),
    )
    result = GenerationResult()
    deltas = [convert.delta_from_pb(first), convert.delta_from_pb(last)]
    assert deltas[0].finish_reason is None and deltas[0].usage is None
    for delta in deltas:
        result.add(delta)
    assert (result.text, result.token_ids, result.prompt_token_ids) == ("Hello", [1, 2, 3], [7, 8])
    assert result.finish_reason == FinishReason.LENGTH == "length"
    assert result.usage.completion_tokens == 3
    assert result.timings.time_to_first_token_s == pytest.approx(0.005)
    assert result.to_dict()["finish_reason"] == "length"


def test_health_codec_matches_grpc_health():
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    for service in ["", "pagoda.v1.Generation", "x" * 300]:
        assert encode_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()
    for status in range(4):
        data = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        assert decode_response(data) == ServingStatus(status)


def test_error_carries_code_message_and_request_id():
    error = PagodaError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1", "r5")
    assert str(error) == "INVALID_ARGUMENT: max_tokens must be >= 1"
    assert (error.code, error.message, error.request_id) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be >= 1",
        "r5",
    )
