"""LoRA adapters end to end: real executors and a scheduler, requests for two adapters and the base model mixed.

Two executors register both adapters at start (``--lora NAME=PATH``). Every request's greedy tokens equal
transformers + PEFT (``PeftModel``) on the same tiny random base and adapters in fp32, with the base model and
both adapters running in the same steps; the prefix cache never gives one adapter another's blocks; and an
executor SIGKILLed mid-stream with adapters in flight changes no token (its sequences are recomputed, with their
adapters, on the other executor).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import grpc
import pytest
from support.peft_adapters import make_peft_adapter
from support.services import executor_service, scheduler_service, wait_until
from support.streams import KillOnce, run_streams
from support.system import fp32_launcher

from pagoda.v1 import executor_pb2, executor_pb2_grpc, generation_pb2, generation_pb2_grpc
from pagoda_client import Client, PagodaError

pytestmark = pytest.mark.integration

ADAPTERS = ("a1", "a2")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {
        "a1": make_peft_adapter(tiny_model_dir, folder / "a1", seed=1, r=8, target_modules=modules),
        "a2": make_peft_adapter(tiny_model_dir, folder / "a2", seed=2, r=4, target_modules=("q_proj", "v_proj")),
    }


@pytest.fixture(scope="module")
def system(tiny_model_dir: Path, adapters, tmp_path_factory):
    lora_args = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    with fp32_launcher(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        kv_cache_memory="2MiB",
        num_executors=2,
        block_size=16,
        extra_executor_args=[*lora_args, "--max-loras", "2"],
    ) as launched:
        yield launched


@pytest.fixture(scope="module")
def requests() -> list[dict]:
    """12 greedy requests, cycling base, a1, a2, with random prompts of 8-50 token ids."""
    rng = random.Random(7)
    names = [None, *ADAPTERS]
    return [
        dict(
            token_ids=[rng.randrange(3, 384) for _ in range(rng.randrange(8, 50))],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            temperature=0,
            lora=names[i % 3],
        )
        for i in range(12)
    ]


def peft_model(model_dir: Path, adapter: Path | None):
    """transformers (+ PEFT with ``adapter``) in fp32, the oracle."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return (peft.PeftModel.from_pretrained(base, adapter) if adapter is not None else base).eval()


def greedy(model, prompt: list[int]) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return generated[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapters, requests) -> list[list[int]]:
    """Each request's greedy tokens from transformers + PEFT in fp32, one request at a time."""
    models = {name: peft_model(tiny_model_dir, adapters.get(name)) for name in (None, *ADAPTERS)}
    return [greedy(models[request["lora"]], request["token_ids"]) for request in requests]


def test_adapters_and_the_base_model_in_one_batch_give_peft_tokens(system, requests, expected):
    with Client(system.target, timeout=120) as client:
        got = run_streams(client, requests)
    assert [record.token_ids for record in got] == expected
    assert expected[1] != expected[0] and expected[2] != expected[1]  # the adapters change the tokens


def test_an_unknown_adapter_is_not_found_and_changes_nothing(system, requests, expected):
    with grpc.insecure_channel(system.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIdsInput(token_ids=requests[0]["token_ids"]), lora="nope"
        )
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "LoRA adapter 'nope' is not loaded (loaded: a1, a2)" in error.value.details()
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
        assert [adapter.name for adapter in info.loras] == list(ADAPTERS)
    with Client(system.target, timeout=120) as client:
        assert run_streams(client, requests[:3])[1].token_ids == expected[1]


def test_the_prefix_cache_never_crosses_adapters(system):
    """The same 64-token prompt under a1, a2, the base model and a1 again: only the repeat is served from the
    cache (blocks are keyed by the adapter's weights)."""
    prompt = list(range(10, 74))
    cached = []
    with Client(system.target, timeout=120) as client:
        for name in ("a1", "a2", None, "a1"):
            result = client.generate(token_ids=prompt, max_tokens=2, temperature=0, lora=name)
            cached.append(result.usage.cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[3] >= 48, cached


def test_adapters_loaded_and_unloaded_while_requests_run(
    system, adapters, tiny_model_dir, tmp_path, requests, expected
):
    """Mid-stream, a3 is loaded and a1 unloaded: every stream, a1's included, ends with PEFT's tokens; then a1 is
    refused (NOT_FOUND) and a3 serves PEFT's tokens; a bad adapter is refused by name and changes nothing."""
    a3 = make_peft_adapter(tiny_model_dir, tmp_path / "a3", seed=3, r=2, target_modules=("o_proj", "up_proj"))
    with Client(system.target, timeout=180) as client:

        def swap() -> None:
            assert client.load_lora_adapter("a3", str(a3)).name == "a3"
            client.unload_lora_adapter("a1")

        swapped = KillOnce(len(requests) * MAX_TOKENS // 4, swap)
        got = run_streams(client, requests, swapped)
        assert swapped.fired_at is not None
        assert [record.token_ids for record in got] == expected
        with pytest.raises(PagodaError) as error:
            client.generate(token_ids=requests[1]["token_ids"], max_tokens=2, lora="a1")
        assert error.value.code == grpc.StatusCode.NOT_FOUND and "'a1' is not loaded" in error.value.message
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
        with pytest.raises(PagodaError) as error:
            client.load_lora_adapter("bad", str(bad))
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, error.value
        assert "LoRA adapter 'bad': adapter_config.json: lora_alpha must be a positive number" in error.value.message
        assert sorted(adapter.name for adapter in client.model_info().loras) == ["a2", "a3"]
        prompt = requests[0]["token_ids"]
        got_a3 = client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, lora="a3")
        assert list(got_a3.token_ids) == greedy(peft_model(tiny_model_dir, a3), prompt)
        client.load_lora_adapter("a1", str(adapters["a1"]))  # for the test after this one


def test_an_executor_killed_mid_stream_with_adapters_changes_no_token(system, requests, expected):
    """Runs last: the killed executor's sequences, adapters and all, are recomputed on the other one."""
    with Client(system.target, timeout=180) as client:
        kill = KillOnce(len(requests) * MAX_TOKENS // 4, lambda: os.kill(system.executors[0].pid, signal.SIGKILL))
        got = run_streams(client, requests, kill)
    assert kill.fired_at is not None, "the executor was never killed"
    assert [record.token_ids for record in got] == expected


def test_an_executor_that_restarts_gets_the_loaded_adapters_back(tiny_model_dir: Path, adapters, tmp_path):
    """An adapter loaded through the scheduler is registered again on an executor that restarts (a new
    incarnation, without --lora), and a request for it, waiting meanwhile, is served, not failed."""
    executor = executor_service("restarting", tiny_model_dir, tmp_path)
    scheduler = scheduler_service("sched-lora", [executor], tmp_path)
    try:
        executor.start().wait_serving()
        scheduler.start().wait_serving()
        prompt = list(range(20, 40))
        with Client(scheduler.address, timeout=120) as client:
            client.load_lora_adapter("a2", str(adapters["a2"]))
            before = client.generate(token_ids=prompt, max_tokens=8, temperature=0, lora="a2").token_ids
            executor.kill()
            executor.start()
            after = client.generate(token_ids=prompt, max_tokens=8, temperature=0, lora="a2").token_ids
            assert after == before
            (status,) = client.status().executors
            assert list(status.loras) == ["a2"]
        assert scheduler.events("lora_replayed"), scheduler.log_text()[-3000:]
    finally:
        scheduler.stop()
        executor.stop()


def test_an_adapter_refused_by_one_executor_is_taken_back_from_the_others(tiny_model_dir: Path, tmp_path):
    """Two executors with other rank limits: a rank-32 adapter fits one and not the other, so the load fails
    naming the reason and neither executor keeps it."""
    big = make_peft_adapter(tiny_model_dir, tmp_path / "big", seed=4, r=32)
    roomy = executor_service("roomy", tiny_model_dir, tmp_path)
    strict = executor_service("strict", tiny_model_dir, tmp_path, ["--max-lora-rank", "16"])
    scheduler = scheduler_service("sched-rollback", [roomy, strict], tmp_path)
    try:
        for service in (roomy, strict, scheduler):
            service.start().wait_serving()
        with Client(scheduler.address, timeout=120) as client:
            wait_until(lambda: len(client.status().executors) == 2, 60, "both executors described", scheduler)
            with pytest.raises(PagodaError) as error:
                client.load_lora_adapter("big", str(big))
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "rank 32 is above the limit of 16" in error.value.message, error.value.message
            assert [list(e.loras) for e in client.status().executors] == [[], []]
            assert client.model_info().loras == ()
        with grpc.insecure_channel(roomy.address) as channel:  # the executor itself, not the scheduler's view
            info = executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(brief=True))
            assert list(info.loras) == []
    finally:
        for service in (scheduler, strict, roomy):
            service.stop()
