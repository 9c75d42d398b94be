"""LoRA adapters on the OpenAI API: the `model` field, /v1/models, and vLLM's load/unload routes.

The system is real (an executor started with `--lora a1=PATH --max-lora-rank 8`, a scheduler with an API key)
on the tiny random Llama, with tiny PEFT adapters whose random `lora_B` moves the greedy tokens. What an
adapter computes is the executor tests' part (tests/executor/test_lora_peft.py); here: which adapter a request
runs with, what is listed, and what each refusal changes (nothing).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from support.peft_adapters import make_peft_adapter
from support.system import fp32_launcher

from pagoda.step import LoraAdapter
from pagoda_client import Client
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.loras import lora_of_model, model_cards
from tests.http.conftest import wait_http_health

KEY = "lora-key"
PROMPT = "The quick brown fox"
MAX_LORA_RANK = 8


# ----- the edge's own rules, no system ---------------------------------------------------------------------------


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, f"/adapters/{name}", 4, ("q_proj",), "f")


def test_model_field_names_the_base_model_or_an_adapter():
    adapters = (_adapter("a1"), _adapter("org/a2"))
    assert lora_of_model(None, "tiny", adapters) == ""
    assert lora_of_model("", "tiny", adapters) == ""
    assert lora_of_model("tiny", "tiny", adapters) == ""
    assert lora_of_model("org/a2", "tiny", adapters) == "org/a2"
    with pytest.raises(ApiError) as caught:
        lora_of_model("a3", "tiny", adapters)
    assert (caught.value.status, caught.value.code, caught.value.param) == (404, "model_not_found", "model")
    assert (
        caught.value.message
        == "The model 'a3' does not exist; this server serves 'tiny' and the LoRA adapters 'a1', 'org/a2'"
    )


def test_model_cards_list_the_base_then_each_adapter_under_it():
    cards = model_cards("tiny", (_adapter("a1"),), created=7, max_model_len=512)
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("tiny", "tiny", None),
        ("a1", "/adapters/a1", "tiny"),
    ]
    assert all(c["object"] == "model" and c["created"] == 7 and c["max_model_len"] == 512 for c in cards)


# ----- a real system -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(http_tiny_model_dir, tmp_path_factory):
    """Folders of: a1 and a2 (rank 4, different weights), wide (rank 16, above the executors' limit)."""
    root = tmp_path_factory.mktemp("http-loras")
    return {
        "a1": make_peft_adapter(http_tiny_model_dir, root / "a1", seed=1),
        "a2": make_peft_adapter(http_tiny_model_dir, root / "a2", seed=2, target_modules=("k_proj", "o_proj")),
        "wide": make_peft_adapter(http_tiny_model_dir, root / "wide", seed=3, r=16),
    }


@pytest.fixture(scope="module")
def lora_system(http_tiny_model_dir, adapters, tmp_path_factory):
    """(gRPC target, base URL): a1 registered at the executor's start; API key KEY on both APIs."""
    from pagoda.launch.launcher import free_port

    port = free_port()
    with fp32_launcher(
        http_tiny_model_dir,
        tmp_path_factory.mktemp("http-lora-logs"),
        "512KiB",
        http_port=port,
        extra_executor_args=["--lora", f"a1={adapters['a1']}", "--max-lora-rank", str(MAX_LORA_RANK)],
        extra_scheduler_args=["--api-keys", KEY],
        client_api_key=KEY,
    ) as system:
        base_url = f"http://127.0.0.1:{port}"
        wait_http_health(base_url)
        yield system.target, base_url


@pytest.fixture(scope="module")
def oai(lora_system):
    return openai.OpenAI(base_url=f"{lora_system[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(lora_system):
    with Client(lora_system[0], api_key=KEY, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def served(grpc_client):
    return grpc_client.model_info().model_name


def _post(base_url: str, path: str, body: dict, key: str | None = KEY) -> tuple[int, str]:
    """(status, body text) of a JSON POST."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"{base_url}{path}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _error(text: str) -> dict:
    """The OpenAI error object of a reply's body."""
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _model_ids(oai) -> list[str]:
    return [m.id for m in oai.models.list().data]


def _complete(oai, model: str) -> openai.types.Completion:
    return oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )


def _grpc_text(client: Client, lora: str = "") -> str:
    return client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, lora=lora).text


@pytest.mark.integration
def test_models_list_the_base_model_and_the_adapter_registered_at_start(oai, served, adapters):
    cards = oai.models.list().data
    assert [m.id for m in cards] == [served, "a1"]
    assert cards[0].model_extra["parent"] is None
    assert (cards[1].model_extra["parent"], cards[1].model_extra["root"]) == (served, str(adapters["a1"]))


@pytest.mark.integration
def test_the_model_field_picks_the_adapter(oai, grpc_client, lora_system, served):
    base, with_a1 = _complete(oai, served), _complete(oai, "a1")
    assert with_a1.model == "a1" and base.model == served
    assert with_a1.choices[0].text != base.choices[0].text, "the adapter changed nothing: the test would see no routing"
    assert with_a1.choices[0].text == _grpc_text(grpc_client, "a1")
    assert base.choices[0].text == _grpc_text(grpc_client)
    no_model = _post(lora_system[1], "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert no_model[0] == 200 and json.loads(no_model[1])["model"] == served
    chunks = list(
        oai.chat.completions.create(
            model="a1", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True
        )
    )
    assert {chunk.model for chunk in chunks} == {"a1"}


@pytest.mark.integration
def test_an_unknown_model_is_a_404_naming_what_is_served(oai, served):
    with pytest.raises(openai.NotFoundError) as caught:
        _complete(oai, "a9")
    assert caught.value.body["code"] == "model_not_found"
    assert f"serves '{served}' and the LoRA adapters 'a1'" in caught.value.message


@pytest.mark.integration
def test_load_list_use_unload(oai, grpc_client, lora_system, served, adapters):
    base_url = lora_system[1]
    status, text = _post(base_url, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"])})
    assert (status, text) == (200, "Success: LoRA adapter 'a2' added successfully.")
    assert _model_ids(oai) == [served, "a1", "a2"]
    texts = {model: _complete(oai, model).choices[0].text for model in (served, "a1", "a2")}
    assert len(set(texts.values())) == 3, texts
    assert texts["a2"] == _grpc_text(grpc_client, "a2")
    # The same name and folder again: a success that changes nothing.
    assert _post(base_url, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"])})[0] == 200
    assert _model_ids(oai) == [served, "a1", "a2"]
    status, text = _post(base_url, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert (status, text) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    assert _model_ids(oai) == [served, "a1"]
    with pytest.raises(openai.NotFoundError):
        _complete(oai, "a2")
    status, text = _post(base_url, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 404 and "a2" in _error(text)["message"]


@pytest.mark.integration
def test_refused_loads_change_nothing(oai, lora_system, served, adapters, tmp_path):
    base_url = lora_system[1]
    before = oai.models.list().data

    status, text = _post(base_url, "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": str(tmp_path / "no")})
    assert status == 404 and _error(text)["type"] == "not_found_error"

    status, text = _post(base_url, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(adapters["wide"])})
    error = _error(text)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert f"rank 16 is above the limit of {MAX_LORA_RANK}" in error["message"], error

    status, text = _post(base_url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapters["a2"])})
    assert status == 409 and _error(text)["type"] == "conflict_error"  # a1 holds another adapter
    status, text = _post(base_url, "/v1/load_lora_adapter", {"lora_name": served, "lora_path": str(adapters["a2"])})
    error = _error(text)
    assert status == 400 and error["param"] == "lora_name" and "base model" in error["message"]

    for body, param in [
        ({"lora_name": "a b", "lora_path": str(adapters["a2"])}, "lora_name"),
        ({"lora_name": "a3"}, "lora_path"),
        ({"lora_path": str(adapters["a2"])}, "lora_name"),
        ({"lora_name": 3, "lora_path": str(adapters["a2"])}, "lora_name"),
    ]:
        status, text = _post(base_url, "/v1/load_lora_adapter", body)
        assert status == 400 and _error(text)["param"] == param, (body, text)
    assert oai.models.list().data == before
    assert _complete(oai, "a1").model == "a1"  # still served


@pytest.mark.integration
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_the_admin_routes_need_an_api_key(oai, lora_system, served, adapters, key):
    base_url = lora_system[1]
    for path, body in [
        ("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapters["a2"])}),
        ("/v1/unload_lora_adapter", {"lora_name": "a1"}),
    ]:
        status, text = _post(base_url, path, body, key=key)
        assert status == 401 and _error(text)["code"] == "invalid_api_key"
    assert _model_ids(oai) == [served, "a1"]
