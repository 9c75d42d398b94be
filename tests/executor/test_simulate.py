"""The simulated runner, its cost model and its tokenizer, in-process (no torch needed)."""

from __future__ import annotations

import time

import pytest

from executor_svc.config import load_config
from executor_svc.simulate.cost import SMOLLM2_BF16_CPU, StepCost, StepFeatures
from executor_svc.simulate.runner import SimulatedRunner, simulated_runner, token_hash
from executor_svc.simulate.tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, build_tokenizer, vocabulary
from pagoda import step as t
from pagoda.params import SamplingParams
from pagoda.step import ExecutorInfo

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=7)
INFO = ExecutorInfo(
    incarnation_id="",
    model_name="sim",
    architecture="Simulated",
    dtype="none",
    kv_cache_dtype="none",
    device="simulated",
    block_size=4,
    num_kv_blocks=64,
    max_model_len=64,
    vocab_size=300,
    eos_token_ids=(0, 2),
    tokenizer_json="",
    chat_template="",
    bos_token="",
    eos_token="",
)
NO_SLEEP = StepCost(0.0, 0.0, 0.0, 0.0, 0.0)


def _runner(cost: StepCost = NO_SLEEP) -> SimulatedRunner:
    return SimulatedRunner(INFO, cost)


def _new(seq_id, tokens, blocks, num_scheduled, sampling=GREEDY, num_computed=0):
    return t.NewSequence(
        seq_id, f"r{seq_id}", tuple(tokens), len(tokens), sampling, tuple(blocks), num_computed, num_scheduled
    )


def _generate(runner: SimulatedRunner, seq_id: int, prompt, sampling, num_tokens: int, chunk: int = 0) -> list[int]:
    """Prefill `prompt` (in chunks of `chunk` if given), then decode until `num_tokens` are out."""
    blocks = list(range(seq_id * 16, seq_id * 16 + 16))
    chunk = chunk or len(prompt)
    out = runner.execute(t.StepPlan(0, new_seqs=(_new(seq_id, prompt, blocks, chunk, sampling),)))
    done = chunk
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        out = runner.execute(t.StepPlan(1, scheduled_seqs=(t.ScheduledSequence(seq_id, n),)))
        done += n
    tokens = [tok for o in out.outputs for tok in o.token_ids]
    while len(tokens) < num_tokens:
        out = runner.execute(t.StepPlan(2, scheduled_seqs=(t.ScheduledSequence(seq_id, 1),)))
        assert not out.errors, out.errors
        tokens.extend(out.outputs[0].token_ids)
    return tokens


def test_tokens_depend_on_the_sequence_not_on_the_batch_or_chunking():
    prompt = [10, 11, 12, 13, 14, 15, 16]
    alone = _generate(_runner(), 1, prompt, SEEDED, 12)
    chunked = _generate(_runner(), 1, prompt, SEEDED, 12, chunk=3)
    runner = _runner()
    _generate(runner, 2, [40, 41, 42], GREEDY, 5)  # another sequence held alongside
    assert _generate(runner, 1, prompt, SEEDED, 12) == alone == chunked
    assert _generate(_runner(), 1, prompt, GREEDY, 12) != alone  # greedy ignores the seed: another stream
    assert _generate(_runner(), 1, prompt, SamplingParams(temperature=0.8, seed=8), 12) != alone


def test_a_resent_sequence_continues_identically():
    """Moved or resumed: prompt plus delivered tokens, recomputed, give the same next tokens."""
    prompt = [20, 21, 22, 23]
    full = _generate(_runner(), 1, prompt, SEEDED, 10)
    runner = _runner()
    resent = t.NewSequence(5, "r", tuple(prompt + full[:6]), len(prompt), SEEDED, tuple(range(8)), 0, 10)
    tokens = list(runner.execute(t.StepPlan(0, new_seqs=(resent,))).outputs[0].token_ids)
    while len(tokens) < 4:
        tokens += runner.execute(t.StepPlan(1, scheduled_seqs=(t.ScheduledSequence(5, 1),))).outputs[0].token_ids
    assert tokens == full[6:]


def test_tokens_avoid_special_ids_and_stay_in_the_vocabulary():
    tokens = _generate(_runner(), 1, [5, 6], GREEDY, 60)
    assert all(len(SPECIAL_TOKENS) <= tok < INFO.vocab_size for tok in tokens)
    assert len(set(tokens)) > 30  # spread over the vocabulary, not a constant


def test_logprobs_are_deterministic_and_shaped_as_asked():
    sampling = SamplingParams(temperature=0.0, logprobs=3)
    runner = _runner()
    out = runner.execute(t.StepPlan(0, new_seqs=(_new(1, [9, 8, 7], range(4), 3, sampling),))).outputs[0]
    entry = out.logprobs[0]
    assert entry.sampled.token_id == out.token_ids[0] and -4 < entry.sampled.logprob <= 0
    assert [e.token_id for e in entry.top][0] == out.token_ids[0] and len(entry.top) == 3
    assert [e.logprob for e in entry.top] == sorted((e.logprob for e in entry.top), reverse=True)
    again = _runner().execute(t.StepPlan(0, new_seqs=(_new(1, [9, 8, 7], range(4), 3, sampling),))).outputs[0]
    assert again == out
    plain = _runner().execute(t.StepPlan(0, new_seqs=(_new(1, [9, 8, 7], range(4), 3),))).outputs[0]
    assert plain.logprobs == () and plain.token_ids == out.token_ids


def test_plan_errors_hit_only_their_sequence():
    runner = _runner()
    out = runner.execute(
        t.StepPlan(
            0,
            new_seqs=(_new(1, [5, 6], [0], 2), _new(2, [5, 300], [1], 2), _new(3, [5, 6], [64], 2)),
            scheduled_seqs=(t.ScheduledSequence(9, 1),),
        )
    )
    errors = {e.seq_id: e.message for e in out.errors}
    assert "outside the vocabulary" in errors[2] and "out of range" in errors[3] and "unknown" in errors[9]
    assert [o.seq_id for o in out.outputs] == [1] and runner.num_sequences() == 1
    fits = runner.execute(t.StepPlan(1, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
    assert fits.errors == () and runner.num_sequences() == 1  # 3 tokens fit in one block of 4
    full = runner.execute(t.StepPlan(2, scheduled_seqs=(t.ScheduledSequence(1, 1), t.ScheduledSequence(1, 1))))
    assert "appears twice" in full.errors[0].message and runner.num_sequences() == 0
    runner.execute(t.StepPlan(3, new_seqs=(_new(4, [5], [2], 1),)))
    runner.reset()
    assert runner.num_sequences() == 0


def test_step_sleeps_the_modelled_time_and_reports_it(monkeypatch):
    cost = StepCost(0.02, 0.001, 0.0, 0.0, 0.0)  # 20 ms + 1 ms per prompt token
    runner = _runner(cost)
    start = time.perf_counter()
    out = runner.execute(t.StepPlan(0, new_seqs=(_new(1, list(range(10, 20)), [0, 1, 2], 10),)))
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.03 and out.num_scheduled_tokens == 10
    assert out.timings.prepare_ns + out.timings.forward_ns >= 30_000_000
    sleeps: list[float] = []  # recorded, not timed: a loaded machine can stall any step for longer than a bound
    monkeypatch.setattr(time, "sleep", sleeps.append)
    runner.execute(t.StepPlan(1, dropped_seq_ids=(1,)))  # nothing to compute: no sleep
    assert sleeps == []


def test_features_count_prefill_decode_and_attention():
    f = StepFeatures.of([(0, 4), (10, 3), (7, 1), (99, 1), (5, 0)])
    assert f == StepFeatures(prefill_tokens=7, prefill_pairs=10 + (30 + 6), decode_seqs=2, context_tokens=8 + 100)
    assert f.row() == (1, 7, 46, 2, 108)


def test_cost_is_linear_in_the_features_and_zero_for_an_empty_step():
    cost = StepCost(0.01, 1e-4, 1e-8, 2e-4, 1e-6)
    f = StepFeatures(prefill_tokens=100, prefill_pairs=5050, decode_seqs=8, context_tokens=4000)
    assert cost.seconds(f) == pytest.approx(0.01 + 0.01 + 5.05e-5 + 1.6e-3 + 4e-3)
    assert cost.seconds(StepFeatures()) == 0.0
    assert StepCost.from_coefficients(cost.coefficients()) == cost
    with pytest.raises(ValueError, match="must not be negative"):
        StepCost(0.01, -1.0, 0.0, 0.0, 0.0)


def test_fitted_model_is_plausible_for_smollm2():
    """The committed constants: a decode step of 32 at context 512 takes milliseconds, and more work costs more."""
    decode = SMOLLM2_BF16_CPU.seconds(StepFeatures.of([(511, 1)] * 32))
    assert 0.001 < decode < 1.0
    assert SMOLLM2_BF16_CPU.seconds(StepFeatures.of([(0, 512)])) > SMOLLM2_BF16_CPU.seconds(StepFeatures.of([(0, 32)]))


def test_vocabulary_is_fixed_and_round_trips_words():
    assert vocabulary(300) == vocabulary(300) and vocabulary(300)[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    tokenizer = build_tokenizer(300)
    ids = tokenizer.encode("Hello world, the café! zzz").ids
    assert tokenizer.decode(ids) == "hello world, the café!"  # unknown words are <unk>, a special token
    with pytest.raises(ValueError, match="vocab size"):
        vocabulary(MIN_VOCAB_SIZE - 1)


def test_byte_level_form_has_the_same_ids_and_is_detokenized_by_bytes():
    from scheduler_svc.text.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, WindowDetokenizer
    from scheduler_svc.text.tokenizer import Tokenizer

    text = "Hello world, the café! zzz 日本 ñandú."
    word_level, byte_level = build_tokenizer(300), build_tokenizer(300, "byte-level")
    ids = byte_level.encode(text).ids
    assert ids == word_level.encode(text).ids and byte_level.get_vocab_size() == 300
    assert byte_level.decode(ids) == " hello world, the café! 日本 ñandú."
    kinds = {kind: Tokenizer(build_tokenizer(300, kind)) for kind in ("word-level", "byte-level")}
    assert isinstance(IncrementalDetokenizer(kinds["byte-level"], ids), ByteLevelDetokenizer)
    assert isinstance(IncrementalDetokenizer(kinds["word-level"], ids), WindowDetokenizer)
    with pytest.raises(ValueError, match="unknown simulated tokenizer"):
        build_tokenizer(300, "sentencepiece")


def test_config_builds_the_runner_and_checks_the_flags():
    runner, tokenizer = simulated_runner(
        load_config(["--simulate", "--simulate-kv-blocks", "100", "--block-size", "8"])
    )
    assert (runner.info.num_kv_blocks, runner.info.block_size, runner.info.vocab_size) == (100, 8, 512)
    assert runner.info.eos_token_ids == tokenizer.eos_token_ids == (0, 2)
    assert runner.cost == SMOLLM2_BF16_CPU
    with pytest.raises(SystemExit):
        load_config(["--simulate", "--simulate-vocab-size", "10"])
    with pytest.raises(SystemExit):
        load_config(["--simulate", "--simulate-time-scale", "-1"])
    with pytest.raises(SystemExit):
        load_config(["--simulate", "--simulate-tokenizer", "bpe"])
    byte_level = simulated_runner(load_config(["--simulate", "--simulate-tokenizer", "byte-level"]))[1]
    assert '"ByteLevel"' in byte_level.tokenizer_json and '"ByteLevel"' not in tokenizer.tokenizer_json


def test_token_hash_is_keyed_by_seed_position_and_recent_tokens():
    base = token_hash(1, 10, [1, 2, 3, 4, 5])
    assert base == token_hash(1, 10, [9, 2, 3, 4, 5])  # only the last four tokens count
    assert len({base, token_hash(2, 10, [1, 2, 3, 4, 5]), token_hash(1, 11, [1, 2, 3, 4, 5])}) == 3
    assert base != token_hash(1, 10, [1, 2, 3, 4, 6])
