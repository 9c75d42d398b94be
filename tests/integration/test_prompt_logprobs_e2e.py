"""``prompt_logprobs`` through the gRPC path: the logprob of every prompt token, as transformers computes it."""

from __future__ import annotations

import pytest
import torch
from support.tiny_model import _load

from pagoda_client import Client

pytestmark = pytest.mark.integration


def test_prompt_logprobs_of_a_chunked_prompt_equal_transformers(tiny_system, tiny_model_dir):
    prompt = [(37 * i) % 380 + 3 for i in range(90)]
    with Client(tiny_system.target, timeout=60) as client:
        result = client.generate(token_ids=prompt, max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
        plain = client.generate(token_ids=prompt, max_tokens=2, temperature=0, ignore_eos=True)  # prefix-cached
        assert plain.usage.cached_tokens > 0 and result.usage.cached_tokens == 0
    assert len(result.prompt_logprobs) == len(prompt) - 1 and plain.prompt_logprobs == []
    assert result.token_ids == plain.token_ids
    with torch.no_grad():
        expected = torch.log_softmax(_load(tiny_model_dir)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position, entry in enumerate(result.prompt_logprobs, start=1):
        assert entry.sampled.token_id == prompt[position]
        assert entry.sampled.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=1e-4)
        assert entry.top[0].token_id == expected[position - 1].argmax().item()
