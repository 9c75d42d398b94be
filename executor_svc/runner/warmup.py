"""The start-up warm-up: one step of each kind the scheduler sends, run before the executor reports READY.

Whatever a kind of step pays the first time it runs (its first ops and
sampler paths, the allocator's heap growing to its temporaries, the C++
kernels sizing their per-thread buffers) is paid here rather than in the
first users' requests, and a kind of step that cannot run fails the start.
On the 2-core AMD EPYC (Zen 4) VM it was measured on, each kind of step
already ran as fast the first time as later after the old warm-up (an
8-token prefill and one decode): the prefill at the step budget faults 15-39k
pages in every time, not only the first, as the allocator hands them back
between steps. The warm-up takes about 2.4 s for SmolLM2-135M in bf16 and
1.9 s in int8 there; the ready line and ``pagoda_executor_warmup_seconds``
report it. The KV cache needs no pass of its own: it is allocated zeroed,
which faults every page in (``kv.cache.KVCache``).

The steps go through ``ModelRunner.execute`` as plans, on sequences with
negative ids (the scheduler's are unsigned), so they run exactly the code a
served step runs:

- ``prefill``: one chunk of ``PREFILL_TOKENS`` (the scheduler's default step
  budget), the largest forward;
- ``mixed``: decode rows beside a chunk after a cached prefix (the layer loop
  in Python, the prefill kernel over cached keys);
- ``decode``: decode-only steps of each size in ``DECODE_BATCH_SIZES`` (the
  fused decode path), one of them with every sampling option;
- ``draft``: with a draft model, the rows of one decode step drafting
  (the draft's catch-up chunk and passes, the target's verify rows).

Every block the steps write is copied before and restored after, in the draft
model's cache too, so the warm-up leaves the KV cache as it found it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from executor_svc.kv.cache import KVCache
from executor_svc.loading.model_config import ModelConfig
from executor_svc.runner.draft_model import DraftModel
from pagoda.params import SamplingParams
from pagoda.step import NewSequence, ScheduledSequence, StepPlan, StepResult

# The largest prefill chunk: the scheduler's default token budget per step (--max-num-batched-tokens).
PREFILL_TOKENS = 2048
# Decode-only batch sizes: one row (its attention splits the keys over threads), a few rows, and 64 (the
# AMX GEMM's largest decode block; more rows take the prefill blocking, which the chunk runs).
DECODE_BATCH_SIZES = (1, 64, 8)
# Context tokens of all rows of a decode step together, which bounds what its attention reads: one row
# attends over the whole prefill chunk, 8 rows over 512 tokens each, 64 over 64.
DECODE_CONTEXT_TOKENS = 4096
# Rows of the mixed step that decode beside its chunk.
MIXED_DECODE_ROWS = 8
# Drafts per row of the draft step.
NUM_DRAFT_TOKENS = 2
GREEDY = SamplingParams(temperature=0.0)
# Every option of the sampler at once (penalties, min-p, top-k, top-p, seeded noise, logprobs).
SAMPLED = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=40,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    seed=1,
    logprobs=2,
)


class WarmupRunner(Protocol):
    """What the warm-up needs of the runner (runner.model_runner.ModelRunner)."""

    config: ModelConfig
    kv_cache: KVCache
    block_size: int
    max_model_len: int
    rope_switch_len: int
    draft: DraftModel | None

    def execute(self, step: StepPlan) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class WarmupStep:
    """One step the warm-up ran."""

    kind: str  # "prefill", "mixed", "decode" or "draft"
    num_seqs: int
    num_tokens: int  # tokens the target's forward computed (with a drafting row's drafts)


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran and how long it took (the ready line and the executor's metrics report it)."""

    seconds: float = 0.0
    steps: tuple[WarmupStep, ...] = ()

    def summary(self) -> str:
        """``prefill 2048 tok, mixed 520 tok, decode 1/64/8 rows``: the steps in order, grouped by kind."""
        parts = []
        for kind, steps in itertools.groupby(self.steps, key=lambda s: s.kind):
            group = list(steps)
            if kind in ("decode", "draft"):
                parts.append(f"{kind} {'/'.join(str(s.num_seqs) for s in group)} rows")
            else:
                parts.append(f"{kind} {'/'.join(str(s.num_tokens) for s in group)} tok")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the warm-up's sequences live: the prefill's blocks, the mixed chunk's, one block per decode row."""

    block_size: int
    prefill_tokens: int
    chunk_tokens: int  # the mixed step's chunk, after a cached prefix of the prefill's blocks
    batch_sizes: tuple[int, ...]  # of the decode steps, in order
    mixed_rows: int  # decode rows of the mixed step

    @property
    def num_prefill_blocks(self) -> int:
        return -(-self.prefill_tokens // self.block_size)

    @property
    def chunk_start(self) -> int:
        """The chunk's first position: whole blocks of the prefill before it (a prefix-cache hit)."""
        return (self.prefill_tokens - self.chunk_tokens) // self.block_size * self.block_size

    @property
    def num_chunk_blocks(self) -> int:
        return -(-(self.chunk_start + self.chunk_tokens) // self.block_size) - self.chunk_start // self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks the warm-up writes: ids 0 up to this."""
        return self.num_prefill_blocks + self.num_chunk_blocks + max(self.batch_sizes)

    def context_len(self, num_rows: int) -> int:
        """Tokens before a decode row in a step of num_rows rows: whole blocks of the prefill, so the row's own
        block holds its position and the drafts after it."""
        blocks = min(self.prefill_tokens // self.block_size - 1, DECODE_CONTEXT_TOKENS // num_rows // self.block_size)
        return max(blocks, 0) * self.block_size


def layout(num_blocks: int, block_size: int, max_model_len: int) -> _Layout | None:
    """The largest warm-up the KV cache holds (the prefill in at most half of it), or None when none fits."""
    prefill_tokens = min(PREFILL_TOKENS, max_model_len - 1, num_blocks * block_size // 2)
    while prefill_tokens >= 1:
        plan = _Layout(block_size, prefill_tokens, max(1, prefill_tokens // 4), DECODE_BATCH_SIZES, MIXED_DECODE_ROWS)
        room = num_blocks - plan.num_prefill_blocks - plan.num_chunk_blocks  # blocks left for decode rows
        if room >= 1:
            sizes = tuple(dict.fromkeys(min(n, room) for n in DECODE_BATCH_SIZES))
            return dataclasses.replace(plan, batch_sizes=sizes, mixed_rows=min(MIXED_DECODE_ROWS, room))
        prefill_tokens //= 2
    return None


def run(runner: WarmupRunner) -> WarmupReport:
    """Runs the warm-up steps on ``runner``; its KV contents and sequences are as before."""
    start = time.perf_counter()
    plan = layout(runner.kv_cache.num_blocks, runner.block_size, runner.max_model_len)
    if plan is None:
        return WarmupReport(time.perf_counter() - start)
    caches = [runner.kv_cache] + ([runner.draft.kv_cache] if runner.draft is not None else [])
    tensors = [(tensor, dim) for cache in caches for tensor, dim in cache.block_tensors()]
    saved = [tensor.narrow(dim, 0, plan.num_blocks).clone() for tensor, dim in tensors]
    draft_blocks = runner.draft.block_state() if runner.draft is not None else None
    try:
        steps = _Steps(runner, plan).run_all()
    finally:
        with torch.inference_mode():
            for (tensor, dim), contents in zip(tensors, saved):
                tensor.narrow(dim, 0, plan.num_blocks).copy_(contents)
        if runner.draft is not None and draft_blocks is not None:
            runner.draft.restore_block_state(draft_blocks)
    return WarmupReport(time.perf_counter() - start, tuple(steps))


class _Steps:
    """The warm-up's plans, run one after the other on the runner."""

    def __init__(self, runner: WarmupRunner, plan: _Layout):
        self.runner = runner
        self.plan = plan
        vocab_size = runner.config.vocab_size
        # The prefill's tokens; every other sequence starts with some of them (its cached prefix).
        self.token_ids = tuple((1000 + 7 * i) % vocab_size for i in range(plan.prefill_tokens))
        self.next_seq_id = -1
        self.held: list[int] = []  # warm-up sequences the runner holds
        self.steps: list[WarmupStep] = []

    def run_all(self) -> list[WarmupStep]:
        """Every step in order; the last decode step samples with every option, and its rows then draft."""
        plan = self.plan
        try:
            self._execute("prefill", [self._new(self.token_ids, 0, tuple(range(plan.num_prefill_blocks)), GREEDY)])
            self._execute("mixed", [*self._decode_rows(plan.mixed_rows, GREEDY), self._chunk()])
            rows: list[NewSequence] = []
            for i, num_rows in enumerate(plan.batch_sizes):
                rows = self._decode_rows(num_rows, SAMPLED if i == len(plan.batch_sizes) - 1 else GREEDY)
                self._execute("decode", rows)
            # The rows' next token and its drafts stay in their own blocks (they start at a block's first slot).
            if self.runner.draft is not None and plan.block_size >= NUM_DRAFT_TOKENS + 2:
                drafting = [ScheduledSequence(r.seq_id, 1, num_model_draft_tokens=NUM_DRAFT_TOKENS) for r in rows]
                self._execute("draft", [], drafting)
        finally:
            self._drop_held()
        return self.steps

    def _decode_rows(self, num_rows: int, sampling: SamplingParams) -> list[NewSequence]:
        """num_rows sequences with one token to compute each, after a cached prefix, each in a block of its own."""
        plan = self.plan
        context_len = plan.context_len(num_rows)
        prefix_blocks = tuple(range(context_len // plan.block_size))
        first_own = plan.num_prefill_blocks + plan.num_chunk_blocks
        token_ids = self.token_ids[: context_len + 1]
        return [self._new(token_ids, context_len, (*prefix_blocks, first_own + i), sampling) for i in range(num_rows)]

    def _chunk(self) -> NewSequence:
        """A prompt whose first whole blocks are the prefill's (cached) and whose last chunk_tokens are new."""
        plan, bs = self.plan, self.plan.block_size
        start = plan.chunk_start
        own = range(plan.num_prefill_blocks, plan.num_prefill_blocks + plan.num_chunk_blocks)
        blocks = (*range(start // bs), *own)
        return self._new(self.token_ids[: start + plan.chunk_tokens], start, blocks, GREEDY)

    def _new(
        self, token_ids: tuple[int, ...], num_computed: int, block_ids: tuple[int, ...], sampling: SamplingParams
    ) -> NewSequence:
        seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id - 1
        switch = self.runner.rope_switch_len
        return NewSequence(
            seq_id,
            "warmup",
            token_ids,
            len(token_ids),
            sampling,
            block_ids,
            num_computed,
            len(token_ids) - num_computed,
            long_rope=0 < switch < len(token_ids) + NUM_DRAFT_TOKENS + 1,
        )

    def _execute(self, kind: str, new: list[NewSequence], scheduled: Sequence[ScheduledSequence] = ()) -> None:
        """One plan; it drops the previous step's sequences unless it schedules them again.

        Raises:
            RuntimeError: the step failed for a sequence (the model would fail served steps too).
        """
        kept = {s.seq_id for s in scheduled}
        dropped = tuple(seq_id for seq_id in self.held if seq_id not in kept)
        step = StepPlan(0, new_seqs=tuple(new), scheduled_seqs=tuple(scheduled), dropped_seq_ids=dropped)
        result = self.runner.execute(step)
        self.held = [s.seq_id for s in [*new, *scheduled]]
        if result.errors:
            raise RuntimeError(f"warm-up {kind} step failed: {result.errors[0].message}")
        self.steps.append(WarmupStep(kind, len(new) + len(scheduled), result.num_scheduled_tokens))

    def _drop_held(self) -> None:
        if self.held:
            self.runner.execute(StepPlan(0, dropped_seq_ids=tuple(self.held)))
            self.held = []
