"""`pagoda-executor --simulate` behind a real scheduler: deterministic tokens, real text, no torch."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from executor_svc.config import load_config
from executor_svc.simulate.runner import simulated_runner
from pagoda import step as t
from pagoda.launch.launcher import Launcher
from pagoda.params import SamplingParams
from pagoda_client import Client

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PROMPT = [40, 41, 42, 43, 44, 45]
MAX_TOKENS = 24


def expected_tokens(prompt: list[int], sampling: SamplingParams, num_tokens: int) -> list[int]:
    """What a simulated executor samples for `prompt`, computed in this process."""
    runner, _ = simulated_runner(load_config(["--simulate", "--simulate-time-scale", "0"]))
    blocks = tuple(range(-(-(len(prompt) + num_tokens) // runner.info.block_size)))
    new = t.NewSequence(1, "r", tuple(prompt), len(prompt), sampling, blocks, 0, len(prompt))
    tokens = list(runner.execute(t.StepPlan(0, new_seqs=(new,))).outputs[0].token_ids)
    while len(tokens) < num_tokens:
        tokens += runner.execute(t.StepPlan(1, scheduled_seqs=(t.ScheduledSequence(1, 1),))).outputs[0].token_ids
    return tokens


def _system(
    tmp_path_factory,
    name: str,
    num_executors: int,
    time_scale: str,
    event_loop: str = "uvloop",
    tokenizer: str = "word-level",
) -> Launcher:
    return Launcher(
        num_executors=num_executors,
        log_dir=tmp_path_factory.mktemp(name),
        extra_executor_args=["--simulate", "--simulate-time-scale", time_scale, "--simulate-tokenizer", tokenizer],
        extra_scheduler_args=["--event-loop", event_loop],
        startup_timeout_s=120,
    )


@pytest.fixture(scope="module")
def two_systems(tmp_path_factory):
    """Two schedulers, each over its own simulated executor (no sleeping): one on uvloop (the default) with the
    word-level tokenizer, one on asyncio's own loop with the byte-level one."""
    b_args = ("asyncio", "byte-level")
    with _system(tmp_path_factory, "a", 1, "0") as a, _system(tmp_path_factory, "b", 1, "0", *b_args) as b:
        yield a, b


def test_request_completes_with_the_deterministic_tokens_and_their_text(two_systems):
    a, _ = two_systems
    with Client(a.target, timeout=60) as client:
        result = client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert result.token_ids == expected_tokens(PROMPT, SamplingParams(temperature=0.0), MAX_TOKENS)
        assert result.finish_reason == "length" and result.usage.completion_tokens == MAX_TOKENS
        # The text reads as the continuation of the prompt's text (words are joined by spaces).
        assert client.detokenize(PROMPT) + result.text == client.detokenize(PROMPT + result.token_ids)
        assert len(result.text.split()) >= MAX_TOKENS // 2
        assert client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0).token_ids == result.token_ids
        chat = client.chat([{"role": "user", "content": "Hello world"}], max_tokens=5)
        assert len(chat.token_ids) == 5 and chat.text


def test_seeded_request_gives_the_same_tokens_on_two_executors(two_systems):
    a, b = two_systems
    kwargs = dict(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, seed=11)
    with Client(a.target, timeout=60) as on_a, Client(b.target, timeout=60) as on_b:
        tokens = on_a.generate(**kwargs).token_ids
        assert tokens == on_b.generate(**kwargs).token_ids
        assert tokens == expected_tokens(PROMPT, SamplingParams(temperature=0.8, seed=11), MAX_TOKENS)
        assert on_b.generate(**{**kwargs, "seed": 12}).token_ids != tokens
        incarnations = {c.status().executors[0].incarnation_id for c in (on_a, on_b)}
        assert len(incarnations) == 2  # two executor processes
    assert '"event_loop": "uvloop"' in a.logs()["scheduler"]
    assert '"event_loop": "asyncio"' in b.logs()["scheduler"]


def test_both_tokenizers_give_the_same_text_after_a_prompt(two_systems):
    """The word-level tokenizer is detokenized by windows, the byte-level one by token bytes; the same tokens
    read the same after a prompt, streamed or not, with stop strings."""
    a, b = two_systems
    kwargs = dict(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    with Client(a.target, timeout=60) as on_a, Client(b.target, timeout=60) as on_b:
        word_level, byte_level = on_a.generate(**kwargs), on_b.generate(**kwargs)
        assert byte_level.token_ids == word_level.token_ids
        assert byte_level.text == word_level.text and byte_level.text.startswith(" ")
        assert "".join(delta.text for delta in on_b.stream(**kwargs)) == byte_level.text
        stop = byte_level.text.split()[2]
        stopped = on_b.generate(**kwargs, stop=[stop])
        assert stopped.finish_reason == "stop" and byte_level.text.startswith(stopped.text + stop)


def test_stop_strings_and_logprobs_work_on_simulated_text(two_systems):
    a, _ = two_systems
    with Client(a.target, timeout=60) as client:
        full = client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
        assert len(full.logprobs) == MAX_TOKENS and all(len(e.top) == 2 for e in full.logprobs)
        word = full.text.split()[3].strip(".,!?;:")
        stopped = client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[word])
        assert stopped.finish_reason == "stop" and word not in stopped.text
        assert full.text.startswith(stopped.text) and len(stopped.token_ids) < MAX_TOKENS


def test_executor_process_never_imports_torch(two_systems):
    a, _ = two_systems
    maps = Path(f"/proc/{a.executor_pids[0]}/maps").read_text()
    assert "libtorch" not in maps and "torch" not in maps
    script = (
        "import sys, executor_svc.main as m\n"
        "from executor_svc.config import load_config\n"
        "loaded = m.load_simulated(load_config(['--simulate']))\n"
        "assert loaded.runner.info.vocab_size == 512\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'numpy')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_sigkill_of_a_simulated_executor_loses_nothing(tmp_path_factory):
    """The executor-loss path, at simulated step times: every stream completes with its fault-free tokens."""
    requests = [dict(token_ids=[50 + i] * (8 + i), max_tokens=64, temperature=0.8, seed=i) for i in range(8)]
    expected = [expected_tokens(r["token_ids"], SamplingParams(temperature=0.8, seed=r["seed"]), 64) for r in requests]
    with _system(tmp_path_factory, "kill", 2, "1") as system, Client(system.target, timeout=120) as client:
        received = [0]
        lock = threading.Lock()
        killed = threading.Event()

        def stream(i: int) -> list[int]:
            tokens = []
            for delta in client.stream(**requests[i]):
                tokens += delta.token_ids
                with lock:
                    received[0] += len(delta.token_ids)
                    if received[0] >= 8 * 64 // 4 and not killed.is_set():
                        killed.set()
                        system.kill_executor(0, signal.SIGKILL)
            return tokens

        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(stream, range(len(requests))))
        assert killed.is_set()
        assert got == expected
