"""The executor verifies draft tokens: plain decoding's tokens, rejected KV dropped, the distribution kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.kv.cache import KVCacheSpec
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.sampling.sampler import SampleRequest, sample
from executor_svc.serving.sequence_table import SequenceState
from pagoda import step as t
from pagoda.params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 40
PROMPT = [5, 9, 17, 33, 40, 41, 77, 90, 3]
NUM_OUTPUT = 24
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture()
def runner(checkpoints) -> ModelRunner:
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    return ModelRunner(
        str(checkpoints["llama"]),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=NUM_BLOCKS * spec.bytes_per_block,
        attention_backend="torch",
        max_model_len=64,
    )


def _new(tokens, blocks, sampling) -> t.NewSequence:
    return t.NewSequence(1, "r1", tuple(tokens), len(tokens), sampling, tuple(blocks), 0, len(tokens))


def plain_tokens(runner: ModelRunner, sampling: SamplingParams) -> list[int]:
    out = runner.execute(t.StepPlan(0, new_seqs=(_new(PROMPT, range(16), sampling),)))
    tokens = list(out.outputs[0].token_ids)
    for step in range(1, NUM_OUTPUT):
        tokens += runner.execute(t.StepPlan(step, scheduled_seqs=(t.ScheduledSequence(1, 1),))).outputs[0].token_ids
    runner.reset()
    return tokens


class BlockTable:
    """The scheduler's side of one sequence's blocks: allocate for what a step computes, roll back rejects."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))
        self.table: list[int] = []

    def allocate(self, num_tokens: int) -> tuple[int, ...]:
        num_new = -(-num_tokens // BLOCK_SIZE) - len(self.table)
        new, self.free = self.free[:num_new], self.free[num_new:]
        self.table += new
        return tuple(new)

    def keep(self, num_computed: int) -> None:
        num_kept = -(-num_computed // BLOCK_SIZE)
        self.free = self.table[num_kept:] + self.free  # reused first: rejected KV gets overwritten
        del self.table[num_kept:]


def speculative_tokens(runner: ModelRunner, sampling: SamplingParams, truth: list[int]) -> list[int]:
    """Decodes with drafts taken from `truth`, some corrupted, mirroring the scheduler's block accounting."""
    blocks = BlockTable()
    out = runner.execute(t.StepPlan(0, new_seqs=(_new(PROMPT, blocks.allocate(len(PROMPT)), sampling),)))
    tokens = list(out.outputs[0].token_ids)
    num_computed, step = len(PROMPT), 1
    while len(tokens) < NUM_OUTPUT:
        drafts = list(truth[len(tokens) : len(tokens) + 4])
        if step % 3 == 1 and len(drafts) > 2:
            drafts[2] = (drafts[2] + 1) % 128  # rejected there
        elif step % 3 == 2 and drafts:
            drafts[0] = (drafts[0] + 1) % 128  # rejected at once
        new = blocks.allocate(num_computed + 1 + len(drafts))
        plan = t.StepPlan(step, scheduled_seqs=(t.ScheduledSequence(1, 1, new, tuple(drafts)),))
        got = runner.execute(plan).outputs[0].token_ids
        assert 1 <= len(got) <= len(drafts) + 1 and list(got[:-1]) == drafts[: len(got) - 1]
        num_computed += len(got)
        tokens += got
        blocks.keep(num_computed)
        assert runner._seqs[1].block_table == blocks.table
        assert runner._seqs[1].num_computed_tokens == num_computed
        step += 1
    runner.reset()
    return tokens[:NUM_OUTPUT]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_verified_drafts_give_the_tokens_of_plain_decoding(runner, sampling):
    truth = plain_tokens(runner, sampling)
    assert speculative_tokens(runner, sampling, truth) == truth


def test_drafts_for_a_chunk_short_of_the_end_or_past_the_blocks_fail_the_sequence(runner):
    out = runner.execute(t.StepPlan(0, new_seqs=(_new(PROMPT, range(3), GREEDY),)))
    assert not out.errors
    plan = t.StepPlan(1, scheduled_seqs=(t.ScheduledSequence(1, 1, (), (1, 2, 3)),))
    (error,) = runner.execute(plan).errors
    assert "cannot hold 13 tokens with drafts" in error.message and not runner.has_sequence(1)
    runner.execute(t.StepPlan(2, new_seqs=(t.NewSequence(2, "r2", tuple(PROMPT), 9, GREEDY, (0, 1, 2), 0, 4),)))
    plan = t.StepPlan(3, scheduled_seqs=(t.ScheduledSequence(2, 2, (), (1,)),))
    (error,) = runner.execute(plan).errors
    assert "does not reach the sequence's last token" in error.message


# Chi-square bounds at significance 0.001: 5 and 4 degrees of freedom; a two-sided z bound.
CHI2_5_DOF = 20.52
CHI2_4_DOF = 18.47
Z_BOUND = 3.29


def _chi2(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = len(tokens) * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_seeded_acceptance_keeps_the_distribution():
    """Over 20,000 seeds, a draft x at one position on a 6-token vocabulary: x is accepted with
    probability p(x), the token there is distributed as p, after a rejection as p without x
    renormalised, and after an acceptance the next token as the next position's p."""
    num_seeds, draft = 20_000, 2
    rows = torch.tensor([[1.5, 0.2, 1.0, -0.5, 0.7, 0.0], [0.1, 0.9, -0.3, 0.4, 1.2, -1.0]])  # [2, V]
    states = [
        SequenceState(i, "r", [1, 2, 3], 3, SamplingParams(temperature=1.0, seed=i), [0], 3, draft_token_ids=(draft,))
        for i in range(num_seeds)
    ]
    requests = [SampleRequest(s.sampling, s.tokens_at_row(j), 3) for s in states for j in range(2)]
    sampled = [out.token_id for out in sample(rows.repeat(num_seeds, 1), requests)]
    emitted = [s.token_ids[3:] for s in states if s.accept(sampled[2 * s.seq_id : 2 * s.seq_id + 2], 16)]
    probs = torch.softmax(rows, dim=-1).double().numpy()
    first = np.array([e[0] for e in emitted])
    accepted = np.array([len(e) == 2 for e in emitted])
    p_draft = probs[0, draft]
    z = (accepted.mean() - p_draft) / np.sqrt(p_draft * (1 - p_draft) / num_seeds)
    assert abs(z) < Z_BOUND
    assert _chi2(first, probs[0]) < CHI2_5_DOF
    rejected_probs = np.delete(probs[0], draft) / (1 - p_draft)
    rejected = np.array([token - (token > draft) for token in first[~accepted]])
    assert _chi2(rejected, rejected_probs) < CHI2_4_DOF
    second = np.array([e[1] for e, a in zip(emitted, accepted) if a])
    assert _chi2(second, probs[1]) < CHI2_5_DOF
