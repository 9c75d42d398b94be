"""The sans-IO core's failover: targets, which failures resume a stream, where and when, and the request it sends.

Status codes are fakes (``FakeRpcError``), time is a fake clock and names
resolve through a fake resolver: every decision is checked exactly, no I/O.
"""

from __future__ import annotations

import grpc
import pytest
from test_core import FakeClock, FakeRpcError

from pagoda.channel import TlsConfig
from pagoda.v1 import generation_pb2
from pagoda_client import PagodaError
from pagoda_client.core.calls import CallState
from pagoda_client.core.requests import build_generate_request
from pagoda_client.core.retry import Deadline, RetryPolicy
from pagoda_client.core.stream import StreamState
from pagoda_client.core.targets import Endpoint, Targets, endpoint_options, parse_targets, split_host_port

UNAVAILABLE = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
POLICY = RetryPolicy(max_retries=2, initial_backoff_s=1.0, max_backoff_s=4.0, max_resumes=3)
NOT_RESUMED = [
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
]


class FakeResolver:
    """Names -> addresses, counting lookups; a name it does not know raises like getaddrinfo."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names
        self.lookups = 0

    def __call__(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        if host not in self.names:
            raise OSError(f"Name or service not known: {host}")
        return [f"{address}:{port}" for address in self.names[host]]


def _stream(targets: Targets, clock: FakeClock, timeout_s: float | None = 60.0, **options: object) -> StreamState:
    request = build_generate_request("Hi", {"max_tokens": 8, "stop": ["\n"], "temperature": 0.8, **options})
    return StreamState(request, policy=POLICY, deadline=Deadline(timeout_s, clock), jitter=lambda: 0.0, targets=targets)


def _response(index: int, token_ids: list[int], text: str, first: bool = False, **fields: object):
    response = generation_pb2.GenerateResponse(
        request_id="srv-1", text=text, token_ids=token_ids, output_index=index, **fields
    )
    if first:
        response.seed = 42
        response.prompt_token_ids.extend([1, 2, 3])
    return response


def _started(targets: Targets, clock: FakeClock, **options: object) -> StreamState:
    """A stream that has delivered two responses (tokens 7, 8, 9) from its first endpoint."""
    state = _stream(targets, clock, **options)
    state.next_endpoint()
    state.on_response(_response(0, [7, 8], "ab", first=True))
    state.on_response(_response(2, [9], "c"))
    return state


def test_targets_parse_from_a_comma_list_or_a_sequence():
    assert parse_targets(" a:1, b:2,,a:1 ") == ["a:1", "b:2"]
    assert parse_targets(["a:1", "b:2,c:3"]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError, match="no target address"):
        parse_targets(" , ")
    assert split_host_port("sched.local:50051") == ("sched.local", 50051)
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    assert [split_host_port(t) for t in ("dns:///a:1", "unix:/tmp/s", "a", "a:b")] == [None] * 4


def test_a_name_with_several_addresses_becomes_one_endpoint_each_keeping_its_name():
    resolver = FakeResolver({"sched": ["10.0.0.1", "10.0.0.2"], "single": ["10.0.0.9"]})
    targets = Targets("sched:50051,single:7,127.0.0.1:9,unknown:5", resolve=resolver)
    assert targets.endpoints == [
        Endpoint("10.0.0.1:50051", "sched:50051"),
        Endpoint("10.0.0.2:50051", "sched:50051"),
        Endpoint("single:7"),
        Endpoint("127.0.0.1:9"),
        Endpoint("unknown:5"),
    ]
    assert resolver.lookups == 3  # the IP literal is not looked up


def test_a_resolved_address_keeps_the_given_name_for_authority_and_tls():
    resolved = Endpoint("10.0.0.1:50051", "sched.example:50051")
    assert endpoint_options(resolved, False) == [("grpc.default_authority", "sched.example:50051")]
    assert endpoint_options(resolved, True) == [
        ("grpc.default_authority", "sched.example:50051"),
        ("grpc.ssl_target_name_override", "sched.example"),
    ]
    assert endpoint_options(resolved, TlsConfig(server_name_override="other")) == [
        ("grpc.default_authority", "sched.example:50051")
    ]
    assert endpoint_options(Endpoint("a:1"), True) == []


def test_new_calls_go_round_robin_over_endpoints_not_known_to_be_down():
    clock = FakeClock()
    targets = Targets("a:1,b:2,c:3", clock=clock)
    assert [_stream(targets, clock).next_endpoint().address for _ in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
    targets.mark_down(Endpoint("b:2"), POLICY, 0.0)  # down for 0.5 s
    assert [_stream(targets, clock).next_endpoint().address for _ in range(3)] == ["c:3", "a:1", "c:3"]
    clock.now += 0.5
    assert [_stream(targets, clock).next_endpoint().address for _ in range(3)] == ["a:1", "b:2", "c:3"]


def test_a_broken_stream_resumes_at_once_on_the_next_address_with_the_resume_request():
    clock = FakeClock()
    targets = Targets("a:1,b:2", clock=clock)
    state = _started(targets, clock, request_id=None)
    assert state.backoff_s(UNAVAILABLE) == 0.0 and not state.done
    assert (state.num_resumes, state.num_retries) == (1, 0)
    assert state.next_endpoint() == Endpoint("b:2")
    request = state.next_request()
    expected = generation_pb2.GenerateRequest()
    expected.CopyFrom(state.generate_request)
    expected.request_id = "srv-1"
    expected.sampling.seed = 42
    expected.resume.request_id = "srv-1"
    expected.resume.delivered_token_ids.extend([7, 8, 9])
    assert request == expected
    assert state.generate_request.request_id == "" and not state.generate_request.HasField("resume")


def test_the_application_sees_one_stream_across_a_resume():
    clock = FakeClock()
    targets = Targets("a:1,b:2", clock=clock)
    state = _started(targets, clock)
    state.backoff_s(UNAVAILABLE)
    state.next_endpoint()
    again = state.on_response(_response(3, [10], "d", first=True))
    assert (again.prompt_token_ids, again.seed, again.output_index) == ((), None, 3)
    last = state.on_response(_response(4, [11], "e", finish_reason=generation_pb2.FINISH_REASON_STOP, stop_reason="\n"))
    assert last.finish_reason is not None
    result = state.result
    assert (result.text, result.token_ids, result.prompt_token_ids, result.seed) == (
        "abcde",
        [7, 8, 9, 10, 11],
        [1, 2, 3],
        42,
    )
    state.on_end()
    assert state.done


def test_a_single_address_is_resumed_after_a_growing_backoff():
    clock = FakeClock()
    targets = Targets("a:1", clock=clock)
    state = _started(targets, clock)
    assert state.backoff_s(UNAVAILABLE) == 0.5  # 1.0 * 2**0, lowest jitter
    assert state.next_endpoint() == Endpoint("a:1")
    assert state.backoff_s(UNAVAILABLE) == 1.0
    clock.now += 1.0
    assert state.backoff_s(UNAVAILABLE) == 2.0
    with pytest.raises(PagodaError) as caught:  # max_resumes=3
        state.backoff_s(UNAVAILABLE)
    assert (caught.value.code, caught.value.request_id, state.done) == (grpc.StatusCode.UNAVAILABLE, "srv-1", True)


def test_a_response_marks_its_address_up_again():
    clock = FakeClock()
    targets = Targets("a:1,b:2", clock=clock)
    targets.mark_down(Endpoint("a:1"), POLICY, 0.0)
    targets.mark_down(Endpoint("a:1"), POLICY, 0.0)
    state = _stream(targets, clock)
    assert state.next_endpoint() == Endpoint("b:2")
    assert targets.wait_s() == 0.0
    targets.mark_down(Endpoint("b:2"), POLICY, 0.0)
    assert targets.wait_s() == 0.5  # b:2 is back first; a:1 is down for 1 s
    state.on_response(_response(0, [7], "a", first=True))
    assert targets.wait_s() == 0.0 and _stream(targets, clock).next_endpoint() == Endpoint("b:2")


@pytest.mark.parametrize("code", NOT_RESUMED)
def test_application_errors_are_never_resumed_or_retried(code):
    clock = FakeClock()
    for state in (_started(Targets("a:1,b:2", clock=clock), clock), _stream(Targets("a:1,b:2"), clock)):
        with pytest.raises(PagodaError) as caught:
            state.backoff_s(FakeRpcError(code, "no"))
        assert (caught.value.code, state.done, state.num_resumes, state.num_retries) == (code, True, 0, 0)


def test_a_stream_from_a_server_that_sent_no_seed_is_not_resumed():
    clock = FakeClock()
    state = _stream(Targets("a:1,b:2", clock=clock), clock)
    state.on_response(generation_pb2.GenerateResponse(request_id="old", text="x", token_ids=[5]))
    with pytest.raises(PagodaError) as caught:
        state.backoff_s(UNAVAILABLE)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and state.num_resumes == 0


def test_the_deadline_bounds_the_resumes():
    clock = FakeClock()
    state = _started(Targets("a:1", clock=clock), clock)
    clock.now += 59.8
    assert state.backoff_s(UNAVAILABLE) == pytest.approx(0.2)  # capped by what is left
    clock.now += 0.2
    with pytest.raises(PagodaError) as caught:
        state.timeout_s()
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and state.done


def test_a_break_after_the_final_response_ends_the_stream():
    clock = FakeClock()
    state = _started(Targets("a:1,b:2", clock=clock), clock)
    state.on_response(_response(3, [10], "d", finish_reason=generation_pb2.FINISH_REASON_LENGTH))
    assert state.backoff_s(UNAVAILABLE) == 0.0 and state.done and state.num_resumes == 0


@pytest.mark.parametrize(
    "response,message",
    [
        (_response(2, [10], "d"), "a response starts at output index 2, not 3"),
        (_response(4, [10], "d"), "a response starts at output index 4, not 3"),
        (generation_pb2.GenerateResponse(request_id="srv-1", output_index=3, seed=41), "has seed 41, not 42"),
    ],
)
def test_a_response_that_does_not_continue_the_stream_is_a_protocol_error(response, message):
    clock = FakeClock()
    state = _started(Targets("a:1,b:2", clock=clock), clock)
    state.backoff_s(UNAVAILABLE)
    state.next_endpoint()
    with pytest.raises(PagodaError, match="protocol error: .*" + message.replace("(", r"\(")) as caught:
        state.on_response(response)
    assert caught.value.code == grpc.StatusCode.INTERNAL and state.done
    assert state.result.token_ids == [7, 8, 9]


def test_names_are_resolved_again_when_every_address_failed():
    clock = FakeClock()
    resolver = FakeResolver({"sched": ["10.0.0.1", "10.0.0.2"]})
    targets = Targets("sched:50051", resolve=resolver, clock=clock)
    clock.now += 1.0
    state = _started(targets, clock)
    assert state.endpoint == Endpoint("10.0.0.1:50051", "sched:50051")
    assert state.backoff_s(UNAVAILABLE) == 0.0 and resolver.lookups == 1  # 10.0.0.2 is up
    state.next_endpoint()
    resolver.names["sched"] = ["10.0.0.2", "10.0.0.3"]
    clock.now += 0.4  # 10.0.0.1 is down for 0.5 s
    assert state.backoff_s(UNAVAILABLE) == 0.0 and resolver.lookups == 2  # both down: looked up again
    assert state.next_endpoint() == Endpoint("10.0.0.3:50051", "sched:50051")
    assert [e.address for e in targets.endpoints] == ["10.0.0.2:50051", "10.0.0.3:50051"]
    assert state.backoff_s(UNAVAILABLE) > 0 and resolver.lookups == 2  # all down, but looked up just now


def test_a_unary_call_retries_on_the_next_address():
    clock = FakeClock()
    targets = Targets("a:1,b:2", clock=clock)
    state = CallState(
        generation_pb2.GetStatusRequest(), str, policy=POLICY, deadline=Deadline(5.0, clock), targets=targets
    )
    assert state.next_endpoint() == Endpoint("a:1")
    assert state.backoff_s(UNAVAILABLE) == 0.0 and state.num_retries == 1
    assert state.next_endpoint() == Endpoint("b:2")
