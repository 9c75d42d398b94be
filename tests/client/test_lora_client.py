"""LoRA adapters through the client, the async client and the CLI, against a real system (tiny random Llama).

The executor starts with `--lora a1=PATH --max-lora-rank 8` and the scheduler with an API key; the adapters are
tiny PEFT ones whose random `lora_B` moves the greedy tokens, so a request that ran on the wrong adapter (or on
none) shows.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from support.peft_adapters import make_peft_adapter
from support.system import fp32_launcher

from pagoda_client import AsyncClient, Client, LoraAdapter, PagodaError

pytestmark = pytest.mark.integration

KEY = "lora-key"
PROMPT = [5, 17, 42, 99, 100, 7, 250]


@pytest.fixture(scope="module")
def adapters(client_tiny_model_dir, tmp_path_factory):
    """Folders of: a1, a2 and a3 (rank 4, different weights), dora (DoRA, which the executors refuse)."""
    root = tmp_path_factory.mktemp("client-loras")
    model = client_tiny_model_dir
    return {
        "a1": make_peft_adapter(model, root / "a1", seed=1),
        "a2": make_peft_adapter(model, root / "a2", seed=2, target_modules=("k_proj", "o_proj", "up_proj")),
        "a3": make_peft_adapter(model, root / "a3", seed=3),
        "dora": make_peft_adapter(model, root / "dora", seed=4, use_dora=True),
    }


@pytest.fixture(scope="module")
def target(client_tiny_model_dir, adapters, tmp_path_factory):
    """The scheduler's address: a1 registered at the executor's start, API key KEY."""
    with fp32_launcher(
        client_tiny_model_dir,
        tmp_path_factory.mktemp("client-lora-logs"),
        "512KiB",
        extra_executor_args=["--lora", f"a1={adapters['a1']}", "--max-lora-rank", "8"],
        extra_scheduler_args=["--api-keys", KEY],
        client_api_key=KEY,
    ) as system:
        yield system.target


@pytest.fixture(scope="module")
def client(target):
    with Client(target, api_key=KEY, timeout=60) as client:
        yield client


def _tokens(client: Client, lora: str | None = None) -> list[int]:
    return client.generate(token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True, lora=lora).token_ids


def _names(client: Client) -> list[str]:
    return [adapter.name for adapter in client.model_info().loras]


def _modules(adapter: LoraAdapter) -> set[str]:
    """The modules an adapter adapts, without their parent's name (self_attn.q_proj: q_proj)."""
    return {module.rsplit(".", 1)[-1] for module in adapter.target_modules}


def _code(call) -> grpc.StatusCode:
    with pytest.raises(PagodaError) as caught:
        call()
    return caught.value.code


def test_model_info_and_status_list_the_adapter_registered_at_start(client, adapters):
    (a1,) = client.model_info().loras
    assert isinstance(a1, LoraAdapter)
    assert (a1.name, a1.path, a1.rank) == ("a1", str(adapters["a1"]), 4)
    assert _modules(a1) == {"q_proj", "v_proj", "down_proj"} and a1.fingerprint
    assert [e.loras for e in client.status().executors] == [("a1",)]


def test_the_lora_option_picks_the_adapter(client):
    base, with_a1 = _tokens(client), _tokens(client, "a1")
    assert with_a1 != base, "the adapter changed nothing: the test would see no routing"
    assert _tokens(client, "") == base and _tokens(client, "a1") == with_a1
    error = pytest.raises(PagodaError, _tokens, client, "a9").value
    assert error.code == grpc.StatusCode.NOT_FOUND and "a9" in error.message


def test_load_use_unload(client, adapters):
    loaded = client.load_lora_adapter("a2", str(adapters["a2"]))
    assert (loaded.name, loaded.path, loaded.rank) == ("a2", str(adapters["a2"]), 4)
    assert _modules(loaded) == {"k_proj", "o_proj", "up_proj"}
    assert client.model_info().loras[1] == loaded and _names(client) == ["a1", "a2"]
    outputs = [_tokens(client, lora) for lora in (None, "a1", "a2")]
    assert len({tuple(tokens) for tokens in outputs}) == 3
    assert client.load_lora_adapter("a2", str(adapters["a2"])) == loaded  # the same again: nothing changes
    client.unload_lora_adapter("a2")
    assert _names(client) == ["a1"]
    assert _code(lambda: _tokens(client, "a2")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.unload_lora_adapter("a2")) == grpc.StatusCode.NOT_FOUND


def test_refused_loads_name_the_problem_and_change_nothing(client, adapters, tmp_path):
    before = client.model_info().loras
    with pytest.raises(PagodaError) as caught:
        client.load_lora_adapter("dora", str(adapters["dora"]))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "use_dora" in caught.value.message
    assert _code(lambda: client.load_lora_adapter("ghost", str(tmp_path / "no"))) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.load_lora_adapter("a1", str(adapters["a2"]))) == grpc.StatusCode.ALREADY_EXISTS
    model = client.model_info().model_name
    assert _code(lambda: client.load_lora_adapter(model, str(adapters["a2"]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: client.load_lora_adapter("a b", str(adapters["a2"]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.model_info().loras == before
    assert [e.loras for e in client.status().executors] == [("a1",)]


def test_async_client_loads_and_unloads(target, client, adapters):
    async def run() -> tuple[LoraAdapter, list[int]]:
        async with AsyncClient(target, api_key=KEY, timeout=60) as aclient:
            loaded = await aclient.load_lora_adapter("a3", str(adapters["a3"]))
            result = await aclient.generate(token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True, lora="a3")
            await aclient.unload_lora_adapter("a3")
            return loaded, result.token_ids

    loaded, tokens = asyncio.run(run())
    assert loaded.name == "a3" and tokens != _tokens(client)
    assert _names(client) == ["a1"]


def test_admin_calls_need_the_api_key(target, client, adapters):
    with Client(target, timeout=30, max_retries=0) as anonymous:
        code = _code(lambda: anonymous.load_lora_adapter("a2", str(adapters["a2"])))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: anonymous.unload_lora_adapter("a1")) == grpc.StatusCode.UNAUTHENTICATED
    assert _names(client) == ["a1"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_lora_flag_models_and_status(target, client):
    connection = ["--target", target, "--api-key", KEY]
    flags = ["--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "8", "--temperature", "0", "--ignore-eos"]
    proc = _cli("generate", *flags, "--lora", "a1", "--json", *connection)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == _tokens(client, "a1")
    proc = _cli("generate", *flags, "--lora", "a9", *connection)
    assert proc.returncode == 1 and proc.stderr.startswith("error: NOT_FOUND: ")
    proc = _cli("models", "--json", *connection)
    assert proc.returncode == 0, proc.stderr
    assert [a["name"] for a in json.loads(proc.stdout)["loras"]] == ["a1"]
    proc = _cli("models", *connection)
    assert proc.returncode == 0 and "\nlora                a1  rank 4" in proc.stdout
    proc = _cli("status", *connection)
    assert proc.returncode == 0 and "  loras: a1" in proc.stdout
