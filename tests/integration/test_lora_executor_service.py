"""The executor's LoRA RPCs on a real executor process: Describe, LoadLora, UnloadLora and ``--lora`` at start."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from support.peft_adapters import make_peft_adapter
from support.services import executor_service

from pagoda.v1 import executor_pb2, executor_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(tiny_model_dir, folder / name, seed=i) for i, name in enumerate(("a1", "a2"))}


@pytest.fixture(scope="module")
def stub(tiny_model_dir: Path, adapters, tmp_path_factory):
    extra = ["--lora", f"a1={adapters['a1']}", "--max-loras", "3", "--max-lora-rank", "16"]
    service = executor_service("lora-executor", tiny_model_dir, tmp_path_factory.mktemp("logs"), extra).start()
    try:
        service.wait_serving()
        with grpc.insecure_channel(service.address) as channel:
            yield executor_pb2_grpc.ExecutorStub(channel)
    finally:
        service.stop()


def _describe(stub) -> executor_pb2.ExecutorInfo:
    return stub.Describe(executor_pb2.DescribeRequest(brief=True), timeout=10)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def test_describe_lists_the_adapters_given_at_start(stub, adapters):
    info = _describe(stub)
    assert (info.max_loras, info.max_lora_rank) == (3, 16)
    (a1,) = info.loras
    assert (a1.name, a1.path, a1.rank) == ("a1", str(adapters["a1"]), 4)
    assert sorted(a1.target_modules) == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert len(a1.fingerprint) == 24


def test_load_is_idempotent_and_every_refusal_has_its_status(stub, adapters, tiny_model_dir, tmp_path):
    a1 = _describe(stub).loras[0]
    assert stub.LoadLora(executor_pb2.LoadLoraRequest(name="a1", path=str(adapters["a1"])), timeout=30) == a1
    code, message = _code(lambda: stub.LoadLora(executor_pb2.LoadLoraRequest(name="a1", path=str(adapters["a2"]))))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "registered already, from" in message
    missing = tmp_path / "missing"
    code, message = _code(lambda: stub.LoadLora(executor_pb2.LoadLoraRequest(name="m", path=str(missing))))
    assert (code, message) == (grpc.StatusCode.NOT_FOUND, f"LoRA adapter 'm': no folder {missing}")
    too_big = make_peft_adapter(tiny_model_dir, tmp_path / "big", seed=5, r=32)
    code, message = _code(lambda: stub.LoadLora(executor_pb2.LoadLoraRequest(name="big", path=str(too_big))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 32" in message and "16" in message, message
    code, _ = _code(lambda: stub.LoadLora(executor_pb2.LoadLoraRequest(name="", path=str(adapters["a2"]))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert [a.name for a in _describe(stub).loras] == ["a1"]  # nothing changed


def test_unload_takes_an_adapter_out_and_an_unknown_one_is_not_found(stub, adapters):
    loaded = stub.LoadLora(executor_pb2.LoadLoraRequest(name="a2", path=str(adapters["a2"])), timeout=30)
    assert loaded.name == "a2" and [a.name for a in _describe(stub).loras] == ["a1", "a2"]
    assert stub.UnloadLora(executor_pb2.UnloadLoraRequest(name="a2"), timeout=10).num_running == 0
    assert [a.name for a in _describe(stub).loras] == ["a1"]
    code, message = _code(lambda: stub.UnloadLora(executor_pb2.UnloadLoraRequest(name="a2")))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown LoRA adapter 'a2'" in message


def test_a_bad_adapter_given_at_start_stops_the_executor_naming_it(tiny_model_dir: Path, tmp_path):
    folder = tmp_path / "not-an-adapter"
    folder.mkdir()
    service = executor_service("bad-lora", tiny_model_dir, tmp_path, ["--lora", f"x={folder}"]).start()
    try:
        assert service.process is not None and service.process.wait(timeout=120) == 1
    except subprocess.TimeoutExpired:
        service.stop()
        pytest.fail(f"the executor did not exit:\n{service.log_text()[-3000:]}")
    assert f"--lora x={folder}: " in service.log_text(), service.log_text()[-3000:]
