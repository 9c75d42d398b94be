"""The OpenAI-compatible API with the official `openai` client against a real
system on the tiny model, checked against the gRPC API for the same requests."""

from __future__ import annotations

import http.client
import json
import urllib.request
from urllib.parse import urlparse

import openai
import pytest
from support.pool import wait_pool_whole
from support.services import wait_until
from support.system import paused

from pagoda_client import Client

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def oai(http_system):
    _, base_url = http_system
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc(http_system):
    system, _ = http_system
    with Client(system.target, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(grpc):
    return grpc.model_info().model_name


def _greedy(create, **body):
    """``create`` (a method of the openai client) at temperature 0, past EOS: what the gRPC side is asked too."""
    return create(temperature=0, extra_body={"ignore_eos": True}, **body)


def _streamed(create, **body):
    """Every chunk of a greedy ``create`` streamed with its usage (the last chunk)."""
    return list(_greedy(create, stream=True, stream_options={"include_usage": True}, **body))


def _same_usage(http_usage, grpc_usage) -> None:
    assert http_usage.prompt_tokens == grpc_usage.prompt_tokens
    assert http_usage.completion_tokens == grpc_usage.completion_tokens
    assert http_usage.total_tokens == grpc_usage.prompt_tokens + grpc_usage.completion_tokens


def test_models_list_names_the_served_model(oai, grpc, model):
    models = oai.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == grpc.model_info().max_model_len


def test_completion_equals_grpc(oai, grpc, model):
    reply = _greedy(
        oai.completions.create, model=model, prompt=PROMPT, max_tokens=12, extra_headers={"x-request-id": "req-7"}
    )
    expected = grpc.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert reply.id == "cmpl-req-7" and reply.object == "text_completion" and reply.model == model
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    _same_usage(reply.usage, expected.usage)
    assert reply.usage.completion_tokens == 12


def test_completion_with_token_ids_equals_grpc(oai, grpc, model):
    token_ids = grpc.tokenize(PROMPT)
    reply = _greedy(oai.completions.create, model=model, prompt=token_ids, max_tokens=8)
    expected = grpc.generate(token_ids=token_ids, max_tokens=8, temperature=0, ignore_eos=True)
    assert reply.choices[0].text == expected.text
    _same_usage(reply.usage, expected.usage)


def test_streamed_completion_equals_grpc(oai, grpc, model):
    chunks = _streamed(oai.completions.create, model=model, prompt=PROMPT, max_tokens=12)
    expected = grpc.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk.choices == [] and all(c.usage is None for c in text_chunks)
    _same_usage(usage_chunk.usage, expected.usage)
    assert len({c.id for c in chunks}) == 1


def test_chat_completion_equals_grpc(oai, grpc, model):
    reply = _greedy(oai.chat.completions.create, model=model, messages=MESSAGES, max_completion_tokens=10)
    expected = grpc.chat(MESSAGES, max_tokens=10, temperature=0, ignore_eos=True)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    _same_usage(reply.usage, expected.usage)


def test_streamed_chat_role_first_finish_last_then_usage(oai, grpc, model):
    chunks = _streamed(oai.chat.completions.create, model=model, messages=MESSAGES, max_tokens=10)
    expected = grpc.chat(MESSAGES, max_tokens=10, temperature=0, ignore_eos=True)
    first, *middle, last, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].finish_reason is None
    assert all(c.choices[0].delta.role is None for c in [*middle, last])
    assert [c.choices[0].finish_reason for c in middle] == [None] * len(middle)
    assert last.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected.text
    _same_usage(usage_chunk.usage, expected.usage)


def test_stop_string_ends_the_text_like_grpc(oai, grpc, model):
    full = grpc.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True).text
    stop = next(
        full[i : i + 2] for i in range(3, len(full)) if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
    )
    reply = _greedy(oai.completions.create, model=model, prompt=PROMPT, max_tokens=24, stop=[stop])
    expected = grpc.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert reply.choices[0].text == expected.text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["stop_reason"] == stop
    _same_usage(reply.usage, expected.usage)


def test_seeded_sampling_with_every_knob_equals_grpc(oai, grpc, model):
    knobs = dict(temperature=0.9, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.3)
    extensions = dict(top_k=50, min_p=0.01, repetition_penalty=1.2)
    reply = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, **knobs, extra_body={"ignore_eos": True, **extensions}
    )
    expected = grpc.generate(PROMPT, max_tokens=16, ignore_eos=True, **knobs, **extensions)
    assert reply.choices[0].text == expected.text
    greedy = grpc.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert expected.token_ids != greedy.token_ids, "the sampling knobs changed nothing"


def test_chat_logprobs_equal_grpc(oai, grpc, model):
    reply = _greedy(
        oai.chat.completions.create, model=model, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3
    )
    expected = grpc.chat(MESSAGES, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected.logprobs) == 6
    for entry, want in zip(content, expected.logprobs):
        assert entry.token == grpc.detokenize([want.sampled.token_id], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(want.sampled.logprob, abs=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([t.logprob for t in want.top], abs=1e-6)
        assert len(entry.top_logprobs) == 3


def test_completion_logprobs_legacy_layout(oai, grpc, model):
    reply = _greedy(oai.completions.create, model=model, prompt=PROMPT, max_tokens=5, logprobs=2)
    expected = grpc.generate(PROMPT, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp.tokens == [grpc.detokenize([t], skip_special_tokens=False) for t in expected.token_ids]
    assert lp.token_logprobs == pytest.approx([e.sampled.logprob for e in expected.logprobs], abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(5))


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        (dict(temperature=-1), "temperature", "must be >= 0"),
        (dict(top_p=1.5), "top_p", "(0, 1]"),
        (dict(n=9), "n", "must be in [1, 8]"),
        (dict(max_tokens=5000), "max_tokens", "above the limit"),
        (dict(max_tokens=1000, prompt="x " * 100), "max_tokens", "context"),
        (dict(logprobs=99), "logprobs", "must be in [0, 20]"),
        (dict(extra_body={"top_k": "many"}), "top_k", "expected an integer"),
    ],
)
def test_invalid_parameter_is_a_400_naming_it(oai, model, kwargs, param, words):
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert words in info.value.message and param in info.value.message


def test_chat_invalid_top_logprobs_names_the_openai_parameter(oai, model):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=50)
    assert info.value.body["param"] == "top_logprobs"


def test_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-9", prompt=PROMPT)
    assert info.value.body["code"] == "model_not_found" and "gpt-9" in info.value.message


def test_health_and_metrics(http_system):
    _, base_url = http_system
    with urllib.request.urlopen(f"{base_url}/health") as reply:
        assert reply.status == 200 and json.load(reply) == {"status": "serving"}
    with urllib.request.urlopen(f"{base_url}/metrics") as reply:
        text = reply.read().decode()
    assert 'pagoda:request_success_total{finished_reason="length"}' in text


def _open_stream(base_url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _read_events(reply: http.client.HTTPResponse, count: int) -> list[dict]:
    events = []
    while len(events) < count:
        line = reply.fp.readline().decode().strip()
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
    return events


def _num_finished(base_url: str, reason: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics") as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f'pagoda:request_success_total{{finished_reason="{reason}"}}'):
                return float(line.split()[-1])
    return 0.0


def test_client_disconnect_mid_stream_frees_the_blocks(http_system, grpc, model):
    system, base_url = http_system
    num_aborted, num_length = _num_finished(base_url, "abort"), _num_finished(base_url, "length")
    conn, reply = _open_stream(
        base_url,
        {"model": model, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    assert reply.status == 200 and reply.getheader("Content-Type").startswith("text/event-stream")
    events = _read_events(reply, 3)
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    # The executor paused: the request cannot run to its end whatever the machine's speed, so only the
    # hang-up can end it, and an abort lost shows as no abort while paused (not as a "length" finish).
    with paused(system.executor_pids[0]):
        status = grpc.status()
        assert status.num_running == 1 and status.executors[0].num_free_kv_blocks < status.executors[0].num_kv_blocks
        reply.close()
        conn.close()
        wait_until(lambda: _num_finished(base_url, "abort") > num_aborted, 10, "the abort of the request hung up on")
    wait_pool_whole(grpc, 30)
    assert _num_finished(base_url, "abort") == num_aborted + 1
    assert _num_finished(base_url, "length") == num_length
