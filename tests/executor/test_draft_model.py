"""The executor's draft model: its proposals, verified by the target, give plain decoding's tokens; its KV.

Every tiny architecture serves as the target with a smaller random draft model
of its own family (one layer), and with itself as the draft (then, in fp32,
every draft is accepted: the draft's KV, caught up and rolled back, holds what
the target's does). The test decodes as the scheduler plans, mirroring its
block accounting (allocate for the drafts, keep the blocks of the computed
tokens after each step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from executor_svc.kv.cache import KVCacheSpec
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.serving.sequence_table import SequenceState
from pagoda import step as t
from pagoda.constraint import Constraint
from pagoda.params import SamplingParams
from tests.executor.conftest import ARCHS, load_hf, long_rope, make_tiny_checkpoint

BLOCK_SIZE = 4
PROMPT = [5, 9, 17, 33, 40, 41, 77, 90, 3]
NUM_OUTPUT = 24
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
# A one-layer draft of each family (Gemma 3 names its layers' kinds).
DRAFT_OVERRIDES = {"gemma3": dict(layer_types=["full_attention"])}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    """A smaller random checkpoint (one layer, other weights) of every tiny architecture."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        arch: make_tiny_checkpoint(root, arch, num_hidden_layers=1, **DRAFT_OVERRIDES.get(arch, {})) for arch in ARCHS
    }


def make_runner(target: Path, draft: Path | None, num_blocks: int = 64, **options) -> ModelRunner:
    """fp32, torch attention, 4-token blocks; the KV budget holds ``num_blocks`` blocks of the model (alone)."""
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    options = dict(kv_cache_memory_bytes=num_blocks * spec.bytes_per_block, **options)
    return ModelRunner(
        str(target),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        attention_backend="torch",
        max_model_len=128,
        draft_model_path=str(draft) if draft is not None else None,
        **options,
    )


class Blocks:
    """The scheduler's side of the blocks: allocate what a step computes, keep those of the computed tokens."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        table = self.tables.setdefault(seq_id, [])
        num_new = -(-num_tokens // BLOCK_SIZE) - len(table)
        new, self.free = self.free[:num_new], self.free[num_new:]
        table += new
        return tuple(new)

    def keep(self, seq_id: int, num_computed: int) -> None:
        table = self.tables[seq_id]
        num_kept = -(-num_computed // BLOCK_SIZE)
        self.free = table[num_kept:] + self.free  # reused first: rejected KV gets overwritten
        del table[num_kept:]


def plain_tokens(runner: ModelRunner, sampling: SamplingParams, prompt=PROMPT, num_output=NUM_OUTPUT) -> list[int]:
    """One token per step, no drafts."""
    new = t.NewSequence(
        1, "r1", tuple(prompt), len(prompt), sampling, tuple(range(16)), 0, len(prompt),
        long_rope=long_rope(runner, len(prompt)),
    )  # fmt: skip
    tokens = list(runner.execute(t.StepPlan(0, new_seqs=(new,))).outputs[0].token_ids)
    for step in range(1, num_output):
        tokens += runner.execute(t.StepPlan(step, scheduled_seqs=(t.ScheduledSequence(1, 1),))).outputs[0].token_ids
    runner.reset()
    return tokens


def drafted_tokens(
    runner: ModelRunner, sampling: SamplingParams, k: int = 3, drafts_at=lambda step: True
) -> tuple[list[int], float]:
    """(tokens, acceptance): every decode step (those ``drafts_at`` names) asks the draft model for k drafts."""
    blocks = Blocks(runner.kv_cache.num_blocks)
    new = t.NewSequence(
        1, "r1", tuple(PROMPT), len(PROMPT), sampling, blocks.allocate(1, len(PROMPT)), 0, len(PROMPT),
        long_rope=long_rope(runner, len(PROMPT)),
    )  # fmt: skip
    tokens = list(runner.execute(t.StepPlan(0, new_seqs=(new,))).outputs[0].token_ids)
    num_computed, step, num_accepted, num_drafting = len(PROMPT), 1, 0, 0
    while len(tokens) < NUM_OUTPUT:
        num_model = k if drafts_at(step) else 0
        num_drafting += num_model > 0
        new_block_ids = blocks.allocate(1, num_computed + 1 + num_model)
        plan = t.StepPlan(step, scheduled_seqs=(t.ScheduledSequence(1, 1, new_block_ids, (), num_model),))
        result = runner.execute(plan)
        assert not result.errors, result.errors
        got = result.outputs[0].token_ids
        assert 1 <= len(got) <= num_model + 1
        num_computed += len(got)
        num_accepted += len(got) - 1
        tokens += got
        blocks.keep(1, num_computed)
        state = runner._seqs[1]
        assert (state.block_table, state.num_computed_tokens) == (blocks.tables[1], num_computed)
        assert state.num_draft_computed <= num_computed
        step += 1
    runner.reset()
    return tokens[:NUM_OUTPUT], num_accepted / (k * num_drafting)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_model_drafts_give_the_tokens_of_plain_decoding(checkpoints, drafts, arch, sampling):
    truth = plain_tokens(make_runner(checkpoints[arch], None), sampling)
    tokens, _ = drafted_tokens(make_runner(checkpoints[arch], drafts[arch]), sampling)
    assert tokens == truth
    tokens, acceptance = drafted_tokens(make_runner(checkpoints[arch], checkpoints[arch]), sampling)
    assert tokens == truth
    # Drafting for itself with the request's own random stream, the model proposes its own tokens: in fp32
    # all of them (a near-tie rounded otherwise in a chunk than in a decode row could reject one).
    assert acceptance >= 0.9


@pytest.mark.parametrize("arch", ["llama", "mistral_window", "gemma3"])
def test_model_drafts_after_steps_without_them_catch_the_draft_kv_up(checkpoints, drafts, arch):
    """As when the scheduler turns the draft model off for a while: its KV catches up on all the tokens since."""
    truth = plain_tokens(make_runner(checkpoints[arch], None), GREEDY)

    def drafts_at(step: int) -> bool:
        return step in (1, 2) or step >= 9

    tokens, _ = drafted_tokens(make_runner(checkpoints[arch], drafts[arch]), GREEDY, drafts_at=drafts_at)
    assert tokens == truth
    tokens, acceptance = drafted_tokens(make_runner(checkpoints[arch], checkpoints[arch]), GREEDY, drafts_at=drafts_at)
    assert tokens == truth and acceptance >= 0.9


# Sequence id -> prompt, in the mixed steps: 1 drafts with the model; 2 verifies drafts the plan gives; 3 is
# admitted at step 2 with its prompt in two chunks, then drafts with the model; 4 decodes plainly.
MIXED_PROMPTS = {1: PROMPT, 2: PROMPT[::-1] + [7], 3: [11, 12, 13] * 5, 4: [60, 61]}
MIXED_OUTPUT = 16


class MixedPlans:
    """Plans of the mixed steps, with the scheduler's block accounting."""

    def __init__(self, num_blocks: int, truth: dict[int, list[int]]) -> None:
        self.blocks = Blocks(num_blocks)
        self.truth = truth
        self.tokens: dict[int, list[int]] = {i: [] for i in MIXED_PROMPTS}
        self.computed = dict.fromkeys(MIXED_PROMPTS, 0)
        # The most tokens one step gave each sequence.
        self.most_per_step = dict.fromkeys(MIXED_PROMPTS, 0)

    def plan(self, step: int) -> t.StepPlan:
        entries = [self._entry(i, step) for i in MIXED_PROMPTS if len(self.tokens[i]) < MIXED_OUTPUT]
        new = tuple(e for e in entries if isinstance(e, t.NewSequence))
        return t.StepPlan(step, new, tuple(e for e in entries if isinstance(e, t.ScheduledSequence)))

    def _entry(self, i: int, step: int) -> t.NewSequence | t.ScheduledSequence | None:
        prompt, computed = MIXED_PROMPTS[i], self.computed[i]
        if computed < len(prompt) - 1 or (computed < len(prompt) and not self.tokens[i]):
            if i == 3 and step < 2:
                return None
            num_tokens = 8 if i == 3 and computed == 0 else len(prompt) - computed
            block_ids = self.blocks.allocate(i, computed + num_tokens)
            self.computed[i] += num_tokens
            if computed == 0:
                return t.NewSequence(i, f"r{i}", tuple(prompt), len(prompt), GREEDY, block_ids, 0, num_tokens)
            return t.ScheduledSequence(i, num_tokens, block_ids)
        done = len(self.tokens[i])
        drafts = tuple(self.truth[i][done : done + 2]) if i == 2 else ()
        num_model = 3 if i in (1, 3) else 0
        return t.ScheduledSequence(
            i, 1, self.blocks.allocate(i, computed + 1 + len(drafts) + num_model), drafts, num_model
        )

    def took(self, result: t.StepResult) -> None:
        assert not result.errors, result.errors
        for out in result.outputs:
            self.tokens[out.seq_id] += out.token_ids
            self.most_per_step[out.seq_id] = max(self.most_per_step[out.seq_id], len(out.token_ids))
            self.computed[out.seq_id] = len(MIXED_PROMPTS[out.seq_id]) + len(self.tokens[out.seq_id]) - 1
            self.blocks.keep(out.seq_id, self.computed[out.seq_id])


def test_model_drafts_over_an_int8_kv_cache(checkpoints, drafts):
    """The draft model's KV is stored as the model's is (here int8 rows with scales)."""
    truth = plain_tokens(make_runner(checkpoints["llama"], None, kv_cache_dtype="int8"), GREEDY)
    runner = make_runner(checkpoints["llama"], checkpoints["llama"], kv_cache_dtype="int8")
    assert runner.draft.kv_cache.spec.quantized
    tokens, acceptance = drafted_tokens(runner, GREEDY)
    assert tokens == truth and acceptance >= 0.9


def test_model_drafts_for_an_int8_quantized_model(checkpoints, drafts):
    """The model's weights in int8, the draft model's not (it runs at the model's dtype)."""
    truth = plain_tokens(make_runner(checkpoints["llama"], None, quantization="int8"), GREEDY)
    runner = make_runner(checkpoints["llama"], drafts["llama"], quantization="int8")
    assert runner.info.quantization == "int8"
    tokens, _ = drafted_tokens(runner, GREEDY)
    assert tokens == truth


@pytest.mark.parametrize("draft", ["smaller", "itself"])
def test_steps_mixing_prefills_decodes_plan_drafts_and_model_drafts(checkpoints, drafts, draft):
    """Each sequence's tokens equal its plain decoding."""
    target = checkpoints["llama"]
    truth = {i: plain_tokens(make_runner(target, None), GREEDY, p, MIXED_OUTPUT) for i, p in MIXED_PROMPTS.items()}
    runner = make_runner(target, drafts["llama"] if draft == "smaller" else target)
    plans = MixedPlans(runner.kv_cache.num_blocks, truth)
    for step in range(40):
        plan = plans.plan(step)
        if not plan.has_work:
            break
        plans.took(runner.execute(plan))
    assert {i: got[:MIXED_OUTPUT] for i, got in plans.tokens.items()} == truth
    assert plans.most_per_step[2] == 3 and plans.most_per_step[4] == 1
    if draft == "itself":
        assert plans.most_per_step[1] == plans.most_per_step[3] == 4


def _decode_with_drafts(runner, seq_id, prompt, block_ids, num_steps, num_hit_tokens=0) -> list[int]:
    """Admits a sequence (num_hit_tokens of it cached) and decodes num_steps steps with 2 model drafts each.

    Its table is ``block_ids``: the blocks a step's rollback cut come back with the next step.
    """
    new = t.NewSequence(
        seq_id, "r", tuple(prompt), len(prompt), GREEDY, block_ids, num_hit_tokens, len(prompt) - num_hit_tokens
    )
    runner.execute(t.StepPlan(seq_id * 100, new_seqs=(new,)))
    state = runner._seqs[seq_id]
    for step in range(1, num_steps + 1):
        num_blocks = -(-(len(state.token_ids) + 2) // BLOCK_SIZE)
        entry = t.ScheduledSequence(seq_id, 1, block_ids[len(state.block_table) : num_blocks], (), 2)
        result = runner.execute(t.StepPlan(seq_id * 100 + step, scheduled_seqs=(entry,)))
        assert not result.errors, result.errors
    return state.token_ids


def test_prefix_cache_hits_keep_the_draft_kv_of_blocks_a_draft_computed(checkpoints, drafts):
    runner = make_runner(checkpoints["llama"], drafts["llama"])
    prompt = list(range(20, 33))  # 13 tokens: 3 full blocks
    _decode_with_drafts(runner, 1, prompt, tuple(range(8)), num_steps=2)  # blocks 0-2 full of its draft KV
    runner.execute(t.StepPlan(150, dropped_seq_ids=(1,)))

    def admit(seq_id: int, block_ids: tuple[int, ...], num_hit_tokens: int) -> int:
        new = t.NewSequence(seq_id, "r", tuple(prompt), 13, GREEDY, block_ids, num_hit_tokens, 0)
        runner.execute(t.StepPlan(seq_id * 10, new_seqs=(new,)))
        return runner._seqs[seq_id].num_draft_computed

    assert admit(2, (0, 1, 2, 10), 12) == 12
    assert admit(3, (0, 11), 6) == 4  # a block hit in part is given anew (recomputed)
    # A block given anew forgets its draft KV: block 2 to a new sequence, block 1 appended to a table.
    runner.execute(t.StepPlan(40, new_seqs=(t.NewSequence(4, "r", (7,) * 8, 8, GREEDY, (2, 12), 0, 8),)))
    assert admit(5, (0, 1, 2, 13), 12) == 8
    runner.execute(t.StepPlan(60, scheduled_seqs=(t.ScheduledSequence(4, 0, (1,)),)))
    assert admit(7, (0, 1, 2, 14), 12) == 4
    runner.reset()
    assert admit(8, (0, 1, 2, 15), 12) == 0


def test_blocks_filled_from_the_offload_tier_are_recomputed_by_the_draft(checkpoints, drafts):
    runner = make_runner(checkpoints["llama"], drafts["llama"])
    prompt = list(range(20, 33))
    _decode_with_drafts(runner, 1, prompt, tuple(range(8)), num_steps=2)  # blocks 0-2 full of its draft KV
    runner.execute(t.StepPlan(150, dropped_seq_ids=(1,)))
    # Blocks 0-2 are hits, block 1 filled from the tier (the model's KV only): the draft starts after block 0.
    state = SequenceState(2, "r", list(prompt), 13, GREEDY, [0, 1, 2, 10], 12)
    new = t.NewSequence(2, "r", tuple(prompt), 13, GREEDY, (0, 1, 2, 10), 12, 1, loads=(t.BlockLoad(123, 1),))
    runner.draft.follow(t.StepPlan(200, new_seqs=(new,)), {2: state})
    assert state.num_draft_computed == 4


def test_draft_kv_of_hit_blocks_is_what_a_fresh_draft_computes(checkpoints, drafts):
    """A sequence starting from cached blocks drafts from their draft KV: it equals recomputing it all."""
    prompt = list(range(40, 57))  # 17 tokens
    shared = make_runner(checkpoints["llama"], drafts["llama"])
    _decode_with_drafts(shared, 1, prompt, tuple(range(10)), num_steps=3)
    shared.execute(t.StepPlan(150, dropped_seq_ids=(1,)))
    block_ids = (0, 1, 2, 3, 20, 21, 22, 23)
    fresh = make_runner(checkpoints["llama"], drafts["llama"])
    caught_up_from = {}
    for runner, name in ((shared, "shared"), (fresh, "fresh")):
        propose = runner.draft.propose

        def record(states, propose=propose, name=name):
            caught_up_from.setdefault(name, states[0].num_draft_computed)
            propose(states)

        runner.draft.propose = record
    got = _decode_with_drafts(shared, 2, prompt, block_ids, num_steps=4, num_hit_tokens=16)
    want = _decode_with_drafts(fresh, 2, prompt, block_ids, num_steps=4)
    assert got == want and caught_up_from == {"shared": 16, "fresh": 0}
    ours, theirs = shared.draft.kv_cache, fresh.draft.kv_cache
    num_tokens = shared._seqs[2].num_draft_computed
    for position in range(num_tokens):
        slot = shared._seqs[2].block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
        for layer in range(ours.spec.num_layers):
            for a, b in zip(ours.token_kv(layer, slot), theirs.token_kv(layer, slot)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_kv_budget_holds_both_models_and_describe_reports_the_split(checkpoints, drafts):
    alone = make_runner(checkpoints["llama"], None)
    runner = make_runner(checkpoints["llama"], drafts["llama"])
    model_bytes = alone.kv_cache.spec.bytes_per_block
    draft_bytes = runner.draft.kv_cache.spec.bytes_per_block
    assert draft_bytes == model_bytes // 2  # one layer of two
    assert runner.kv_cache.num_blocks == runner.draft.kv_cache.num_blocks == 64 * 2 // 3
    info = runner.info
    assert (info.draft_model, info.num_kv_blocks) == (drafts["llama"].name, runner.kv_cache.num_blocks)
    assert (info.kv_cache_bytes, info.draft_kv_cache_bytes) == (42 * model_bytes, 42 * draft_bytes)
    assert (alone.info.draft_model, alone.info.draft_kv_cache_bytes) == ("", 0)


def test_a_draft_vocabulary_larger_or_smaller_than_the_models(checkpoints, tmp_path):
    """Padding rows past the target's vocabulary are never proposed; ids past a smaller one are clamped."""
    truth = plain_tokens(make_runner(checkpoints["llama"], None), GREEDY)
    for vocab_size in (160, 100):
        draft = make_tiny_checkpoint(tmp_path / str(vocab_size), "llama", num_hidden_layers=1, vocab_size=vocab_size)
        runner = make_runner(checkpoints["llama"], draft)
        proposed: list[int] = []
        propose = runner.draft.propose

        def record(states, propose=propose, proposed=proposed):
            propose(states)
            proposed.extend(token for state in states for token in state.draft_token_ids)

        runner.draft.propose = record
        tokens, _ = drafted_tokens(runner, GREEDY, k=4)
        assert tokens == truth and proposed and max(proposed) < min(128, vocab_size)


def test_plans_the_draft_model_cannot_follow_fail_only_their_sequence(checkpoints, drafts):
    runner = make_runner(checkpoints["llama"], drafts["llama"])
    ok = t.NewSequence(9, "r9", tuple(PROMPT), 9, GREEDY, (30, 31, 32), 0, 9)

    def refused(entry: t.ScheduledSequence, structured: Constraint | None = None) -> str:
        """The error of sequence 1 (its prompt but the last token computed) drafting as ``entry`` says."""
        new = t.NewSequence(1, "r1", tuple(PROMPT), 9, GREEDY, (0, 1, 2), 0, 8, structured)
        runner.execute(t.StepPlan(0, new_seqs=(new, ok)))
        result = runner.execute(t.StepPlan(1, scheduled_seqs=(entry, t.ScheduledSequence(9, 1, (), (), 2))))
        assert [out.seq_id for out in result.outputs] == [9] and not runner.has_sequence(1)
        runner.reset()
        return result.errors[0].message

    assert "cannot hold 13 tokens with drafts" in refused(t.ScheduledSequence(1, 1, (), (), 4))
    assert "both draft_token_ids and num_model_draft_tokens" in refused(t.ScheduledSequence(1, 1, (3,), (5,), 1))
    assert "17 draft tokens, outside [1, 16]" in refused(t.ScheduledSequence(1, 1, tuple(range(3, 8)), (), 17))
    assert "outside [1, 16]" in refused(t.ScheduledSequence(1, 1, (3,), (), -1))
    constraint = Constraint("regex", "[ab]+")
    assert "constrained sequence" in refused(t.ScheduledSequence(1, 1, (), (), 1), structured=constraint)
    plain = make_runner(checkpoints["llama"], None)
    plain.execute(t.StepPlan(0, new_seqs=(t.NewSequence(1, "r1", tuple(PROMPT), 9, GREEDY, (0, 1, 2), 0, 9),)))
    (error,) = plain.execute(t.StepPlan(1, scheduled_seqs=(t.ScheduledSequence(1, 1, (), (), 1),))).errors
    assert "this executor has no draft model (--draft-model)" in error.message


# Chi-square quantiles at significance 0.001, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi2_test(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, bound at significance 0.001); tokens expected fewer than 5 times are pooled into one bin."""
    counts = np.bincount(tokens, minlength=len(probs)).astype(float)
    expected = len(tokens) * probs
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        counts, expected = counts[:-1], expected[:-1]
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return statistic, CHI2_999[len(expected) - 1]


def test_seeded_model_drafts_keep_the_distribution(tmp_path):
    """4,000 seeds on an 8-token vocabulary, one step of 2 model drafts after the same prompt (the draft: the
    model with noise on its weights, so that some drafts are accepted and some not): every seed's tokens
    equal plain decoding's; the first token is distributed as the model's p (chi-square), and the token
    after an accepted first draft x as p after x (chi-square), each at significance 0.001."""
    num_seeds, prompt = 4000, [3, 5, 4, 6]
    target = make_tiny_checkpoint(tmp_path / "t", "llama", vocab_size=8, initializer_range=0.5)
    draft = tmp_path / "draft"
    model = load_hf(target)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(draft)
    sampling = [SamplingParams(temperature=1.0, seed=seed) for seed in range(num_seeds)]
    # Blocks for both models' KV (the draft is as large as the model).
    plain, speculated = make_runner(target, None, num_blocks=8000), make_runner(target, draft, num_blocks=16000)
    new = [t.NewSequence(i, "r", tuple(prompt), 4, s, (2 * i, 2 * i + 1), 0, 3) for i, s in enumerate(sampling)]
    for runner in (plain, speculated):
        runner.execute(t.StepPlan(0, new_seqs=tuple(new)))
    got = speculated.execute(
        t.StepPlan(1, scheduled_seqs=tuple(t.ScheduledSequence(i, 1, (), (), 2) for i in range(num_seeds)))
    )
    assert not got.errors
    emitted = {out.seq_id: list(out.token_ids) for out in got.outputs}
    steps = 2
    want = {i: [] for i in range(num_seeds)}
    while any(len(want[i]) < len(emitted[i]) for i in want):
        out = plain.execute(
            t.StepPlan(steps, scheduled_seqs=tuple(t.ScheduledSequence(i, 1) for i in range(num_seeds)))
        )
        for o in out.outputs:
            want[o.seq_id] += o.token_ids
        steps += 1
    assert all(emitted[i] == want[i][: len(emitted[i])] for i in emitted)
    first = np.array([tokens[0] for tokens in emitted.values()])
    statistic, bound = _chi2_test(first, _probs(target, prompt))
    assert statistic < bound
    # The token after an accepted first draft x, for the x accepted most often: the next position's random
    # stream is independent of this one's (which picked x and accepted it), so it is distributed as p after x.
    accepted = [tokens for tokens in emitted.values() if len(tokens) > 1]
    most_common = int(np.bincount([tokens[0] for tokens in accepted]).argmax())
    second = np.array([tokens[1] for tokens in accepted if tokens[0] == most_common])
    assert len(second) > 300, f"{len(second)} accepted first drafts are too few to test the token after them"
    statistic, bound = _chi2_test(second, _probs(target, prompt + [most_common]))
    assert statistic < bound


def _probs(folder: Path, tokens: list[int]) -> np.ndarray:
    """The model's next-token distribution after ``tokens`` (transformers, fp32)."""
    with torch.no_grad():
        logits = load_hf(folder)(torch.tensor([tokens])).logits[0, -1].double()
    return torch.softmax(logits, dim=-1).numpy()
