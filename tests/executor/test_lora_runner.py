"""LoRA in the model runner: rows laid out by adapter, slots under pressure, refusals that leave it serving."""

from __future__ import annotations

import itertools

import pytest
import torch

from executor_svc.lora.errors import LoraAdapterError, LoraRegistryError
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.runner.step_batch import build_step_batch
from executor_svc.serving.sequence_table import SequenceState
from pagoda import step as t
from tests.executor.conftest import GREEDY, install_recorder, native_ops
from tests.executor.test_lora_adapter import LLAMA_SHAPES, bad_adapters, random_pairs, write_adapter

BLOCK_SIZE = 4
PROMPTS = {1: [5, 9, 17, 33, 2, 60, 71], 2: [40, 41, 3, 99, 12], 3: [7, 7, 8, 120, 64, 31, 18, 90, 4]}


@pytest.fixture
def adapters(tmp_path):
    """Two adapters of every module of the tiny Llama, r 4."""
    return {
        name: str(write_adapter(tmp_path / name, random_pairs(LLAMA_SHAPES, 4, seed=i)))
        for i, name in enumerate(["a1", "a2"])
    }


def _runner(checkpoints, adapters, **kwargs) -> ModelRunner:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**20)
    runner = ModelRunner(str(checkpoints["llama"]), **{**options, **kwargs})
    for name, path in adapters.items():
        runner.add_lora(name, path)
    return runner


class Driver:
    """Runs sequences (seq_id -> its PROMPTS entry) with step ids that never repeat; blocks by seq_id."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.step_ids = runner, itertools.count(1)

    def start(self, names: dict[int, str | None]) -> t.StepResult:
        new = tuple(
            t.NewSequence(
                i,
                f"r{i}",
                tuple(PROMPTS[i]),
                len(PROMPTS[i]),
                GREEDY,
                tuple(range(i * 8, i * 8 + 8)),
                0,
                len(PROMPTS[i]),
                lora_name=name or "",
            )
            for i, name in names.items()
        )
        return self.runner.execute(t.StepPlan(next(self.step_ids), new_seqs=new))

    def decode(self, seq_ids, num_steps: int) -> list[t.StepResult]:
        plans = [
            t.StepPlan(next(self.step_ids), scheduled_seqs=tuple(t.ScheduledSequence(i, 1) for i in seq_ids))
            for _ in range(num_steps)
        ]
        return [self.runner.execute(plan) for plan in plans]

    def drop(self, seq_ids) -> None:
        self.runner.execute(t.StepPlan(next(self.step_ids), dropped_seq_ids=tuple(seq_ids)))

    def alone(self, seq_id: int, name: str | None) -> list[int]:
        """One sequence from its prompt to 4 new tokens, then dropped: its tokens."""
        results = [self.start({seq_id: name}), *self.decode([seq_id], 3)]
        self.drop([seq_id])
        assert not any(r.errors for r in results), [r.errors for r in results]
        return [token for r in results for o in r.outputs for token in o.token_ids]


def test_rows_are_laid_out_by_adapter_only_when_the_runner_has_adapters():
    """Decode rows by adapter (base first), then context; chunks by adapter; segments say where each adapter's
    rows are. Without adapters the layout is today's: decode rows by context length."""

    def state(seq_id, length, name):
        return SequenceState(
            seq_id,
            "",
            list(range(length)),
            length,
            GREEDY,
            list(range(seq_id * 4, seq_id * 4 + 4)),
            length - 1,
            lora_name=name,
        )

    decodes = [state(0, 9, "b"), state(1, 3, None), state(2, 5, "a"), state(3, 2, "b"), state(4, 7, None)]
    chunks = [(state(5, 6, "b"), 5), (state(6, 4, None), 3), (state(7, 6, "a"), 4)]
    for s, n in chunks:
        s.num_computed_tokens = len(s.token_ids) - n  # the chunk ends the prompt
    scheduled = [(s, 1) for s in decodes] + chunks
    batch = build_step_batch(scheduled, BLOCK_SIZE, torch.device("cpu"), lora=True)
    assert [s.seq_id for s in batch.sample_states] == [1, 4, 2, 3, 0, 6, 7, 5]
    assert batch.lora_segments == (("a", 2, 3), ("b", 3, 5), ("a", 8, 12), ("b", 12, 17))
    plain = build_step_batch(scheduled, BLOCK_SIZE, torch.device("cpu"))
    assert [s.seq_id for s in plain.sample_states] == [3, 1, 2, 4, 0, 5, 6, 7] and plain.lora_segments == ()


def test_alternating_adapters_on_one_slot_stay_exact(checkpoints, adapters):
    """max_loras 1: a1, a2, a1, a2 one after another evict each other; every token and logit is the same bits
    as on a runner that keeps both resident, and an adapter's second run is its first."""
    runs = {}
    for max_loras in (1, 2):
        runner = _runner(checkpoints, adapters, max_loras=max_loras)
        recorder = install_recorder(runner)
        driver = Driver(runner)
        tokens = [driver.alone(seq_id, name) for seq_id, name in ((1, "a1"), (2, "a2"), (1, "a1"), (2, "a2"))]
        runs[max_loras] = tokens, [logits for _, logits in recorder.records]
        assert runner.loras.resident_names() == (("a2",) if max_loras == 1 else ("a1", "a2"))
    assert runs[1][0] == runs[2][0] and runs[1][0][:2] == runs[1][0][2:]
    assert all(torch.equal(a, b) for a, b in zip(runs[1][1], runs[2][1], strict=True))
    assert runs[1][0][0] != Driver(_runner(checkpoints, {})).alone(1, None)  # the adapter changes the tokens


def test_a_sequence_finding_every_slot_in_use_fails_alone(checkpoints, adapters):
    runner = _runner(checkpoints, adapters, max_loras=1)
    driver = Driver(runner)
    first = driver.start({1: "a1", 2: "a2", 3: None})
    assert [(e.seq_id, e.message) for e in first.errors] == [
        (2, "LoRA adapter 'a2' cannot be loaded now: all 1 slots (max_loras) hold adapters of running sequences")
    ]
    assert {o.seq_id for o in first.outputs} == {1, 3} and not runner.has_sequence(2)
    driver.decode([1, 3], 2)
    driver.drop([1])  # a1's slot is free now
    assert driver.alone(2, "a2") == Driver(_runner(checkpoints, adapters)).alone(2, "a2")
    assert runner.remove_lora("a1") == 0 and "a1" not in runner.loras
    unknown = driver.start({1: "a1"})
    assert [(e.seq_id, e.message) for e in unknown.errors] == [(1, "LoRA: unknown LoRA adapter 'a1' (registered: a2)")]


def test_an_adapter_removed_while_in_use_finishes_its_sequences_first(checkpoints, adapters):
    """remove_lora while a sequence runs with the adapter: it leaves the listing at once, the sequence keeps
    its tokens (and may come back as new, as a preempted one does), and the adapter goes when it ends."""
    alone = Driver(_runner(checkpoints, adapters)).alone(1, "a1")
    runner = _runner(checkpoints, adapters)
    driver = Driver(runner)
    tokens = [out.token_ids[0] for out in driver.start({1: "a1"}).outputs]
    assert runner.remove_lora("a1") == 1
    assert [info.name for info in runner.lora_adapters()] == ["a2"]
    with pytest.raises(LoraRegistryError, match="being removed"):
        runner.remove_lora("a1")
    tokens += [out.token_ids[0] for result in driver.decode([1], 3) for out in result.outputs]
    assert tokens == alone and "a1" in runner.loras
    driver.drop([1])
    assert "a1" not in runner.loras
    assert runner.add_lora("a1", adapters["a1"]).name == "a1"  # registered anew


def test_adding_the_same_adapter_again_returns_it(checkpoints, adapters):
    runner = _runner(checkpoints, adapters)
    first = runner.lora_adapters()[0]
    assert runner.add_lora("a1", adapters["a1"]) == first and len(first.fingerprint) == 24
    with pytest.raises(LoraRegistryError, match="registered already, from"):
        runner.add_lora("a1", adapters["a2"])
    assert runner.lora_adapters()[1].fingerprint != first.fingerprint


def test_a_refused_adapter_leaves_the_runner_serving(checkpoints, adapters, tmp_path):
    """Every kind of bad adapter is refused by add_lora; the base model and the registered adapter give the
    same tokens before and after."""
    runner = _runner(checkpoints, {"a1": adapters["a1"]}, max_lora_rank=8)
    driver = Driver(runner)
    before = [driver.alone(1, "a1"), driver.alone(3, None)]
    for kind, (folder, expected) in bad_adapters(tmp_path / "bad").items():
        with pytest.raises(LoraAdapterError) as error:
            runner.add_lora("bad", str(folder))
        assert expected in str(error.value), kind
    assert [info.name for info in runner.loras.infos()] == ["a1"]
    assert [driver.alone(1, "a1"), driver.alone(3, None)] == before


def test_steps_without_adapter_rows_keep_the_fused_decode(checkpoints, adapters, cpp_kernel):
    """With adapters registered, a decode step of base rows only still runs the one-call fused decode; a step
    with an adapter row runs the layer loop with its deltas."""
    native_ops("f32_panels", "fp32 weights are packed for the fused decode only with AVX-512 or AVX2 + FMA")
    runner = _runner(checkpoints, adapters)
    fused = runner.model.fused_decode
    assert fused is not None, runner.model.decode_path
    calls = []
    fused_run = fused.run
    fused.run = lambda *args: calls.append(1) or fused_run(*args)
    driver = Driver(runner)
    driver.alone(3, None)
    assert len(calls) == 3
    driver.alone(1, "a1")
    assert len(calls) == 3
