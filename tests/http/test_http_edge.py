"""The HTTP edge without executors: request parsing, error mapping, and the
server itself (auth, health, metrics, error shapes) over an Engine that has no
executor yet."""

from __future__ import annotations

import json

import aiohttp
import pytest

from pagoda import params
from pagoda.step import FinishReason
from scheduler_svc.api.http.errors import ApiError, from_request_error
from scheduler_svc.api.http.protocol import parse_chat, parse_completion, read_json
from scheduler_svc.api.http.responses import ChatFormatter, CompletionFormatter
from scheduler_svc.api.http.server import HttpApi
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.errors import DeadlineExceeded, InvalidRequest, Overloaded, Unavailable
from scheduler_svc.obs.metrics import SchedulerMetrics
from scheduler_svc.request import ChatMessage, RequestOutput, Usage


def _api_error(call, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args)
    return info.value


def test_completion_defaults_follow_openai():
    parsed = parse_completion({"model": "m", "prompt": "hi"}, "r1")
    assert parsed.generation.sampling["temperature"] == 1.0
    assert parsed.generation.stopping["max_tokens"] == 16
    assert parsed.generation.prompt.text == "hi"
    assert (parsed.stream, parsed.include_usage, parsed.model) == (False, False, "m")


def test_completion_parameters_map_onto_the_engine_request():
    body = {
        "prompt": [[5, 6, 7]],
        "max_tokens": 9,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 3,
        "stop": "x",
        "presence_penalty": 0.1,
        "frequency_penalty": -0.2,
        "logprobs": 2,
        "top_k": 4,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    g = parse_completion(body, "r").generation
    assert g.prompt.token_ids == (5, 6, 7)
    s = g.sampling
    assert (s["temperature"], s["top_p"], s["seed"], s["presence_penalty"], s["frequency_penalty"]) == (
        0.0,
        0.5,
        3,
        0.1,
        -0.2,
    )
    assert (s["logprobs"], s["top_k"], s["min_p"], s["repetition_penalty"]) == (2, 4, 0.05, 1.1)
    assert (g.stopping["max_tokens"], g.stopping["stop"], g.stopping["ignore_eos"]) == (9, ("x",), True)


def test_chat_parameters_and_messages():
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "stop": ["u", "v"],
    }
    parsed = parse_chat(body, "r")
    g = parsed.generation
    assert g.prompt.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", ""),
    )
    assert (g.stopping["max_tokens"], g.stopping["stop"], g.sampling["logprobs"]) == (7, ("u", "v"), 3)
    assert parsed.param_aliases == {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
    assert parse_chat({"messages": body["messages"], "logprobs": True}, "r").generation.sampling["logprobs"] == 0
    assert parse_chat({"messages": body["messages"]}, "r").generation.sampling.get("logprobs") is None


@pytest.mark.parametrize("row", [r for r in params.fields() if r.spec.http], ids=lambda r: r.name)
def test_every_plain_table_row_is_read_under_its_http_name(row):
    """Rows with an `http` name need no code here: a value of their type lands in the engine request."""
    spec = row.spec
    value = {"float": 0.5, "int": 3, "bool": True, "str": "x"}[spec.value_kind]
    body = {"prompt": "a", spec.http: [value, value] if spec.repeated else value}
    given = getattr(parse_completion(body, "r").generation, row.group)
    assert given[row.name] == ((value, value) if spec.repeated else value)
    wrong = {"prompt": "a", spec.http: {"not": "a value"}}
    err = _api_error(parse_completion, wrong, "r")
    assert (err.status, err.param) == (400, spec.http)
    if spec.http_unset is not None:
        assert getattr(parse_completion({"prompt": "a"}, "r").generation, row.group)[row.name] == spec.http_unset


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "a", "temperature": "hot"}, "temperature", "expected a number, got a string"),
        ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", "expected an integer"),
        ({"prompt": "a", "stream": "yes"}, "stream", "expected a boolean"),
        ({"prompt": "a", "n": 9}, "n", "must be in [1, 8]"),
        ({"prompt": "a", "n": 0}, "n", "must be in [1, 8]"),
        ({"prompt": "a", "best_of": 3}, "best_of", "best_of=1"),
        ({"prompt": "a", "echo": True}, "echo", "not supported"),
        ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
        ({"prompt": ["a", "b"]}, "prompt", "got 2 prompts"),
        ({"prompt": [1, "b"]}, "prompt", "token ids"),
        ({}, "prompt", "required"),
        ({"prompt": "a", "stop": [1]}, "stop", "array of strings"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ],
)
def test_bad_completion_bodies_name_the_parameter(body, param, words):
    err = _api_error(parse_completion, body, "r")
    assert (err.status, err.param) == (400, param)
    assert words in err.message and err.message.startswith(param)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": []}, "messages", "non-empty array"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text content"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "non-empty string"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
            "name",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format.type",
            "json_schema",
        ),
    ],
)
def test_bad_chat_bodies_name_the_parameter(body, param, words):
    err = _api_error(parse_chat, body, "r")
    assert (err.status, err.param) == (400, param)
    assert words in err.message


def test_malformed_json_is_a_400():
    assert _api_error(read_json, b"{not json").status == 400
    assert "JSON object" in _api_error(read_json, b"[1, 2]").message


def test_engine_errors_map_onto_openai_statuses_and_params():
    err = from_request_error(
        InvalidRequest("sampling.logprobs", "must be in [0, 20], got 30"),
        chat=True,
        aliases={"logprobs": "top_logprobs"},
    )
    assert (err.status, err.param, err.message) == (400, "top_logprobs", "top_logprobs: must be in [0, 20], got 30")
    assert from_request_error(InvalidRequest("text", "prompt is empty"), chat=False).param == "prompt"
    assert from_request_error(InvalidRequest("chat.messages[1].role", "role is empty"), chat=True).param == "messages"
    assert from_request_error(InvalidRequest("stopping.stop[0]", "too long"), chat=False).param == "stop"
    overloaded = from_request_error(Overloaded("9 waiting"), chat=False)
    assert (overloaded.status, overloaded.type) == (429, "rate_limit_error")
    assert from_request_error(Unavailable("none"), chat=False).status == 503
    assert from_request_error(DeadlineExceeded("late"), chat=False).status == 504
    assert set(overloaded.body()["error"]) == {"message", "type", "param", "code"}


@pytest.fixture
async def keyed_api():
    """The real server with API key k1, over an Engine with no executor (never started)."""
    config = SchedulerServiceConfig(api_keys="k1", http_port=0, executors="127.0.0.1:1")
    metrics = SchedulerMetrics()
    api = HttpApi(Engine(config, metrics), config, metrics)
    await api.start()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api.port}") as session:
        yield session
    await api.stop()


async def _call(session, method: str, path: str, key: str | None = None, data: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.request(method, path, headers=headers, data=data) as reply:
        return reply.status, await reply.text()


async def test_api_keys_health_metrics_and_error_shapes(keyed_api):
    status, text = await _call(keyed_api, "GET", "/v1/models")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert (await _call(keyed_api, "GET", "/v1/models", key="k2"))[0] == 401
    status, text = await _call(keyed_api, "GET", "/v1/models", key="k1")
    assert status == 503 and "no executor" in json.loads(text)["error"]["message"]
    status, text = await _call(keyed_api, "POST", "/v1/completions", key="k1", data=b"{oops")
    assert status == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
    status, text = await _call(keyed_api, "GET", "/v1/nothing", key="k1")
    error = json.loads(text)["error"]
    assert status == 404 and error["type"] == "not_found_error" and "/v1/nothing" in error["message"]
    assert (await _call(keyed_api, "GET", "/v1/completions", key="k1"))[0] == 405
    # Probes and scrapers carry no key.
    status, text = await _call(keyed_api, "GET", "/health")
    assert status == 503 and json.loads(text) == {"status": "not_serving"}
    status, text = await _call(keyed_api, "GET", "/metrics")
    assert status == 200 and "pagoda:num_requests_running" in text


def _outputs(last_reason: FinishReason) -> list[RequestOutput]:
    usage = Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=2, cached_tokens_offloaded=1)
    return [
        RequestOutput("r", "Hel", (11, 12)),
        RequestOutput("r", "lo", (13,), finish_reason=last_reason, usage=usage, error="boom"),
    ]


def test_formatters_join_text_and_report_usage():
    body = CompletionFormatter("cmpl-r", "m", None, None).response(_outputs(FinishReason.LENGTH))
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2, "cached_tokens_offloaded": 1},
    }
    chat = ChatFormatter("chatcmpl-r", "m", None, None)
    chunks = [json.loads(chunk) for out in _outputs(FinishReason.STOP) for chunk in chat.chunks(out)]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hel"}, {"content": "lo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert chat.usage_chunk()["choices"] == [] and chat.usage_chunk()["usage"]["total_tokens"] == 7


@pytest.mark.parametrize("formatter", [CompletionFormatter, ChatFormatter])
@pytest.mark.parametrize("model", ["m", 'a "quoted" model \\ \u00e9', "holds \0 the marker"])
def test_a_running_text_chunk_is_the_json_of_the_whole_chunk(formatter, model):
    """The text-only chunk rendered from the request's template is exactly the JSON of the chunk built whole."""
    fast = formatter("resp-1", model, None, None)
    for text in ["Hel", 'say "hi"\n', "\0", "\u00e9\u4e2d \U0001f600", "\\", "\u2028"]:
        out = RequestOutput("r", text, (5,))
        [chunk] = fast.chunks(out)
        whole = fast._chunk(out, fast._text_fields(text))[0]
        assert chunk == whole
        assert json.loads(chunk)["model"] == model
        choice = json.loads(chunk)["choices"][0]
        assert choice.get("text", choice.get("delta", {}).get("content")) == text
        assert choice["finish_reason"] is None and choice["logprobs"] is None
    assert fast.chunks(RequestOutput("r", "", (5,))) == []


@pytest.mark.parametrize("reason, status", [(FinishReason.ERROR, 500), (FinishReason.ABORT, 503)])
def test_a_failed_request_becomes_an_error_not_a_completion(reason, status):
    with pytest.raises(ApiError) as info:
        ChatFormatter("chatcmpl-r", "m", None, None).response(_outputs(reason))
    assert info.value.status == status and "boom" in info.value.message
