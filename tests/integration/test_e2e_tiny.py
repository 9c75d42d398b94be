"""The whole gRPC path on a tiny random Llama: exactness, paging, batching, bad input."""

from __future__ import annotations

import concurrent.futures
import random

import grpc
import pytest
from support.pool import wait_pool_whole
from support.tiny_model import hf_greedy

from pagoda_client import Client, PagodaError

pytestmark = pytest.mark.integration


def _prompts(n: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def test_greedy_matches_transformers_concurrently(tiny_system, tiny_model_dir):
    prompts = _prompts(6)
    with Client(tiny_system.target, timeout=60) as client:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda p: client.generate(token_ids=p, max_tokens=24, temperature=0, ignore_eos=True), prompts)
            )
        for prompt, result in zip(prompts, results):
            assert result.token_ids == hf_greedy(tiny_model_dir, prompt, 24)
            assert result.finish_reason == "length"
            assert result.usage.prompt_tokens == len(prompt)
            assert result.usage.completion_tokens == 24
        wait_pool_whole(client)


def test_streamed_text_equals_detokenized_ids(tiny_system):
    with Client(tiny_system.target, timeout=60) as client:
        deltas = list(client.stream("The quick brown fox", max_tokens=20, temperature=0, ignore_eos=True))
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        assert len(ids) == 20
        assert text == client.detokenize(ids)
        assert deltas[-1].finish_reason == "length"


def test_short_request_finishes_first_and_long_is_unchanged(tiny_system, tiny_model_dir):
    long_prompt, short_prompt = _prompts(2, seed=7)
    with Client(tiny_system.target, timeout=120) as client:
        alone = client.generate(token_ids=long_prompt, max_tokens=300, temperature=0, ignore_eos=True).token_ids
        finished_at = {}
        long_stream = client.stream(token_ids=long_prompt, max_tokens=300, temperature=0, ignore_eos=True)
        long_tokens = []
        short_result = None
        for delta in long_stream:
            long_tokens.extend(delta.token_ids)
            if len(long_tokens) >= 20 and short_result is None:
                short_result = client.generate(token_ids=short_prompt, max_tokens=5, temperature=0, ignore_eos=True)
                finished_at["short"] = len(long_tokens)
        assert short_result is not None and len(short_result.token_ids) == 5
        assert finished_at["short"] < 300, "the short request waited for the long one"
        assert long_tokens == alone
        assert short_result.token_ids == hf_greedy(tiny_model_dir, short_prompt, 5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt=""), "text"),
        (dict(token_ids=[]), "token_ids"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=-3), "max_tokens"),
        (dict(prompt="hi", temperature=-0.5), "temperature"),
        (dict(prompt="hi", top_p=0.0), "top_p"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(token_ids=[5] * 2000), "tokens"),
        (dict(token_ids=[1, 99999]), "token_ids"),
    ],
)
def test_bad_input_is_invalid_argument_and_service_keeps_serving(tiny_system, kwargs, field):
    with Client(tiny_system.target, timeout=30) as client:
        with pytest.raises(PagodaError) as info:
            client.generate(**kwargs)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.message
        ok = client.generate(token_ids=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)
        assert len(ok.token_ids) == 3
        wait_pool_whole(client)


def test_chat_uses_the_template(tiny_system):
    with Client(tiny_system.target, timeout=30) as client:
        messages = [{"role": "user", "content": "hello"}]
        expected = client.tokenize("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
        result = client.chat(messages, max_tokens=4, temperature=0, ignore_eos=True)
        assert result.prompt_token_ids == expected
