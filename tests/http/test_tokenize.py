"""vLLM's POST /tokenize and POST /detokenize against a real system on the tiny model, checked against the
model's own tokenizer.json (the `tokenizers` library), the gRPC API and /v1/chat/completions.

The tiny model's tokenizer gets a post-processor that prepends BOS here, so add_special_tokens changes the ids
and a route that ignored it would fail.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
import tokenizers
from support.tiny_model import build_tiny_model

from pagoda_client import Client
from scheduler_svc.api.http.server import HttpApi
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.obs.metrics import SchedulerMetrics

TEXT = "Héllo wörld, 日本語 🙂 The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
BOS, BOS_ID = "<|im_start|>", 1


@pytest.fixture(scope="module")
def http_tiny_model_dir(tmp_path_factory):
    """The tiny model (conftest's http_system serves it), its tokenizer adding BOS as Llama's does."""
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-tokenize") / "tiny-llama")
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tokenizer(http_tiny_model_dir) -> tokenizers.Tokenizer:
    """The served model's tokenizer, read from its folder: the reference."""
    return tokenizers.Tokenizer.from_file(str(http_tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def base_url(http_system) -> str:
    return http_system[1]


@pytest.fixture(scope="module")
def model(base_url) -> str:
    return _get(base_url, "/v1/models")["data"][0]["id"]


def _get(base_url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base_url}{path}", timeout=30) as reply:
        return json.load(reply)


def _post(base_url: str, path: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{base_url}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _ok(base_url: str, path: str, body: dict) -> dict:
    status, reply = _post(base_url, path, body)
    assert status == 200, reply
    return reply


@pytest.mark.integration
@pytest.mark.parametrize("add_special_tokens", [True, False, None])
def test_ids_are_the_tokenizers_own(base_url, model, tokenizer, add_special_tokens):
    body = {"model": model, "prompt": TEXT}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    reply = _ok(base_url, "/tokenize", body)
    expected = tokenizer.encode(TEXT, add_special_tokens=add_special_tokens is not False).ids
    assert reply == {
        "count": len(expected),
        "max_model_len": _get(base_url, "/v1/models")["data"][0]["max_model_len"],
        "tokens": expected,
        "token_strs": None,
    }
    assert (reply["tokens"][0] == BOS_ID) == (add_special_tokens is not False)


@pytest.mark.integration
def test_text_round_trips_and_special_tokens_are_kept(base_url, model):
    bare = _ok(base_url, "/tokenize", {"model": model, "prompt": TEXT, "add_special_tokens": False})["tokens"]
    assert _ok(base_url, "/detokenize", {"model": model, "tokens": bare}) == {"prompt": TEXT}
    with_bos = _ok(base_url, "/tokenize", {"prompt": TEXT})["tokens"]  # the model may be left out
    assert with_bos == [BOS_ID, *bare]
    assert _ok(base_url, "/detokenize", {"tokens": with_bos}) == {"prompt": BOS + TEXT}
    assert _ok(base_url, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.integration
def test_chat_is_what_chat_completions_prompts(http_system, base_url, model, tokenizer):
    reply = _ok(base_url, "/tokenize", {"model": model, "messages": MESSAGES})
    # The tiny model's template, written out: the ids owe nothing to the server's rendering.
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES)
    expected = tokenizer.encode(rendered + "<|im_start|>assistant\n", add_special_tokens=False).ids
    assert reply["tokens"] == expected and reply["count"] == len(expected)
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    completion = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert completion.usage.prompt_tokens == reply["count"]
    with Client(http_system[0].target, timeout=60) as grpc:
        assert grpc.tokenize(messages=MESSAGES) == expected
    no_prompt = _ok(base_url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})["tokens"]
    assert no_prompt == tokenizer.encode(rendered, add_special_tokens=False).ids
    with_bos = _ok(base_url, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True})["tokens"]
    assert with_bos == [BOS_ID, *expected]


@pytest.mark.integration
@pytest.mark.parametrize("body", [{"prompt": TEXT}, {"messages": MESSAGES}])
def test_token_strs_are_the_vocabulary_strings(base_url, tokenizer, body):
    reply = _ok(base_url, "/tokenize", {**body, "return_token_strs": True})
    assert reply["token_strs"] == [tokenizer.id_to_token(t) for t in reply["tokens"]]
    assert len(reply["token_strs"]) == reply["count"] > 1


@pytest.mark.integration
@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/tokenize", {}, "prompt", "is required"),
        ("/tokenize", {"model": "m"}, "prompt", "is required"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "expected a string"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages", "not both"),
        ("/tokenize", {"messages": []}, "messages", "non-empty array"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content", "expected a string"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "expected a boolean"),
        ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "expected a boolean"),
        ("/tokenize", {"prompt": "fox " * 2000}, "prompt", "more than the model's context"),
        ("/detokenize", {}, "tokens", "is required"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "expected an array"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens", "expected a list of integers"),
        ("/detokenize", {"tokens": [1, True]}, "tokens", "expected a list of integers"),
        ("/detokenize", {"tokens": [1, 2.5]}, "tokens", "expected a list of integers"),
        ("/detokenize", {"tokens": [5, 384]}, "tokens", "token id 384 is outside the vocabulary [0, 384)"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "token id -1 is outside the vocabulary"),
        ("/detokenize", {"tokens": [5] * 2000}, "tokens", "more than the model's context"),
    ],
)
def test_bad_bodies_are_400s_naming_the_parameter(base_url, path, body, param, words):
    status, reply = _post(base_url, path, body)
    error = reply["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"] and param in error["message"]


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_malformed_json_is_a_400(base_url, path):
    status, reply = _post(base_url, path, b"{oops")
    assert status == 400 and "not valid JSON" in reply["error"]["message"]


@pytest.mark.integration
@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [5]})])
def test_unknown_model_is_a_404(base_url, path, body):
    status, reply = _post(base_url, path, {**body, "model": "gpt-9"})
    assert status == 404 and reply["error"]["code"] == "model_not_found" and "gpt-9" in reply["error"]["message"]


def _request_counters(base_url: str) -> list[str]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    names = ("pagoda:prompt_tokens_total", "pagoda:request_success_total", "pagoda:requests_rejected_total")
    return [line for line in lines if line.startswith(names)]


@pytest.mark.integration
def test_tokenizing_admits_no_request_and_bad_input_changes_nothing(base_url, model):
    before = _request_counters(base_url)
    assert any(line.startswith("pagoda:prompt_tokens_total") for line in before)
    expected = _ok(base_url, "/tokenize", {"prompt": TEXT})
    for path, body in [
        ("/tokenize", {"prompt": "fox " * 2000}),
        ("/tokenize", {"messages": [{"role": "user", "content": 3}]}),
        ("/detokenize", {"tokens": [10**9]}),
        ("/detokenize", {"tokens": [5], "model": "gpt-9"}),
    ]:
        assert _post(base_url, path, body)[0] in (400, 404)
    assert _ok(base_url, "/tokenize", {"prompt": TEXT}) == expected
    assert _ok(base_url, "/detokenize", {"tokens": expected["tokens"]}) == {"prompt": BOS + TEXT}
    assert _request_counters(base_url) == before


@pytest.fixture
async def keyed_api():
    """The real HTTP server with API key k1, over an Engine with no executor (never started)."""
    config = SchedulerServiceConfig(api_keys="k1", http_port=0, executors="127.0.0.1:1")
    metrics = SchedulerMetrics()
    api = HttpApi(Engine(config, metrics), config, metrics)
    await api.start()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api.port}") as session:
        yield session
    await api.stop()


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})])
async def test_api_keys_are_enforced(keyed_api, path, body):
    async with keyed_api.post(path, json=body) as reply:
        assert reply.status == 401 and (await reply.json())["error"]["code"] == "invalid_api_key"
    async with keyed_api.post(path, json=body, headers={"Authorization": "Bearer k2"}) as reply:
        assert reply.status == 401
    # The right key reaches the handler: no executor has connected yet.
    async with keyed_api.post(path, json=body, headers={"Authorization": "Bearer k1"}) as reply:
        assert reply.status == 503 and "no executor" in (await reply.json())["error"]["message"]
