"""The default model end to end: SmolLM2-135M-Instruct against transformers."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from support.system import fp32_launcher

from pagoda_client import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French and German, one per line, with no other words.",
    "2 + 2 =",
    "Tell me a short story about a robot who learns to paint. Make it gentle, give the robot a name, "
    "and end with a sentence about colours and what they meant to it.",
    "Hi",
]


@pytest.fixture(scope="module")
def smollm2_dir():
    from executor_svc.loading.model_cache import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="module")
def smollm2_system(smollm2_dir, tmp_path_factory):
    with fp32_launcher(smollm2_dir, tmp_path_factory.mktemp("logs"), "256MiB", startup_timeout_s=300) as system:
        yield system


def _hf_greedy_chat(folder, messages_list, max_new_tokens):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    outputs = []
    for messages in messages_list:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        input_ids = torch.tensor([list(ids)])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.eos_token_id,
            )
        outputs.append((list(ids), out[0, input_ids.shape[1] :].tolist()))
    return outputs


def test_eight_concurrent_prompts_match_transformers(smollm2_system, smollm2_dir):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    with Client(smollm2_system.target, timeout=300) as client:
        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            results = list(pool.map(lambda m: client.chat(m, max_tokens=32, temperature=0), conversations))
    expected = _hf_greedy_chat(smollm2_dir, conversations, 32)
    for result, (prompt_ids, hf_ids) in zip(results, expected):
        assert result.prompt_token_ids == prompt_ids
        assert result.token_ids == hf_ids


def test_capital_of_france(smollm2_system):
    with Client(smollm2_system.target, timeout=120) as client:
        answer = client.chat(
            [{"role": "user", "content": "What is the capital of France?"}], max_tokens=40, temperature=0
        )
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"
