"""Exercise (issue 15): a new sampling parameter, epsilon_cutoff, reaches the sampler from every API."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from executor_svc.sampler import SampleRequest, sample
from pagoda.params import SamplingParams


def test_the_sampler_drops_tokens_below_epsilon():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.07, 0.03]]))
    seen = set()
    for seed in range(200):
        request = SampleRequest(SamplingParams(temperature=1.0, seed=seed, epsilon_cutoff=0.1), (1, 2), 1)
        seen.add(sample(logits, [request])[0].token_id)
    assert seen == {0, 1}


@pytest.mark.integration
def test_epsilon_cutoff_through_grpc_and_http(http_system):
    from pagoda_client import Client

    launcher, base_url = http_system
    with Client(launcher.target) as client:
        wide = {tuple(client.generate("a b", max_tokens=8, temperature=5.0, seed=s).token_ids) for s in range(4)}
        cut = client.generate("a b", max_tokens=8, temperature=5.0, seed=0, epsilon_cutoff=0.999).token_ids
        greedy = client.generate("a b", max_tokens=8, temperature=0).token_ids
        model = client.model_info().model_name
    assert len(wide) > 1 and cut == greedy  # only the most likely token survives a cutoff of 0.999
    body = {"model": model, "prompt": "a b", "max_tokens": 8, "temperature": 5.0, "seed": 0, "epsilon_cutoff": 0.999}
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert json.load(reply)["choices"][0]["text"] == client_text(launcher.target, greedy)
    bad = {**body, "epsilon_cutoff": 1.0}
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(bad).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 400 and "epsilon_cutoff" in error.value.read().decode()


def client_text(target: str, token_ids: list[int]) -> str:
    from pagoda_client import Client

    with Client(target) as client:
        return client.detokenize(token_ids)
