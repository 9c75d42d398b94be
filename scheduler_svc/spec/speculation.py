"""When to speculate, per sequence and per step, and what came of it.

Drafts come from two sources (docs/speculative-decoding.md): n-gram lookups
the scheduler makes (scheduler_svc.spec.ngram), and the executor's draft model,
which the plan asks for a number of tokens. The executor verifies both as
extra query tokens of the same forward pass. Speculation pays only where a
step costs about the same for 1 token as for 1 + K, and where drafts are
accepted:

- Globally: no drafts while more than ``max_batch`` sequences run. A decode
  step is bound by streaming the weights up to about 8 sequences and grows
  with the tokens beyond that (SmolLM2 bf16 on CPU, bench/data/
  step_cost_smollm2_bf16.json: batch 8 costs 1.18x batch 1, batch 32 1.9x);
  drafts would then cost what they save.
- Per sequence and source: an exponentially weighted mean of the tokens
  accepted per attempt (a step where it drafted; with n-gram drafts alone,
  finding no n-gram counts as 0). Below the source's break-even the sequence
  stops drafting from it for a cooldown of generated tokens that doubles each
  time, then tries again. N-gram drafts cost little but the overlap of plans
  (``MIN_ACCEPTED_PER_ATTEMPT``); the draft model's passes cost time of their
  own, measured in each step that ran them: its break-even is that time over
  the rest of the step's (accepting more than that many tokens per attempt
  wins, as the verifying step costs about what a plain one does).
  Where a verifying step costs more than a plain one (a batch of several
  sequences, or a draft model as large as the target), the break-even is
  what the step with the draft model costs over a plain decode step of the
  same batch, less one: with the draft model on, one step in
  ``PROBE_INTERVAL_STEPS`` drafts nothing to measure that plain step.
  Only steps in which every sequence drafting with the draft model continues
  from its previous step measure it: a first attempt also catches the draft
  model's KV up on the sequence's earlier tokens, a cost paid once.
- The draft model globally (scheduler_svc.spec.draft_switch): off, so that it runs
  no pass at all, when even K accepted tokens per attempt could not pay for it
  (its cost at least K) or when every sequence trying it has paused it; tried
  again now and then. Its KV needs nothing for that: the executor catches a
  sequence up from wherever its draft KV stopped.

Pure Python.
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence
from typing import NamedTuple

from pagoda.step import ScheduledSequence, StepTimings
from scheduler_svc.core.config import DraftSource, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.core.step_builder import StepBuilder, StepEntry
from scheduler_svc.kv.kv_cache_manager import KVCacheManager, cdiv
from scheduler_svc.spec.draft_switch import DraftModelSwitch
from scheduler_svc.spec.ngram import NgramProposer

# Weight of the newest attempt in the mean of accepted tokens per attempt.
EWMA_WEIGHT = 0.25
# Below this many accepted tokens per attempt, drafting loses: the step is no longer overlapped with the
# scheduler's work (drafts need the known tokens), and the draft rows cost compute.
MIN_ACCEPTED_PER_ATTEMPT = 0.3
# Generated tokens a sequence waits before drafting again, first and at most.
FIRST_COOLDOWN_TOKENS = 16
MAX_COOLDOWN_TOKENS = 512
# Weight of the newest step in the measured cost of the draft model's passes.
COST_EWMA_WEIGHT = 0.1
# With the draft model on, one step in this many drafts nothing: it measures a plain decode step's cost.
PROBE_INTERVAL_STEPS = 64
# The first such step comes this many steps after the start.
FIRST_PROBE_STEP = 8


class AcceptanceRecord:
    """A sequence's record of one source's drafts: tokens accepted per attempt, and its cooldown."""

    __slots__ = ("mean_accepted", "resume_at", "cooldown")

    def __init__(self) -> None:
        # Optimistic start: a few fruitless attempts are needed before it stops.
        self.mean_accepted = 1.0
        # Drafting resumes once the sequence has this many output tokens.
        self.resume_at = 0
        self.cooldown = FIRST_COOLDOWN_TOKENS

    def active(self, num_output_tokens: int) -> bool:
        """Whether the sequence drafts from this source now (not cooling down)."""
        return num_output_tokens >= self.resume_at

    def record(self, num_accepted: int, num_output_tokens: int, break_even: float = MIN_ACCEPTED_PER_ATTEMPT) -> None:
        """One attempt's accepted drafts (0 when no n-gram matched); below break_even starts a cooldown."""
        self.mean_accepted += EWMA_WEIGHT * (num_accepted - self.mean_accepted)
        if self.mean_accepted >= break_even:
            return
        self.resume_at = num_output_tokens + self.cooldown
        self.cooldown = min(2 * self.cooldown, MAX_COOLDOWN_TOKENS)
        # After the cooldown, one fruitless attempt stops it again; one good one keeps it going.
        self.mean_accepted = break_even


class SeqSpeculation:
    """One sequence's n-gram index and its record of each source's drafts."""

    __slots__ = ("proposer", "ngram", "model", "model_continues_at")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.proposer = NgramProposer(min_n, max_n)
        self.ngram = AcceptanceRecord()
        self.model = AcceptanceRecord()
        # (admission, number of tokens) at which the draft model's KV is current but for the last step's
        # tokens: a draft with it then needs no catch-up on earlier ones.
        self.model_continues_at = (-1, 0)

    def record_of(self, source: DraftSource) -> AcceptanceRecord:
        return self.ngram if source is DraftSource.NGRAM else self.model


class SpeculationStats:
    """Counters of one scheduler core and one draft source (exported as metrics)."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")

    def __init__(self) -> None:
        # Sequence-steps that verified drafts, the tokens drafted, and those accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted


class Proposal(NamedTuple):
    """What a sequence drafts in one step."""

    source: DraftSource
    # The n-gram drafts (empty for the draft model's, which the executor proposes).
    token_ids: tuple[int, ...]
    num_tokens: int
    # The draft model first catches its KV up on tokens of earlier steps (its first draft, or after a pause).
    catch_up: bool = False


class Drafter:
    """The speculation of one scheduler core: which sequences draft, their drafts in a plan, the rollback."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.uses_ngram = config.speculative in ("ngram", "ngram+draft")
        self.uses_model = config.speculative in ("draft", "ngram+draft")
        # The acceptance and cost policies pause drafting (else every step the batch rule allows drafts).
        self.adaptive = config.speculative_adaptive
        self.stats = {source: SpeculationStats() for source in DraftSource}
        # The draft model's passes over the rest of the step (prepare, forward, sampling), in the steps that
        # ran them: the accepted tokens per attempt the draft model must beat (None: not measured yet).
        self.model_cost: float | None = None
        # Prepare + forward + sampling of a decode step without drafts, by its number of sequences (measured).
        self.plain_step_ns: dict[int, float] = {}
        self._steps_to_probe = FIRST_PROBE_STEP
        # seq_id -> the sequence's n-gram index and drafting record, from its first draft until it finishes
        # (forget) or leaves this core (forget_all); kept through preemptions.
        self._seqs: dict[int, SeqSpeculation] = {}
        # Whether the draft model runs at all, and for whom.
        self.switch = DraftModelSwitch(self.uses_model, self._model_paused, trusted=not self.adaptive)
        # Step results seen.
        self.num_steps = 0

    @property
    def seq_ids(self) -> KeysView[int]:
        """The sequences with a drafting record here."""
        return self._seqs.keys()

    def speculation(self, seq_id: int) -> SeqSpeculation | None:
        """The sequence's n-gram index and drafting record (None: it has not drafted here)."""
        return self._seqs.get(seq_id)

    def forget(self, seq_id: int) -> None:
        """The sequence finished: its record goes."""
        self._seqs.pop(seq_id, None)

    def forget_all(self) -> None:
        """Every sequence left this core (its executor is gone)."""
        self._seqs.clear()

    def _model_paused(self, seq: SchedulerSequence) -> bool:
        """seq's own record has paused the draft model (it has one: it drafted with it)."""
        spec = self._seqs.get(seq.seq_id)
        return spec is not None and not spec.model.active(len(seq.output_token_ids))

    def allows(self, num_running: int) -> bool:
        """The global rule: drafts only while the step is bound by the weights, not by the tokens."""
        return num_running <= self.config.speculative_max_batch

    def speculates(self, running: Sequence[SchedulerSequence]) -> bool:
        """Whether the step being planned may draft: the global rule, less the draft model's probe steps.

        With the draft model on, one step in PROBE_INTERVAL_STEPS drafts nothing, so what a plain
        decode step costs at this batch stays measured (on_step); n-gram drafts alone never probe.
        """
        if not self.allows(len(running)):
            return False
        if not (self.uses_model and self.adaptive):
            return True
        if self.switch.update(running, self.num_steps, self._model_cannot_pay()):
            self.model_cost = None  # tried again: measured afresh
        if not self.switch.on:
            return self.uses_ngram
        self._steps_to_probe -= 1
        if self._steps_to_probe > 0:
            return True
        self._steps_to_probe = PROBE_INTERVAL_STEPS
        return False

    def _model_cannot_pay(self) -> bool:
        """Even every draft accepted (K per attempt) would not win back the draft model's cost."""
        cost = self.model_cost
        return cost is not None and cost >= self.config.draft_tokens(DraftSource.MODEL)

    def wants(self, seq: SchedulerSequence) -> bool:
        """Whether seq would draft in the next step (it may still find no n-gram)."""
        if seq.structured is not None:
            return False
        # The draft model proposes for the base model only: a LoRA sequence drafts with n-grams.
        spec, model = self._seqs.get(seq.seq_id), self.uses_model and not seq.lora_name and self.switch.allows(seq)
        if spec is None:
            return self.uses_ngram or model
        num_outputs = len(seq.output_token_ids)
        return (self.uses_ngram and spec.ngram.active(num_outputs)) or (model and spec.model.active(num_outputs))

    def schedule(self, seq: SchedulerSequence, step: StepBuilder) -> bool:
        """Plans seq's next token with drafts after it, if it drafts and their blocks are free.

        Drafts never preempt: without free blocks the sequence decodes one token.
        """
        config = self.config
        max_tokens = min(step.budget - step.num_decodes_left - 1, config.max_model_len - len(seq.token_ids) - 1)
        if config.rope_switch_len and not seq.long_rope:
            # Verified rows stay within the short RoPE factors: past them the sequence restarts on the long ones.
            max_tokens = min(max_tokens, config.rope_switch_len - len(seq.token_ids))
        proposal = self.propose(seq, max_tokens)
        if proposal is None:
            return False
        num_tokens = 1 + proposal.num_tokens
        new_block_ids: list[int] | None = []
        if seq.num_computed_tokens + num_tokens > len(seq.block_ids) * config.block_size:
            new_block_ids = self.kv.allocate_slots(seq, num_tokens)
        if new_block_ids is None:
            return False
        num_model = proposal.num_tokens if proposal.source is DraftSource.MODEL else 0
        step.model_catch_up |= proposal.catch_up
        entry = ScheduledSequence(seq.seq_id, 1, tuple(new_block_ids), proposal.token_ids, num_model)
        step.scheduled_seqs.append(entry)
        step.commit(seq, 1, proposal.num_tokens, proposal.source)
        return True

    def propose(self, seq: SchedulerSequence, max_tokens: int) -> Proposal | None:
        """What seq drafts next, at most max_tokens tokens: an n-gram's, else the draft model's.

        Only for a sequence whose tokens are all known (no pending one), that is
        not constrained (its drafts would need the constraint's masks), from a
        source it is not cooling down from. Finding no n-gram counts as a
        fruitless attempt unless the draft model drafts instead.
        """
        if seq.num_pending_tokens or seq.structured is not None:
            return None
        # Every accepted draft plus the executor's own token must fit max_tokens.
        max_outputs = seq.stopping.max_tokens - len(seq.output_token_ids) - 1
        max_tokens = min(max_tokens, max_outputs)
        if max_tokens <= 0:
            return None
        spec = self._seqs.get(seq.seq_id)
        if spec is None:
            spec = self._seqs[seq.seq_id] = SeqSpeculation()
        num_outputs = len(seq.output_token_ids)
        model_active = (
            self.uses_model and not seq.lora_name and self.switch.allows(seq) and spec.model.active(num_outputs)
        )
        if self.uses_ngram and spec.ngram.active(num_outputs):
            drafts = spec.proposer.propose(seq.token_ids, min(max_tokens, self.config.draft_tokens(DraftSource.NGRAM)))
            if drafts:
                return Proposal(DraftSource.NGRAM, drafts, len(drafts))
            if (
                not model_active and self.adaptive
            ):  # nothing drafts this step: a fruitless attempt (it cost the overlap)
                spec.ngram.record(0, num_outputs)
        if model_active:
            num_tokens = min(max_tokens, self.config.draft_tokens(DraftSource.MODEL))
            catch_up = spec.model_continues_at != (seq.num_admissions, len(seq.token_ids))
            return Proposal(DraftSource.MODEL, (), num_tokens, catch_up)
        return None

    def on_verified(self, seq: SchedulerSequence, entry: StepEntry, num_accepted: int, current: bool) -> None:
        """Rolls back the KV of rejected drafts: fewer computed tokens, blocks past the computed ones freed.

        The executor cuts its block table by the same rule, so both keep the same blocks;
        the freed ones held rejected KV only and are never offered to the prefix cache.
        """
        seq.drafts_in_flight = False
        num_rejected = entry.num_drafts - num_accepted
        entry.num_computed_after -= num_rejected
        if current:
            seq.num_computed_tokens -= num_rejected
            self.kv.truncate(seq, cdiv(seq.num_computed_tokens, self.config.block_size))
        source = entry.draft_source
        self.stats[source].record(entry.num_drafts, num_accepted)
        spec = self._seqs.get(seq.seq_id)
        if spec is None or not self.adaptive:
            return
        record, break_even, num_outputs = spec.record_of(source), self.break_even(source), len(seq.output_token_ids)
        record.record(num_accepted, num_outputs, break_even)
        if source is DraftSource.MODEL:
            if current:  # its tokens once this result is applied: the draft KV is current but for them
                spec.model_continues_at = (seq.num_admissions, len(seq.token_ids) + num_accepted + 1)
            # It pays: its cost measured, this attempt won more than that, and the sequence keeps drafting.
            pays = self.model_cost is not None and num_accepted >= break_even and record.active(num_outputs)
            self.switch.attempted(pays)

    def break_even(self, source: DraftSource) -> float:
        """Accepted tokens per attempt below which drafting from ``source`` loses time."""
        if source is DraftSource.MODEL and self.model_cost is not None:
            return max(MIN_ACCEPTED_PER_ATTEMPT, self.model_cost)
        return MIN_ACCEPTED_PER_ATTEMPT

    def on_step(self, timings: StepTimings, decode_batch: int, drafts: bool | None) -> None:
        """Measures a step's cost: a plain decode step's by batch, and the draft model's break-even.

        ``decode_batch``: the step's sequences when each computed one token (else 0); ``drafts``:
        None for a step without drafts, True where it measures the draft model (some of them are its,
        none of its sequences catching up on earlier tokens first).
        """
        self.num_steps += 1
        rest_ns = timings.prepare_ns + timings.forward_ns + timings.sample_ns
        if rest_ns <= 0:
            return
        if drafts is None:
            if decode_batch:
                self.plain_step_ns[decode_batch] = _ewma(self.plain_step_ns.get(decode_batch), rest_ns, EWMA_WEIGHT)
            return
        if not drafts or timings.draft_ns <= 0:
            return
        # With A accepted per attempt, a token costs (draft + step) / (1 + A) against a plain step's P: the
        # draft model wins above (draft + step) / P - 1. P not measured at this batch: taken as this step's
        # (a verifying step costs about a plain one at batch 1), which gives draft / step.
        plain_ns = self.plain_step_ns.get(decode_batch) if decode_batch else None
        cost = (timings.draft_ns + rest_ns) / (plain_ns or rest_ns) - 1
        self.model_cost = _ewma(self.model_cost, cost, COST_EWMA_WEIGHT)


def _ewma(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else mean + weight * (value - mean)
