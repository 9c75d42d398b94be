"""The draft model through the real system (tiny random Llama): the same tokens as without speculation.

Two systems of two executors each, with small KV pools so that concurrent
requests are preempted and recomputed; the module's plain system
(`tiny_system`) and transformers are the references:

- ``smaller``: a one-layer random draft of the tiny model's vocabulary and
  ``--speculative ngram+draft`` (n-gram drafts first, the draft model where
  none matches): the draft model's drafts are almost all rejected;
- ``itself``: the tiny model drafting for itself and ``--speculative draft``:
  its drafts are accepted (it proposes its own tokens), so stop strings fall
  inside accepted runs and a killed executor leaves accepted runs in flight.

An executor started with a bad ``--draft-model`` (no such folder, no
tokenizer, another vocabulary) exits at once with a message naming the flag
and the problem, before loading any weights.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import signal
import subprocess

import pytest
from support.pool import wait_pool_whole
from support.services import executor_service
from support.streams import KillOnce, mixed_requests, run_streams
from support.system import fp32_launcher
from support.tiny_model import build_tiny_model, hf_greedy

from pagoda_client import Client

pytestmark = pytest.mark.integration
# Not adaptive: the draft model drafts in every step the batch rule allows, even where it does not pay (a tiny
# model drafting for itself costs what it saves), so that its KV is exercised throughout.
SPECULATIVE_ARGS = ["--num-speculative-tokens", "4", "--speculative-max-batch", "8", "--speculative-adaptive", "false"]


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_model_dir, tmp_path_factory):
    """A one-layer random Llama with the tiny model's tokenizer (other weights)."""
    folder = tmp_path_factory.mktemp("draft") / "tiny-draft"
    return build_tiny_model(folder, seed=7, num_layers=1, tokenizer_from=tiny_model_dir)


def _system(model_dir, draft_dir, method: str, logs):
    """Two executors with 12 KV blocks of 16 tokens each (both models' KV), their scheduler speculating."""
    return fp32_launcher(
        model_dir,
        logs,
        kv_cache_memory="144KiB" if draft_dir != model_dir else "192KiB",
        block_size=16,
        num_executors=2,
        extra_executor_args=["--draft-model", str(draft_dir)],
        extra_scheduler_args=["--speculative", method, *SPECULATIVE_ARGS],
    )


@pytest.fixture(scope="module")
def smaller_system(tiny_model_dir, tiny_draft_dir, tmp_path_factory):
    with _system(tiny_model_dir, tiny_draft_dir, "ngram+draft", tmp_path_factory.mktemp("smaller-logs")) as system:
        yield system


@pytest.fixture(scope="module")
def itself_system(tiny_model_dir, tmp_path_factory):
    with _system(tiny_model_dir, tiny_model_dir, "draft", tmp_path_factory.mktemp("itself-logs")) as system:
        yield system


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts of 10-60 tokens, half of them repeating a phrase (what n-gram drafts predict)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(3, 384) for _ in range(rng.randrange(3, 8) if i % 2 else 60)]
        prompts.append((phrase * 12)[: rng.randrange(10, 60)])
    return prompts


def _generate_all(target: str, requests: list[dict]) -> list:
    with Client(target, timeout=180) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda kwargs: client.generate(**kwargs), requests))


# The tiny model falls into a loop after these prompts within 80 tokens (n-gram drafts predict it).
LOOPING_PROMPTS = [[49] * 32, [298] * 30]


@pytest.mark.parametrize("system_name", ["smaller", "itself"])
def test_greedy_equals_transformers_across_preemption(request, system_name, tiny_model_dir):
    system = request.getfixturevalue(f"{system_name}_system")
    prompts = LOOPING_PROMPTS + _prompts(6, seed=1)
    requests = [dict(token_ids=p, max_tokens=80, temperature=0, ignore_eos=True) for p in prompts]
    results = _generate_all(system.target, requests)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(tiny_model_dir, prompt, 80)
    with Client(system.target, timeout=30) as client:
        status = client.status()
        wait_pool_whole(client)
    assert status.num_preemptions_total > 0, "the pool was large enough: nothing was preempted"
    assert all(e.draft_model for e in status.executors)
    assert status.spec_model_draft_tokens_total > 0
    model_acceptance = status.spec_model_accepted_tokens_total / status.spec_model_draft_tokens_total
    if system_name == "itself":
        assert model_acceptance > 0.9
    else:
        # n-gram drafts of the looping prompts are accepted; the random draft model's rarely are.
        assert status.spec_accepted_tokens_total - status.spec_model_accepted_tokens_total > 0
        assert model_acceptance < 0.5


@pytest.mark.parametrize("system_name", ["smaller", "itself"])
def test_seeded_sampling_gives_the_tokens_of_plain_decoding(request, system_name, tiny_system):
    system = request.getfixturevalue(f"{system_name}_system")
    prompts = _prompts(6, seed=2)
    requests = [
        dict(token_ids=p, max_tokens=40, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    speculated = _generate_all(system.target, requests)
    plain = _generate_all(tiny_system.target, requests)
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]


def test_stop_strings_inside_accepted_runs_end_where_plain_decoding_ends(itself_system, tiny_system):
    prompt = _prompts(1, seed=3)[0]
    with Client(tiny_system.target, timeout=60) as client:
        full = client.generate(token_ids=prompt, max_tokens=60, temperature=0, ignore_eos=True)
    # Stop strings cut from the text at many points: with the model drafting for itself, most fall inside
    # an accepted run of drafts.
    text = full.text
    stops = sorted({text[i : i + 3] for i in range(4, len(text) - 3, 5) if text[i : i + 3].strip()})
    assert len(stops) >= 3, f"too little text to cut stop strings from: {text!r}"
    requests = [dict(token_ids=prompt, max_tokens=60, temperature=0, ignore_eos=True, stop=[s]) for s in stops]
    speculated = _generate_all(itself_system.target, requests)
    plain = _generate_all(tiny_system.target, requests)
    for stop, got, want in zip(stops, speculated, plain):
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason), stop
        assert got.usage.completion_tokens == want.usage.completion_tokens


def test_prefix_cache_hits_give_the_same_tokens(itself_system, tiny_model_dir):
    prompt = _prompts(1, seed=4)[0] * 2
    with Client(itself_system.target, timeout=60) as client:
        before = client.status()
        first = client.generate(token_ids=prompt, max_tokens=50, temperature=0, ignore_eos=True)
        second = client.generate(token_ids=prompt, max_tokens=50, temperature=0, ignore_eos=True)
        after = client.status()
        assert second.usage.cached_tokens > 0
        wait_pool_whole(client)
    assert first.token_ids == second.token_ids == hf_greedy(tiny_model_dir, prompt, 50)
    drafted = after.spec_model_draft_tokens_total - before.spec_model_draft_tokens_total
    accepted = after.spec_model_accepted_tokens_total - before.spec_model_accepted_tokens_total
    # The second request's draft model starts from the cached blocks' draft KV: still right.
    assert drafted > 0 and accepted / drafted > 0.9


def test_pool_is_whole_after_200_mixed_requests(smaller_system):
    rng = random.Random(5)
    requests = []
    for i, prompt in enumerate(_prompts(200, seed=6)):
        kwargs = dict(token_ids=prompt, max_tokens=rng.randrange(1, 60), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.3:
            kwargs.update(temperature=1.0, seed=i)
        else:
            kwargs.update(temperature=0)
        if rng.random() < 0.2:
            kwargs.update(stop=["e", " t"])
        requests.append(kwargs)
    results = _generate_all(smaller_system.target, requests)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    with Client(smaller_system.target, timeout=30) as client:
        wait_pool_whole(client, nothing_waiting=True)


def test_executor_killed_mid_stream_changes_no_token(itself_system):
    """Runs last for its system: the killed executor stays dead; its sequences are recomputed on the other."""
    requests = mixed_requests(8, 80, seed=900)
    with Client(itself_system.target, timeout=180) as client:
        expected = run_streams(client, requests)
        total = sum(len(record.token_ids) for record in expected)
        kill = KillOnce(total // 4, lambda: os.kill(itself_system.executors[0].pid, signal.SIGKILL))
        got = run_streams(client, requests, kill)
    assert kill.fired_at is not None, "the executor was never killed"
    for i, (run, reference) in enumerate(zip(got, expected)):
        assert (run.token_ids, run.text) == (reference.token_ids, reference.text), f"stream {i}"


def _start_fails(model_dir, log_dir, name: str, draft: str) -> str:
    """The log of an executor that must exit with status 1 when started with ``--draft-model draft``."""
    service = executor_service(name, model_dir, log_dir, ["--draft-model", draft]).start()
    try:
        assert service.process is not None
        returncode = service.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        service.stop()
        pytest.fail(f"{name} did not exit:\n{service.log_text()[-3000:]}")
    assert returncode == 1, service.log_text()[-3000:]
    return service.log_text()


def test_a_bad_draft_model_stops_the_executor_with_a_clear_error(tiny_model_dir, tiny_draft_dir, tmp_path):
    missing = tmp_path / "no-such-draft"
    log = _start_fails(tiny_model_dir, tmp_path, "missing", str(missing))
    assert f"--draft-model '{missing}': model '{missing}' not found" in log
    untokenized = tmp_path / "untokenized"
    shutil.copytree(tiny_draft_dir, untokenized)
    (untokenized / "tokenizer.json").unlink()
    log = _start_fails(tiny_model_dir, tmp_path, "untokenized", str(untokenized))
    assert "no tokenizer.json; a draft model needs the model's tokenizer" in log
    other = build_tiny_model(tmp_path / "other-vocab", vocab_size=256, num_layers=1)
    log = _start_fails(tiny_model_dir, tmp_path, "other", str(other))
    # A byte-level BPE trained for 256 tokens keeps its whole alphabet: 259.
    assert "its tokenizer is not the model's (259 tokens instead of 384)" in log
    assert "executor_ready" not in log
