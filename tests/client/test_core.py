"""The sans-IO core: retry decisions on a fake clock, stream state, request building from the table."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from pagoda import params
from pagoda.v1 import generation_pb2
from pagoda_client import PagodaError
from pagoda_client.core.calls import CallState
from pagoda_client.core.kinds import kind_of
from pagoda_client.core.requests import build_generate_request, check_option_names
from pagoda_client.core.retry import Deadline, RetryPolicy
from pagoda_client.core.session import ClientCore
from pagoda_client.core.stream import StreamState
from pagoda_client.results import FinishReason


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRpcError(grpc.RpcError):
    """An RpcError with a chosen status, as grpc raises them."""

    def __init__(self, code: grpc.StatusCode, details: str = "boom") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _state(clock: FakeClock, timeout_s: float | None = 10.0, max_retries: int = 2) -> CallState[str]:
    policy = RetryPolicy(max_retries=max_retries, initial_backoff_s=1.0, max_backoff_s=3.0)
    return CallState(
        generation_pb2.GetStatusRequest(),
        str,
        policy=policy,
        deadline=Deadline(timeout_s, clock),
        request_id="r-7",
        jitter=lambda: 0.0,
    )


def test_unavailable_is_retried_with_growing_backoff_until_attempts_run_out():
    clock = FakeClock()
    state = _state(clock, max_retries=2)
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert state.backoff_s(unavailable) == 0.5  # 1.0 * 2**0, lowest jitter
    assert state.backoff_s(unavailable) == 1.0  # 1.0 * 2**1
    assert not state.done and state.num_retries == 2
    with pytest.raises(PagodaError) as caught:
        state.backoff_s(unavailable)
    assert (caught.value.code, caught.value.message, caught.value.request_id) == (
        grpc.StatusCode.UNAVAILABLE,
        "connection refused",
        "r-7",
    )
    assert state.done


def test_backoff_is_capped_by_the_ceiling_and_by_the_deadline():
    policy = RetryPolicy(max_retries=10, initial_backoff_s=1.0, max_backoff_s=3.0)
    assert [policy.backoff_s(n, unit=0.999999) for n in range(4)] == pytest.approx([1.0, 2.0, 3.0, 3.0], abs=1e-5)
    clock = FakeClock()
    state = _state(clock, timeout_s=0.7)
    assert state.backoff_s(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == 0.5
    clock.now += 0.5
    assert state.backoff_s(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == pytest.approx(0.2)  # what is left
    clock.now += 0.2
    with pytest.raises(PagodaError) as caught:
        state.timeout_s()
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and state.done


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED],
)
def test_other_codes_are_not_retried(code):
    state = _state(FakeClock())
    with pytest.raises(PagodaError) as caught:
        state.backoff_s(FakeRpcError(code, "no"))
    assert caught.value.code == code and state.done and state.num_retries == 0


def test_nothing_is_retried_after_a_response_arrived():
    state = _state(FakeClock())
    assert state.on_response(7) == "7"
    assert not state.retryable(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(PagodaError):
        state.backoff_s(FakeRpcError(grpc.StatusCode.UNAVAILABLE))


def test_attempt_timeout_is_what_is_left_of_the_deadline():
    clock = FakeClock()
    state = _state(clock, timeout_s=10.0)
    clock.now += 4.0
    assert state.timeout_s() == pytest.approx(6.0)
    assert _state(clock, timeout_s=None).timeout_s() is None


def test_core_applies_the_call_timeout_over_the_client_default():
    clock = FakeClock()
    core = ClientCore(timeout=30.0, api_key="k", clock=clock)
    assert core.generate("hi", {}).timeout_s() == 30.0
    state = core.generate("hi", {"timeout": 2.5, "request_id": "r1"})
    assert state.timeout_s() == 2.5
    assert state.metadata == (("authorization", "Bearer k"), ("x-request-id", "r1"))
    with pytest.raises(TypeError, match="timeout"):
        core.generate("hi", {"timeout": "soon"})


@pytest.mark.parametrize("settings", [{"max_retries": -1}, {"initial_backoff_s": -0.1}])
def test_negative_retry_settings_are_refused(settings):
    with pytest.raises(ValueError, match="negative"):
        RetryPolicy(**settings)


def _response(**fields) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(**fields)


def test_stream_state_folds_deltas_and_knows_what_was_delivered():
    request = build_generate_request(None, {"token_ids": [7, 8], "max_tokens": 3})
    state = StreamState(request, policy=RetryPolicy(), deadline=Deadline(None))
    assert state.request_id is None and state.delivered_token_ids == ()
    first = state.on_response(_response(request_id="srv-1", text="Hel", token_ids=[1, 2], prompt_token_ids=[7, 8]))
    assert first.token_ids == (1, 2) and state.delivered_token_ids == (1, 2)
    assert state.request_id == "srv-1" and state.result.request_id == "srv-1"
    assert not state.retryable(grpc.StatusCode.UNAVAILABLE)
    last = state.on_response(
        _response(
            request_id="srv-1",
            text="lo",
            token_ids=[3],
            finish_reason=generation_pb2.FINISH_REASON_LENGTH,
            usage=generation_pb2.Usage(prompt_tokens=2, completion_tokens=3),
        )
    )
    assert last.finish_reason is FinishReason.LENGTH
    assert (state.result.text, state.result.token_ids, state.result.prompt_token_ids) == ("Hello", [1, 2, 3], [7, 8])
    assert state.delivered_token_ids == (1, 2, 3) and state.num_responses == 2
    assert state.result.usage.completion_tokens == 3
    assert state.next_request() is request
    state.on_end()
    assert state.done


def test_stream_state_keeps_the_given_request_id():
    request = build_generate_request("hi", {"request_id": "mine"})
    state = StreamState(request, policy=RetryPolicy(), deadline=Deadline(None))
    assert state.request_id == "mine" == state.result.request_id
    state.on_response(_response(text="x", token_ids=[4]))
    assert state.request_id == "mine"


def _sample_value(row: params.ParamField) -> object:
    kind = kind_of(row)
    sample = {float: 0.5, int: 3, bool: True, str: "s"}[kind.scalar]
    return [sample, sample] if kind.repeated else sample


def test_every_table_row_is_sent_on_its_groups_message():
    rows = list(params.fields())
    options = {row.name: _sample_value(row) for row in rows}
    request = build_generate_request("hi", options)
    for row in rows:
        sent = getattr(getattr(request, row.group), row.name)
        assert (list(sent) if kind_of(row).repeated else sent) == options[row.name], row.name


def test_unset_options_are_not_sent():
    request = build_generate_request("hi", {name: None for name in params.names()})
    for group in ("sampling", "stopping"):
        assert getattr(request, group).ListFields() == [], group


def test_unknown_option_names_raise_type_error_naming_them():
    with pytest.raises(TypeError, match="unknown generation options: bogus, temprature"):
        build_generate_request("hi", {"temprature": 0.5, "bogus": 1, "seed": 3})


def test_a_value_of_the_wrong_type_names_its_parameter():
    with pytest.raises(TypeError, match="max_tokens must be int"):
        build_generate_request("hi", {"max_tokens": "ten"})
    with pytest.raises(TypeError, match="stop_token_ids must be Sequence"):
        build_generate_request("hi", {"stop_token_ids": ["a"]})


def test_a_bare_stop_string_is_one_stop_string():
    request = build_generate_request("hi", {"stop": "\n\n"})
    assert list(request.stopping.stop) == ["\n\n"]


def test_option_names_come_from_the_table_at_call_time(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Sampling(params.SamplingParams):
        typical_p: float = params.param(1.0, params.Param(10, "optional float", "locally typical mass"))

    with pytest.raises(TypeError, match="typical_p"):
        check_option_names(["typical_p"])
    monkeypatch.setitem(params.PARAM_CLASSES, "sampling", Sampling)
    check_option_names(["typical_p", "temperature", "priority", "token_ids"])
    monkeypatch.setitem(params.PARAM_CLASSES, "stopping", _without(params.StoppingCriteria, "ignore_eos"))
    with pytest.raises(TypeError, match="unknown generation options: ignore_eos"):
        build_generate_request("hi", {"ignore_eos": True})


def _without(cls: type, name: str) -> type:
    """A copy of a table dataclass without one row."""
    kept = [(f.name, f.type, f) for f in dataclasses.fields(cls) if f.name != name]
    return dataclasses.make_dataclass(cls.__name__, kept, frozen=True)
