"""A table of hostile requests, each with the gRPC status it must get.

Raw protos (or raw bytes) go straight through a grpc channel, so the client
library's own checks cannot interfere. Afterwards the service must answer a
normal request exactly as before, and the KV pool must be whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc
import pytest
from support.pool import wait_pool_whole
from support.system import fp32_launcher

from pagoda.v1 import generation_pb2 as g
from pagoda.v1 import generation_pb2_grpc
from pagoda_client import Client

pytestmark = pytest.mark.integration
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
VOCAB, CONTEXT, MAX_NEW = 384, 1024, 512
INT32_MIN, INT32_MAX, UINT64_MAX = -(2**31), 2**31 - 1, 2**64 - 1
PROMPT = [5, 17, 42, 99, 7, 300, 12]
GENERATE = "/pagoda.v1.Generation/Generate"


@pytest.fixture(scope="module")
def system(security_model_dir, tmp_path_factory):
    args = ["--max-message-bytes", "64KiB", "--max-new-tokens", str(MAX_NEW)]
    with fp32_launcher(
        security_model_dir, tmp_path_factory.mktemp("hostile-logs"), extra_scheduler_args=args
    ) as launched:
        yield launched


def req(**fields) -> g.GenerateRequest:
    """A small valid request (greedy, 2 tokens) with `fields` set on top."""
    msg = g.GenerateRequest(token_ids=g.TokenIdsInput(token_ids=PROMPT))
    msg.sampling.temperature = 0.0
    msg.stopping.max_tokens = 2
    for path, value in fields.items():
        *parents, name = path.split("__")
        target = msg
        for parent in parents:
            target = getattr(target, parent)
        if name in ("text", "token_ids", "chat"):
            _set_input(msg, name, value)
        elif isinstance(value, (list, tuple)):
            del getattr(target, name)[:]
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return msg


def _set_input(msg: g.GenerateRequest, name: str, value) -> None:
    if name == "text":
        msg.text = value
    elif name == "token_ids":
        msg.token_ids.CopyFrom(g.TokenIdsInput(token_ids=value))  # sets the oneof even when empty
    else:
        msg.chat.CopyFrom(value)


def chat(*messages: tuple[str, str]) -> g.ChatInput:
    return g.ChatInput(messages=[g.ChatMessage(role=r, content=c) for r, c in messages])


def no_input() -> g.GenerateRequest:
    msg = req()
    msg.ClearField("token_ids")
    return msg


def raw(base: g.GenerateRequest, extra: bytes) -> bytes:
    """`base` serialized, then `extra` wire bytes appended (later fields win)."""
    return base.SerializeToString() + extra


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


BAD_UTF8 = b"ok \xff\xfe \xc3\x28 \xed\xa0\x80"  # invalid start bytes, bad continuation, a surrogate
# GenerateRequest fields: text=2, chat=4 (ChatInput.messages=1: role=1, content=2), stopping=6 (stop=2)
CASES: list[tuple[str, Callable[[], object], grpc.StatusCode]] = [
    # --- input ---
    ("no-input", no_input, INVALID),
    ("empty-text", lambda: req(text=""), INVALID),
    ("empty-token-ids", lambda: req(token_ids=[]), INVALID),
    ("text-over-prompt-limit", lambda: req(text="fox jumps " * 1500), INVALID),
    ("token-ids-over-prompt-limit", lambda: req(token_ids=[5] * CONTEXT), INVALID),
    ("token-id-equal-to-vocab", lambda: req(token_ids=[5, VOCAB, 6]), INVALID),
    ("token-id-negative", lambda: req(token_ids=[5, -1]), INVALID),
    ("token-id-int32-max", lambda: req(token_ids=[INT32_MAX]), INVALID),
    ("token-id-int32-min", lambda: req(token_ids=[INT32_MIN]), INVALID),
    ("chat-no-messages", lambda: req(chat=g.ChatInput()), INVALID),
    ("chat-empty-role", lambda: req(chat=chat(("user", "hi"), ("", "who am I"))), INVALID),
    ("chat-huge-content", lambda: req(chat=chat(("user", "lazy dog " * 2000))), INVALID),
    ("text-invalid-utf8", lambda: raw(no_input(), field(2, BAD_UTF8)), INVALID),
    (
        "chat-content-invalid-utf8",
        lambda: raw(no_input(), field(4, field(1, field(1, b"user") + field(2, BAD_UTF8)))),
        INVALID,
    ),
    ("stop-string-invalid-utf8", lambda: raw(req(), field(6, field(2, BAD_UTF8))), INVALID),
    ("request-id-invalid-utf8", lambda: raw(req(), field(1, BAD_UTF8)), INVALID),
    ("truncated-message", lambda: req(text="hello world").SerializeToString()[:-3], INVALID),
    ("wrong-wire-type", lambda: raw(req(), _varint(2 << 3 | 5) + b"\x01\x02"), INVALID),
    ("deeply-nested-groups", lambda: raw(req(), _varint(99 << 3 | 3) * 200 + _varint(99 << 3 | 4) * 200), INVALID),
    ("unknown-fields-ignored", lambda: raw(req(), field(99, b"junk") + _varint(98 << 3) + _varint(7)), OK),
    ("bool-out-of-range-varint", lambda: raw(req(), field(6, _varint(4 << 3) + _varint(UINT64_MAX))), OK),
    # --- sampling ---
    ("temperature-nan", lambda: req(sampling__temperature=math.nan), INVALID),
    ("temperature-inf", lambda: req(sampling__temperature=math.inf), INVALID),
    ("temperature-negative", lambda: req(sampling__temperature=-0.5), INVALID),
    ("temperature-tiny", lambda: req(sampling__temperature=1e-30), OK),
    ("temperature-huge", lambda: req(sampling__temperature=3e38), OK),
    ("top-p-zero", lambda: req(sampling__top_p=0.0), INVALID),
    ("top-p-above-one", lambda: req(sampling__top_p=1.5), INVALID),
    ("top-p-nan", lambda: req(sampling__top_p=math.nan), INVALID),
    ("top-p-negative", lambda: req(sampling__top_p=-0.1), INVALID),
    ("top-k-negative", lambda: req(sampling__top_k=-2), INVALID),
    ("top-k-int32-min", lambda: req(sampling__top_k=INT32_MIN), INVALID),
    ("top-k-above-vocab", lambda: req(sampling__temperature=1.0, sampling__top_k=INT32_MAX), OK),
    ("min-p-negative", lambda: req(sampling__min_p=-0.1), INVALID),
    ("min-p-above-one", lambda: req(sampling__min_p=1.5), INVALID),
    ("min-p-nan", lambda: req(sampling__min_p=math.nan), INVALID),
    ("repetition-penalty-zero", lambda: req(sampling__repetition_penalty=0.0), INVALID),
    ("repetition-penalty-negative", lambda: req(sampling__repetition_penalty=-1.0), INVALID),
    ("repetition-penalty-inf", lambda: req(sampling__repetition_penalty=math.inf), INVALID),
    ("presence-penalty-above-two", lambda: req(sampling__presence_penalty=2.5), INVALID),
    ("frequency-penalty-below-minus-two", lambda: req(sampling__frequency_penalty=-3.0), INVALID),
    ("presence-penalty-nan", lambda: req(sampling__presence_penalty=math.nan), INVALID),
    ("frequency-penalty-minus-inf", lambda: req(sampling__frequency_penalty=-math.inf), INVALID),
    ("seed-uint64-max", lambda: req(sampling__seed=UINT64_MAX), INVALID),
    ("seed-2-to-63", lambda: req(sampling__seed=2**63), INVALID),
    ("seed-largest-accepted", lambda: req(sampling__temperature=1.0, sampling__seed=2**63 - 1), OK),
    ("logprobs-too-many", lambda: req(sampling__logprobs=21), INVALID),
    ("logprobs-negative", lambda: req(sampling__logprobs=-1), INVALID),
    ("logprobs-int32-max", lambda: req(sampling__logprobs=INT32_MAX), INVALID),
    ("logprobs-most-accepted", lambda: req(sampling__logprobs=20), OK),
    # --- stopping ---
    ("max-tokens-zero", lambda: req(stopping__max_tokens=0), INVALID),
    ("max-tokens-negative", lambda: req(stopping__max_tokens=-1), INVALID),
    ("max-tokens-int32-max", lambda: req(stopping__max_tokens=INT32_MAX), INVALID),
    ("max-tokens-above-limit", lambda: req(stopping__max_tokens=MAX_NEW + 1), INVALID),
    ("prompt-plus-max-tokens-over-context", lambda: req(token_ids=[5] * 600, stopping__max_tokens=500), INVALID),
    ("too-many-stop-strings", lambda: req(stopping__stop=[f"s{i}" for i in range(17)]), INVALID),
    ("huge-stop-list", lambda: req(stopping__stop=["a"] * 10_000), INVALID),
    ("stop-string-too-long", lambda: req(stopping__stop=["x" * 257]), INVALID),
    ("empty-stop-string", lambda: req(stopping__stop=["ok", ""]), INVALID),
    ("stop-token-id-out-of-vocab", lambda: req(stopping__stop_token_ids=[VOCAB]), INVALID),
    ("stop-token-id-negative", lambda: req(stopping__stop_token_ids=[-1]), INVALID),
    ("too-many-stop-token-ids", lambda: req(stopping__stop_token_ids=list(range(17))), INVALID),
    # --- other fields ---
    ("priority-int32-min", lambda: req(priority=INT32_MIN), INVALID),
    ("priority-int32-max", lambda: req(priority=INT32_MAX), OK),
    ("priority-most-urgent-accepted", lambda: req(priority=-INT32_MAX), OK),
    ("cache-salt-too-long", lambda: req(cache_salt="s" * 257), INVALID),
    ("request-id-too-long", lambda: req(request_id="r" * 257), INVALID),
    ("request-id-control-characters", lambda: req(request_id='evil\n{"level": "error"}\x00'), OK),
    # --- transport ---
    ("message-over-max-message-bytes", lambda: req(text="x" * (65 * 1024)), grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def _send(channel: grpc.Channel, request: object, timeout_s: float = 60) -> tuple[grpc.StatusCode, list]:
    """One Generate with raw bytes (already serialized, or a proto)."""
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=g.GenerateResponse.FromString)
    try:
        return OK, list(call(payload, timeout=timeout_s))
    except grpc.RpcError as error:
        return error.code(), []


def _greedy(client: Client) -> list[int]:
    return client.generate(token_ids=PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({name for name, _, _ in CASES}) == len(CASES)


def test_hostile_requests_get_their_status_and_change_nothing(system):
    with Client(system.target, timeout=60) as client, grpc.insecure_channel(system.target) as channel:
        before = _greedy(client)
        wrong = {}
        for name, build, expected in CASES:
            code, responses = _send(channel, build())
            if code != expected:
                wrong[name] = (code, expected)
            elif code == OK:
                assert responses and responses[-1].finish_reason != g.FINISH_REASON_UNSPECIFIED, name
        assert not wrong, f"wrong status (got, expected): {wrong}"
        assert _greedy(client) == before
        wait_pool_whole(client, 10)
        assert system.dead_child() is None
        assert "Traceback" not in system.logs()["scheduler"]


def test_deadline_already_passed(system):
    with grpc.insecure_channel(system.target) as channel:
        code, _ = _send(channel, req(stopping__max_tokens=64), timeout_s=1e-6)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_other_rpcs_refuse_hostile_input(system):
    with grpc.insecure_channel(system.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = {
            "detokenize-out-of-vocab": lambda: stub.Detokenize(g.DetokenizeRequest(token_ids=[1, VOCAB])),
            "detokenize-negative": lambda: stub.Detokenize(g.DetokenizeRequest(token_ids=[-7])),
            "tokenize-no-input": lambda: stub.Tokenize(g.TokenizeRequest()),
            "tokenize-chat-empty-role": lambda: stub.Tokenize(g.TokenizeRequest(chat=chat(("", "x")))),
        }
        codes = {}
        for name, call in calls.items():
            try:
                call()
                codes[name] = OK
            except grpc.RpcError as error:
                codes[name] = error.code()
        raw_tokenize = channel.unary_unary(
            "/pagoda.v1.Generation/Tokenize",
            request_serializer=None,
            response_deserializer=g.TokenizeResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            raw_tokenize(field(1, BAD_UTF8), timeout=10)
        codes["tokenize-invalid-utf8"] = info.value.code()
    assert codes == dict.fromkeys(codes, INVALID)


def test_hostile_requests_on_one_multiplexed_call(system):
    """Every hostile request of the table as a stream of one GenerateStreams call, beside a good stream: each
    ends with its status, the good one runs to its end, and the service is unchanged."""
    cases = [(name, build()) for name, build, expected in CASES if expected in (OK, INVALID)]
    cases = [(name, request) for name, request in cases if not isinstance(request, bytes)]
    assert len(cases) >= 40
    good = req(stopping__max_tokens=24, stopping__ignore_eos=True)
    messages = [g.StreamRequest(stream=key, generate=request) for key, (_, request) in enumerate(cases, start=1)]
    messages.insert(len(messages) // 2, g.StreamRequest(stream=10_000, generate=good))
    with Client(system.target, timeout=60) as client, grpc.insecure_channel(system.target) as channel:
        before = _greedy(client)
        stub = generation_pb2_grpc.GenerationStub(channel)
        items = [item for message in stub.GenerateStreams(iter(messages), timeout=120) for item in message.responses]
        ends = {item.stream: item.end.code for item in items if item.HasField("end")}
        expected = {name: build_expected for name, _, build_expected in CASES}
        wrong = {
            name: (ends.get(key), expected[name].value[0])
            for key, (name, _) in enumerate(cases, start=1)
            if ends.get(key) != expected[name].value[0]
        }
        assert not wrong, f"wrong status (got, expected): {wrong}"
        tokens = [
            t for item in items if item.stream == 10_000 and item.HasField("response") for t in item.response.token_ids
        ]
        assert len(tokens) == 24 and ends[10_000] == 0
        assert _greedy(client) == before
        wait_pool_whole(client, 10)
        assert system.dead_child() is None
        assert "Traceback" not in system.logs()["scheduler"]


def test_multiplexed_messages_stay_within_the_message_limit(system):
    """With --max-message-bytes 64KiB: first responses that together exceed it leave in several messages, and
    a response that alone exceeds it ends its own stream (RESOURCE_EXHAUSTED), not the call's other streams."""
    streams = []
    for key in range(1, 17):  # prompt logprobs of 120 tokens: ~8 KB per first response, ~128 KB in all
        streams.append(req(token_ids=[(key * 7 + i) % 300 + 3 for i in range(120)], sampling__prompt_logprobs=5))
    huge = req(token_ids=[(11 * i) % 300 + 3 for i in range(450)], sampling__prompt_logprobs=20)
    messages = [g.StreamRequest(stream=key, generate=request) for key, request in enumerate(streams, start=1)]
    messages.insert(8, g.StreamRequest(stream=99, generate=huge))
    with grpc.insecure_channel(system.target) as channel:
        call = channel.stream_stream(
            "/pagoda.v1.Generation/GenerateStreams",
            request_serializer=g.StreamRequest.SerializeToString,
            response_deserializer=None,
        )
        raw = list(call(iter(messages), timeout=120))
    assert max(len(message) for message in raw) <= 64 * 1024
    items = [item for message in raw for item in g.StreamResponses.FromString(message).responses]
    ends = {item.stream: item.end for item in items if item.HasField("end")}
    assert ends[99].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "message limit" in ends[99].message
    assert all(ends[key].code == 0 for key in range(1, 17)), ends
    firsts = [item.response for item in items if item.HasField("response") and item.response.prompt_logprobs]
    assert len(firsts) == 16 and all(len(first.prompt_logprobs) == 119 for first in firsts)
    firsts_per_message = [
        sum(1 for item in g.StreamResponses.FromString(m).responses if item.response.prompt_logprobs) for m in raw
    ]
    assert sum(1 for n in firsts_per_message if n) >= 2, "the first responses should not fit in one message"
    with Client(system.target, timeout=60) as client:
        wait_pool_whole(client, 10)
