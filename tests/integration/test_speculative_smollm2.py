"""Speculation on the default model end to end: SmolLM2-135M-Instruct, fp32, against transformers.

The executor drafts with SmolLM2 itself (``--draft-model`` its folder: the
upper bound of acceptance) and the scheduler runs ``--speculative
ngram+draft``: n-gram drafts where the answer quotes the prompt, the draft
model's elsewhere. Six concurrent chats (input-grounded and free ones), greedy:
every answer equals transformers' greedy generate, as plain decoding's does
(test_e2e_smollm2.py), with drafts of both sources accepted.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from support.pool import wait_pool_whole
from support.system import fp32_launcher

from pagoda_client import Client
from tests.integration.test_e2e_smollm2 import PROMPTS, _hf_greedy_chat

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUNDED = [
    "Repeat this sentence exactly, then stop: The quick brown fox jumps over the lazy dog near the river bank.",
    "Rename the function add to plus in this code and show the whole code:\n"
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\nprint(add(3, 4))\n",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def smollm2_dir():
    from executor_svc.loading.model_cache import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="module")
def drafting_system(smollm2_dir, tmp_path_factory):
    with fp32_launcher(
        smollm2_dir,
        tmp_path_factory.mktemp("logs"),
        "256MiB",
        startup_timeout_s=300,
        extra_executor_args=["--draft-model", str(smollm2_dir)],
        # Not adaptive: SmolLM2 drafting for itself does not pay, but its drafts are what is tested here.
        extra_scheduler_args=[
            "--speculative",
            "ngram+draft",
            "--num-speculative-tokens",
            "4",
            "--speculative-adaptive",
            "false",
        ],
    ) as system:
        yield system


def test_greedy_with_drafts_equals_transformers(drafting_system, smollm2_dir):
    conversations = [[{"role": "user", "content": p}] for p in GROUNDED + PROMPTS[:4]]
    with Client(drafting_system.target, timeout=300) as client:
        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            results = list(pool.map(lambda m: client.chat(m, max_tokens=MAX_TOKENS, temperature=0), conversations))
        status = client.status()
        wait_pool_whole(client)
    expected = _hf_greedy_chat(smollm2_dir, conversations, MAX_TOKENS)
    for result, (prompt_ids, hf_ids) in zip(results, expected):
        assert result.prompt_token_ids == prompt_ids
        assert result.token_ids == hf_ids
    ngram_accepted = status.spec_accepted_tokens_total - status.spec_model_accepted_tokens_total
    assert ngram_accepted > 0, "no n-gram draft was accepted"
    assert status.spec_model_accepted_tokens_total > 0.8 * status.spec_model_draft_tokens_total > 0
