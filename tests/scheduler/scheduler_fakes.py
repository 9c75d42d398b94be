"""A fake executor that follows step plans exactly, and an engine loop around a Scheduler.

The fake executor is strict: it keeps its own copy of every sequence, writes a
"KV" value into the slot of every computed position (a digest of the token
prefix up to it), and before sampling checks that every slot the sequence
attends to holds the value its own tokens imply. A block shared wrongly,
evicted while in use, or missing from a block table fails loudly. Its "model"
is deterministic: the next token is a function of the whole token prefix (or,
for speculation tests, `copy_model`: of the last two tokens, so outputs repeat
and n-gram drafts are accepted). Draft tokens are verified as the executor
does: accepted while the model agrees, one token of its own after them, the
block table cut to the blocks of the computed tokens. Asked for the draft
model's tokens (``num_model_draft_tokens``), it proposes them with its draft
model (`noisy_draft_model`: the model's token, wrong at every third position).

With a tier (`FakeTier`), it follows the offload protocol the same way:
saves copy a block's slot values out before the step writes anything, loads
copy them into the named blocks before the step computes (a hash it lacks, or
stored for other tokens, fails the sequence recoverably), and each result
reports what the tier gained and lost. The slot check then proves every
loaded block holds exactly the KV its tokens imply.

With a LongRoPE switch (``rope_switch_len``), a sequence's "KV" and its next
token also depend on the factor set it runs on (``NewSequence.long_rope``),
as a real model's do: a block computed on one set and read by a sequence on
the other fails the slot check, and a short-factor sequence computing a
position past the switch is a protocol error. ``reference_output`` then
gives transformers' rule: each next token on the set of the prefix's length.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from pagoda.step import FinishReason, SeqError, SeqOutput, StepPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler, SeqUpdate

VOCAB_SIZE = 50
# Where the digests of a sequence on the long LongRoPE factors start (the short ones start at 0).
LONG_ROPE_SEED = 7919


def next_token(prefix_digest: int) -> int:
    """The fake model: a token from the digest of all previous tokens."""
    return (prefix_digest * 2654435761 >> 7) % VOCAB_SIZE


# (all previous tokens, their digest) -> the next token.
Model = Callable[[list[int], int], int]


def digest_model(token_ids: list[int], digest: int) -> int:
    return next_token(digest)


def copy_model(token_ids: list[int], digest: int) -> int:
    """A model whose output cycles (a recurrence over 7 values): n-gram drafts are mostly right."""
    previous = token_ids[-2] if len(token_ids) > 1 else 0
    return (3 * token_ids[-1] + previous + 1) % 7


def noisy_draft_model(model: Model) -> Model:
    """A draft model of ``model``: its token, but a wrong one at every third position."""

    def draft(token_ids: list[int], digest: int) -> int:
        token = model(token_ids, digest)
        return token if len(token_ids) % 3 else (token + 1) % VOCAB_SIZE

    return draft


class ProtocolError(AssertionError):
    """The plan asked the executor for something inconsistent."""


@dataclasses.dataclass
class _ExecSeq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    # digests[p]: digest of token_ids[: p + 1] (on its factor set).
    digests: list[int]
    long_rope: bool = False


class FakeTier:
    """An offload tier of at most `capacity` blocks (LRU): hash -> (slot values, token ids)."""

    def __init__(self, capacity: int = 10**9, drop_every: int = 0) -> None:
        self.capacity = capacity
        # Every drop_every-th save is dropped (a full queue), reported as not held.
        self.drop_every = drop_every
        self.blocks: collections.OrderedDict[int, tuple[tuple[int, ...], tuple[int, ...]]] = collections.OrderedDict()
        self.deltas: dict[int, bool] = {}
        self.num_saves = self.num_loads = 0

    def store(self, block_hash: int, values: tuple[int, ...], token_ids: tuple[int, ...]) -> None:
        self.num_saves += 1
        if self.drop_every and self.num_saves % self.drop_every == 0:
            self.deltas[block_hash] = False
            return
        self.blocks[block_hash] = (values, token_ids)
        self.deltas[block_hash] = True
        while len(self.blocks) > self.capacity:
            evicted, _ = self.blocks.popitem(last=False)
            self.deltas[evicted] = False

    def remove(self, block_hash: int) -> None:
        """The block's file went bad: gone, without telling the scheduler."""
        self.blocks.pop(block_hash, None)

    def take_deltas(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        deltas, self.deltas = self.deltas, {}
        return tuple(h for h, v in deltas.items() if v), tuple(h for h, v in deltas.items() if not v)


class FakeExecutor:
    """Executes StepPlans against a slot -> value "KV cache" (and an offload tier, if given)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model: Model = digest_model,
        tier: FakeTier | None = None,
        rope_switch_len: int = 0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rope_switch_len = rope_switch_len
        self.model = model
        self.tier = tier
        self.draft_model = noisy_draft_model(model)
        self.kv: dict[tuple[int, int], int] = {}
        self.seqs: dict[int, _ExecSeq] = {}
        self.num_steps = 0
        # Sequences whose loads failed in the last step (a plan sent before the scheduler knew names them).
        self.failed_loads: set[int] = set()

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        self._save(plan)
        for seq_id in plan.dropped_seq_ids:
            self.seqs.pop(seq_id, None)
        work, errors = [], []
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise ProtocolError(f"new seq {new.seq_id} already held")
            if new.long_rope and not self.rope_switch_len:
                raise ProtocolError(f"new seq {new.seq_id} on long RoPE factors the model does not have")
            missing = self._load(new)
            if missing:
                errors.append(SeqError(new.seq_id, "tier miss", missing))
                continue
            self.seqs[new.seq_id] = _ExecSeq(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, [], new.long_rope
            )
            work.append((new.seq_id, new.num_scheduled_tokens, ()))
        failed = {e.seq_id for e in errors}
        for sched in plan.scheduled_seqs:
            if sched.seq_id not in self.seqs:
                if sched.seq_id in self.failed_loads:  # the plan was sent before it learnt of the failure
                    errors.append(SeqError(sched.seq_id, f"unknown sequence {sched.seq_id}"))
                    continue
                raise ProtocolError(f"scheduled seq {sched.seq_id} not held")
            if sched.draft_token_ids and sched.num_model_draft_tokens:
                raise ProtocolError(f"seq {sched.seq_id}: drafts of both kinds")
            self.seqs[sched.seq_id].block_ids.extend(sched.new_block_ids)
            drafts = sched.draft_token_ids or self._propose(sched.seq_id, sched.num_model_draft_tokens)
            work.append((sched.seq_id, sched.num_scheduled_tokens, drafts))
        self.failed_loads = failed
        outputs = [out for seq_id, n, drafts in work if (out := self._run(seq_id, n, drafts)) is not None]
        added, removed = self.tier.take_deltas() if self.tier is not None else ((), ())
        return StepResult(
            step_id=plan.step_id,
            incarnation_id="fake",
            outputs=tuple(outputs),
            errors=tuple(errors),
            num_scheduled_tokens=plan.num_scheduled_tokens,
            tier_added=added,
            tier_removed=removed,
        )

    def _save(self, plan: StepPlan) -> None:
        """Before anything in the step writes KV: each block to save, copied out."""
        if plan.saves and self.tier is None:
            raise ProtocolError("saves for an executor without a tier")
        for save in plan.saves:
            if len(save.token_ids) != self.block_size:
                raise ProtocolError(f"save of block {save.block_id} with {len(save.token_ids)} tokens")
            values = tuple(self.kv.get((save.block_id, off), -1) for off in range(self.block_size))
            if -1 in values:
                raise ProtocolError(f"save of block {save.block_id}, which holds no computed KV")
            self.tier.store(save.block_hash, values, save.token_ids)

    def _load(self, new) -> tuple[int, ...]:
        """Fills the blocks a new sequence loads; returns the hashes the tier lacks (then nothing is loaded)."""
        if not new.loads:
            return ()
        if self.tier is None:
            raise ProtocolError("loads for an executor without a tier")
        bs = self.block_size
        first = new.num_computed_tokens // bs - len(new.loads)
        if new.num_computed_tokens % bs or first < 0:
            raise ProtocolError(f"{len(new.loads)} loads do not end the computed prefix of seq {new.seq_id}")
        missing = []
        for j, load in enumerate(new.loads):
            if new.block_ids[first + j] != load.block_id:
                raise ProtocolError(f"load into block {load.block_id}, table position {first + j} holds another")
            stored = self.tier.blocks.get(load.block_hash)
            if stored is None or stored[1] != tuple(new.token_ids[(first + j) * bs : (first + j + 1) * bs]):
                missing.append(load.block_hash)
        if missing:
            return tuple(missing)
        for load in new.loads:
            values, _ = self.tier.blocks[load.block_hash]
            self.tier.blocks.move_to_end(load.block_hash)
            for off, value in enumerate(values):
                self.kv[(load.block_id, off)] = value
            self.tier.num_loads += 1
        return ()

    def _propose(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """The draft model's num_tokens drafts after the sequence's known tokens."""
        seq = self.seqs[seq_id]
        tokens = list(seq.token_ids)
        digest = prefix_digest(tokens, seq.long_rope)
        for _ in range(num_tokens):
            tokens.append(self.draft_model(tokens, digest))
            digest = hash((digest, tokens[-1]))
        return tuple(tokens[len(seq.token_ids) :])

    def _slot(self, seq: _ExecSeq, pos: int) -> tuple[int, int]:
        index = pos // self.block_size
        if index >= len(seq.block_ids):
            raise ProtocolError(f"position {pos} beyond block table {seq.block_ids}")
        block_id = seq.block_ids[index]
        if not 0 <= block_id < self.num_blocks:
            raise ProtocolError(f"block id {block_id} out of range")
        return block_id, pos % self.block_size

    def _digest(self, seq: _ExecSeq, upto: int) -> None:
        while len(seq.digests) < upto:
            prev = seq.digests[-1] if seq.digests else (LONG_ROPE_SEED if seq.long_rope else 0)
            seq.digests.append(hash((prev, seq.token_ids[len(seq.digests)])))

    def _run(self, seq_id: int, num_tokens: int, drafts: tuple[int, ...]) -> SeqOutput | None:
        seq = self.seqs[seq_id]
        start, end = seq.num_computed, seq.num_computed + num_tokens
        if num_tokens <= 0 or end > len(seq.token_ids):
            raise ProtocolError(f"seq {seq_id}: {num_tokens} tokens from {start} of {len(seq.token_ids)}")
        if drafts and end != len(seq.token_ids):
            raise ProtocolError(f"seq {seq_id}: drafts after a chunk that does not reach its end")
        if 0 < self.rope_switch_len < end + len(drafts) and not seq.long_rope:
            raise ProtocolError(f"seq {seq_id}: computes up to {end + len(drafts)} on the short RoPE factors")
        self._digest(seq, end)
        for pos in range(start, end):
            self.kv[self._slot(seq, pos)] = seq.digests[pos]
        for pos in range(end):  # attention reads every earlier slot
            if self.kv.get(self._slot(seq, pos)) != seq.digests[pos]:
                raise ProtocolError(f"seq {seq_id}: wrong KV at position {pos} (blocks {seq.block_ids})")
        seq.num_computed = end
        if end < len(seq.token_ids):
            return None
        return SeqOutput(seq_id, self._verify(seq, drafts))

    def _verify(self, seq: _ExecSeq, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """Writes the drafts' KV, samples after each, keeps the accepted ones and one more token."""
        tokens, digest = list(seq.token_ids), seq.digests[-1]
        sampled = []
        for i, draft in enumerate((*drafts, None)):
            sampled.append(self.model(tokens, digest))
            if draft is None or sampled[-1] != draft:
                break
            digest = hash((digest, draft))
            tokens.append(draft)
            self.kv[self._slot(seq, seq.num_computed + i)] = digest
        for i in range(len(sampled) - 1, len(drafts)):  # rejected drafts: KV that matches no prefix
            self.kv[self._slot(seq, seq.num_computed + i)] = -1
        seq.token_ids.extend(sampled)
        if drafts:
            seq.num_computed += len(sampled) - 1
            del seq.block_ids[-(-seq.num_computed // self.block_size) :]
        return tuple(sampled)


def prefix_digest(token_ids: list[int], long_rope: bool = False) -> int:
    """The digest of a token prefix on a factor set (the fake's KV of its last position)."""
    digest = LONG_ROPE_SEED if long_rope else 0
    for token in token_ids:
        digest = hash((digest, token))
    return digest


def reference_output(
    prompt: list[int],
    max_tokens: int,
    eos_token_ids=(),
    max_model_len=10**9,
    model: Model = digest_model,
    rope_switch_len: int = 0,
) -> list[int]:
    """What the fake model generates for a prompt, computed directly (with a LongRoPE switch, each token on
    the factor set of the prefix's length, as transformers computes it)."""
    digest = prefix_digest(prompt)
    out: list[int] = []
    while True:
        tokens = prompt + out
        if 0 < rope_switch_len < len(tokens):
            digest = prefix_digest(tokens, long_rope=True)
        token = model(tokens, digest)
        out.append(token)
        if token in eos_token_ids or len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out
        digest = hash((digest, token))


class Engine:
    """Drives a Scheduler and a FakeExecutor with up to `max_inflight` plans in flight."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor, max_inflight: int = 2):
        self.scheduler = scheduler
        self.executor = executor
        self.max_inflight = max_inflight
        self.inflight: collections.deque[StepResult] = collections.deque()
        self.plans: list[StepPlan] = []
        self.outputs: dict[int, list[int]] = collections.defaultdict(list)
        self.finish_reasons: dict[int, FinishReason] = {}

    def step(self) -> list[SeqUpdate]:
        """One schedule(), then update() with the oldest result once the pipeline is full.

        As the executor handle does, a plan is not built ahead of a result the scheduler waits for.
        """
        updates: list[SeqUpdate] = []
        if self.inflight and not self.scheduler.may_plan_ahead:
            updates += self._apply(self.scheduler.update(self.inflight.popleft()))
        plan = self.scheduler.schedule()
        sent = plan.has_work or bool(plan.dropped_seq_ids) or bool(plan.saves)
        if sent:
            self.plans.append(plan)
            result = self.executor.execute(plan)
            if plan.has_work or plan.saves:
                self.inflight.append(result)
        while self.inflight and (len(self.inflight) >= self.max_inflight or not plan.has_work):
            updates += self._apply(self.scheduler.update(self.inflight.popleft()))
        return updates

    def _apply(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        for upd in updates:
            self.outputs[upd.seq.seq_id].extend(upd.new_token_ids)
            if upd.finished:
                self.finish_reasons[upd.seq.seq_id] = upd.seq.finish_reason
        return updates

    def finish(self, seq_id: int, reason: FinishReason) -> None:
        """The engine stops a sequence itself (stop string, cancel)."""
        seq = self.scheduler.get(seq_id)
        self.scheduler.finish(seq_id, reason)
        if seq is not None:
            self.finish_reasons[seq_id] = reason

    def run(self, max_steps: int = 10_000) -> int:
        """Steps until nothing is left (drops sent too); returns the number of steps."""
        for num_steps in range(max_steps):
            if not self.scheduler.has_unfinished() and not self.inflight:
                self.step()  # sends the last dropped ids, if any
                return num_steps
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")


def check_invariants(scheduler: Scheduler) -> None:
    """Block accounting is exact: refs equal table entries, sharing only of cached full blocks."""
    pool = scheduler.kv.pool
    bs = scheduler.config.block_size
    free_ids = [block.block_id for block in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    free_set = set(free_ids)
    holders: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    running = scheduler.running
    assert len(running) <= scheduler.config.max_num_seqs
    assert [seq.rank for seq in running] == sorted(seq.rank for seq in running)
    for seq in running:
        assert len(seq.block_ids) == -(-seq.num_computed_tokens // bs), seq
        assert len(set(seq.block_ids)) == len(seq.block_ids)
        assert 0 <= seq.num_pending_tokens <= 2
        num_drafts = scheduler.config.max_draft_tokens if seq.drafts_in_flight else 0
        assert seq.num_computed_tokens <= len(seq.token_ids) + seq.num_pending_tokens + num_drafts
        for index, block_id in enumerate(seq.block_ids):
            holders[block_id].append((seq.seq_id, index))
    for block in pool.blocks:
        assert block.ref_cnt == len(holders[block.block_id]), block
        assert (block.ref_cnt == 0) == (block.block_id in free_set)
    for block_id, held in holders.items():
        if len(held) > 1:  # shared: a cached full prefix block at the same index
            block = pool.blocks[block_id]
            assert block.block_hash is not None and pool.cached[block.block_hash] is block
            assert len({index for _, index in held}) == 1
            for seq_id, index in held:
                assert (index + 1) * bs <= scheduler.get(seq_id).num_computed_tokens
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash and len(block.token_ids) == bs
    if scheduler.drafter is not None:  # drafting records of unfinished sequences only
        assert all(scheduler.get(seq_id) is not None for seq_id in scheduler.drafter.seq_ids)
