"""ModelRunner: a step plan in, one batched forward + sampling, tokens out.

The runner keeps its own copy of each sequence (token ids, block table, tokens
computed) and follows the plan exactly: it makes no scheduling decision and
owns no block accounting. A plan error hits only the sequence it concerns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc.attention import get_backend
from executor_svc.attention.layer_states import LayerStates
from executor_svc.kv.cache import KVCache, KVCacheSpec, default_block_size, num_blocks_for_budget
from executor_svc.loading.model_config import ModelConfig
from executor_svc.loading.weights import load_checkpoint, validate_tensors
from executor_svc.lora.registry import LoraInfo, LoraRegistry
from executor_svc.models import DecoderModel, get_model_family
from executor_svc.models.layer_ops import LayerOps, get_layer_ops
from executor_svc.models.registry import parse_model_config
from executor_svc.models.rope import rope_switch_len
from executor_svc.parallel.collectives import fatal
from executor_svc.parallel.shard import GroupShard
from executor_svc.quant.modes import resolve_quantization
from executor_svc.runner import sequence_loras, warmup
from executor_svc.runner.device import dtype_name, resolve_device, resolve_dtype, resolve_kv_dtype
from executor_svc.runner.draft_model import DraftCheckpoint, DraftModel, load_draft_checkpoint
from executor_svc.runner.step_batch import StepBatch, build_step_batch
from executor_svc.sampling.constraints import ConstraintEngine, StepMasks
from executor_svc.sampling.prompt_logprobs import prompt_logprobs, with_prompt_logprobs
from executor_svc.sampling.sampler import SampleRequest, sample
from executor_svc.serving.sequence_table import SequenceState, SequenceTable
from pagoda.step import ExecutorInfo, SeqError, SeqOutput, StepPlan, StepResult, StepTimings

if TYPE_CHECKING:
    from executor_svc.kv.tier.step_io import TierStepIO
    from executor_svc.parallel.collectives import GroupComm

log = structlog.get_logger(__name__)
# A step's masks run beside its forward; waiting longer than this for them is a bug, not load.
MASK_TIMEOUT_S = 60.0


class ModelRunner:
    """Holds the model, the paged KV cache and per-sequence state."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        device: str = "auto",
        block_size: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_memory_fraction: float = 0.85,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        layer_ops: str = "auto",
        quantization: str = "auto",
        quantized_activations: str = "auto",
        draft_model_path: str | None = None,
        batch_invariant: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        max_cpu_loras: int | None = None,
        group: GroupComm | None = None,
    ):
        self.device = resolve_device(device)
        # A rank of an executor group (docs/parallel.md): its shard of the weights and KV; None: the whole model.
        self.group = group
        self.shard: GroupShard | None = None
        self.dtype = resolve_dtype(dtype, self.device)
        self.batch_invariant = batch_invariant
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        # Implementations by name first: a bad name fails before the weights are read.
        self.backend = get_backend(attention_backend, self.device, self.dtype, batch_invariant)
        if self.kv_dtype == torch.int8 and self.backend.name == "torch":
            log.warning(
                "kv_cache_int8_fallback",
                detail="the torch attention backend dequantizes the int8 KV cache as it gathers it: correct, and the "
                "same capacity, but no faster than a bf16 cache (the C++ kernels read int8; make install builds them)",
            )
        # batch_invariant: linear layers whose rows do not depend on the rest of the step (attention: get_backend).
        base_ops = get_layer_ops(layer_ops, self.device, self.dtype, batch_invariant)
        self.quantization = resolve_quantization(
            quantization, quantized_activations, model_path, self.device, self.dtype, base_ops, batch_invariant
        )
        ops = self.quantization.wrap(base_ops)
        shard_for = self._shard_for if group is not None else None
        checkpoint = load_checkpoint(model_path, self.quantization.mode.keeps_gguf, shard_for)
        self.config = parse_model_config(checkpoint.config)
        # What this process builds and caches: the whole model, or a group rank's shard of it.
        self.model_config = self.shard.config if self.shard is not None else self.config
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        absent = self.shard.absent() if self.shard is not None else frozenset()
        self.model = self._build_model(validate_tensors(self.model_config, checkpoint.tensors, absent), ops)
        del checkpoint.tensors
        # LongRoPE: sequences longer than this run on the long factors (0: one set); the tables hold a set per
        # max_model_len rows, so the long set's rows start there (models.rope).
        self.rope_switch_len = rope_switch_len(self.config, self.max_model_len)
        self._rope_offset = self.max_model_len if self.rope_switch_len else 0
        # Built before the KV cache is sized (on CUDA the budget is a fraction of the memory left); unquantized:
        # the model's quantization may be a GGUF file's own blocks, and a small draft gains little from it.
        draft = None
        if draft_model_path:
            draft = load_draft_checkpoint(draft_model_path, self.dtype, self.device, self.max_model_len, base_ops)
        self.block_size = block_size or default_block_size(self.device, self.config.head_dim, self.kv_dtype)
        self.kv_cache, draft_kv_cache = self._allocate_kv_cache(kv_cache_memory_bytes, kv_cache_memory_fraction, draft)
        # The draft model proposing speculative tokens (docs/speculative-decoding.md); None: none.
        self.draft: DraftModel | None = None
        if draft is not None and draft_kv_cache is not None:
            self.draft = DraftModel(draft, draft_kv_cache, self.backend, self.config.vocab_size)
        self._layer_states = LayerStates(self.model_config.layers)
        self._table = SequenceTable(
            self.kv_cache.num_blocks,
            self.block_size,
            self.config.vocab_size,
            self.max_model_len,
            has_draft_model=self.draft is not None,
            rope_switch_len=self.rope_switch_len,
        )
        self._seqs = self._table.seqs  # seq_id -> SequenceState
        # (sample function, request class); tests wrap it to record logits.
        self._sample_fn = (sample, SampleRequest)
        # Matchers and masks of constrained sequences (enable_constraints: needs the tokenizer).
        self.constraints: ConstraintEngine | None = None
        # The offload tier's side of each step (attach_tier); None: no tier, loads are refused recoverably.
        self.tier_io: TierStepIO | None = None
        # LoRA adapters (add_lora): max_loras resident at once, packed for the model's layer ops, never quantized.
        self.loras = LoraRegistry(
            self.config,
            functools.partial(self.model.ops.pack, dense=True),
            self.dtype,
            self.device,
            max_loras=max_loras,
            max_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            in_use=lambda: sequence_loras.in_use(self._seqs),
        )
        self.info = self._describe(checkpoint.name, checkpoint.extra_eos_token_ids)

    def _describe(self, model_name: str, extra_eos_token_ids: tuple[int, ...]) -> ExecutorInfo:
        """What Describe reports of the model and the KV cache; the servicer adds itself and the tokenizer."""
        return ExecutorInfo(
            incarnation_id="",
            model_name=model_name,
            architecture=self.config.architecture,
            dtype=dtype_name(self.dtype),
            quantization=self.quantization.effective(self.model.ops),
            kv_cache_dtype=dtype_name(self.kv_dtype),
            device=str(self.device),
            block_size=self.block_size,
            num_kv_blocks=self.kv_cache.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
            eos_token_ids=tuple(dict.fromkeys(self.config.eos_token_ids + extra_eos_token_ids)),
            tokenizer_json="",
            chat_template="",
            bos_token="",
            eos_token="",
            draft_model=self.draft.name if self.draft is not None else "",
            kv_cache_bytes=self.kv_cache.num_bytes,
            draft_kv_cache_bytes=self.draft.kv_cache.num_bytes if self.draft is not None else 0,
            rope_switch_len=self.rope_switch_len,
            batch_invariant=self.batch_invariant,
            max_loras=self.loras.max_loras,
            max_lora_rank=self.loras.max_rank,
        )

    def _shard_for(self, config: dict) -> GroupShard:
        """This group rank's shard of the model of a config.json dict (what the loader reads of each tensor)."""
        assert self.group is not None
        full = parse_model_config(config)
        self.shard = GroupShard(full, self.group.placement)
        self.group.vocab_size = full.vocab_size
        log.info("group_shard", rank=self.group.placement.rank, holds=self.shard.describe())
        return self.shard

    def _build_model(self, tensors: dict[str, torch.Tensor], ops: LayerOps) -> DecoderModel:
        """The architecture's model (or this group rank's shard of it), built by its registry entry."""
        family = get_model_family(self.config.architecture)
        model = family.build(self.model_config, tensors, self.dtype, self.device, self.max_model_len, ops)
        if self.group is not None:
            model.parallel = self.group
            placement = self.group.placement
            if placement.tp_size > 1 and getattr(model, "fused_decode", None) is not None:
                # One C++ call through every layer has no all-reduce in it (a pipeline stage keeps it).
                model.fused_decode, model.decode_path = None, "per layer (tensor parallel all-reduces in it)"
            if not placement.first_stage:  # a later stage's input is hidden states (a tied LM head is packed)
                model.embed = None
        return model

    def _allocate_kv_cache(
        self, memory_bytes: int | None, memory_fraction: float, draft: DraftCheckpoint | None
    ) -> tuple[KVCache, KVCache | None]:
        """The paged KV cache, as many blocks as the budget holds, and the draft model's for the same blocks."""
        spec = self._kv_spec(self.model_config)
        draft_spec = self._kv_spec(draft.config) if draft is not None else None
        shared_with = (draft_spec,) if draft_spec is not None else ()
        num_blocks = num_blocks_for_budget(spec, self.device, memory_bytes, memory_fraction, shared_with)
        if self.group is not None:  # one block pool for the group: every rank holds the blocks the leader reports
            num_blocks = self.group.agree_min(num_blocks)
        kv_cache = KVCache(spec, num_blocks, self.device)
        return kv_cache, KVCache(draft_spec, num_blocks, self.device) if draft_spec is not None else None

    def _kv_spec(self, config: ModelConfig) -> KVCacheSpec:
        return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, self.block_size, self.kv_dtype)

    # -- public API ---------------------------------------------------------

    def enable_constraints(self, tokenizer_json: str, eos_token_ids: Sequence[int]) -> None:
        """Accept constrained sequences, matched with this tokenizer (sequences without one pay nothing)."""
        self.constraints = ConstraintEngine(tokenizer_json, self.config.vocab_size, eos_token_ids)

    def attach_tier(self, tier_io: TierStepIO) -> None:
        """Serve the plans' loads and saves through this offload tier (docs/kv-offload.md)."""
        self.tier_io = tier_io

    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Registers the PEFT LoRA adapter in folder ``path`` as ``name``: read and checked now, made resident
        when a sequence names it (docs/lora.md). The same adapter again under its name is returned as it is.

        Raises:
            LoraAdapterError: it does not fit this model; the message names the problem and nothing changes.
            LoraRegistryError: the name holds another adapter.
        """
        known = name in self.loras
        info = self.loras.register(name, path)
        if not known:
            log.info("lora_added", name=name, path=path, rank=info.rank, target_modules=list(info.target_modules))
        return info

    def remove_lora(self, name: str) -> int:
        """Forgets adapter ``name``: new sequences may not name it; the running sequences that use it finish
        with it first. Returns how many those are.

        Raises:
            LoraRegistryError: unknown.
        """
        at_once = self.loras.unregister(name)
        running = 0 if at_once else sum(state.lora_name == name for state in self._seqs.values())
        log.info("lora_removed" if at_once else "lora_retiring", name=name, num_running=running)
        return running

    def lora_adapters(self) -> tuple[LoraInfo, ...]:
        """The adapters new sequences may name, in registration order."""
        return self.loras.infos()

    def num_sequences(self) -> int:
        """Sequences whose state this runner holds."""
        return len(self._seqs)

    def has_sequence(self, seq_id: int) -> bool:
        """Whether the runner holds state for seq_id."""
        return seq_id in self._seqs

    def reset(self) -> None:
        """Drops every sequence (a new scheduler stream starts from scratch)."""
        self._seqs.clear()
        for name in self.loras.sweep():
            log.info("lora_removed", name=name)
        if self.draft is not None:
            self.draft.reset()

    def execute(self, step: StepPlan) -> StepResult:
        """Runs one step plan: its saves copied out, its loads filled, one forward over all scheduled tokens,
        then sampling.

        A new sequence whose LoRA adapter (``NewSequence.lora_name``) is unknown, or cannot be made resident,
        fails alone.
        """
        start_ns = time.perf_counter_ns()
        tier_io = self.tier_io
        save_ns = tier_io.save(step.saves) if tier_io is not None and step.saves else 0
        scheduled, errors = self._table.apply(step, can_load=tier_io is not None)
        if len(self.loras) or any(new.lora_name for new in step.new_seqs):
            scheduled = sequence_loras.admit(self.loras, self._seqs, step, scheduled, errors)
        if self.draft is not None:
            self.draft.follow(step, self._seqs)
        requests = self._table.loads_of(step)
        load_ns = 0
        if requests:
            scheduled, load_ns = self._load(requests, scheduled, errors)
        result = self._execute(step, scheduled, errors, start_ns)
        if save_ns or load_ns:
            timings = dataclasses.replace(result.timings, load_ns=load_ns, save_ns=save_ns)
            result = dataclasses.replace(result, timings=timings)
        for name in self.loras.sweep():  # retiring adapters whose last sequence ended
            log.info("lora_removed", name=name)
        return result

    def _load(self, requests, scheduled, errors):
        """Fills the requests' blocks from the tier; a sequence whose loads fail is dropped, recoverably."""
        assert self.tier_io is not None
        try:
            with torch.inference_mode():
                failures, load_ns = self.tier_io.load(requests)
        except Exception as exc:  # a load that breaks fails its sequences, which are recomputed
            log.exception("kv_offload_load_failed")
            reason = f"load failed: {type(exc).__name__}: {exc}"
            failures = {s.seq_id: (tuple(b.block_hash for b in loads), reason) for s, loads in requests}
            load_ns = 0
        return self._table.drop_failed_loads(scheduled, errors, failures), load_ns

    def _execute(self, step, scheduled, errors, start_ns) -> StepResult:
        if not scheduled:
            timings = StepTimings(prepare_ns=time.perf_counter_ns() - start_ns)
            return StepResult(step_id=step.step_id, errors=tuple(errors), timings=timings)
        try:
            with torch.inference_mode():
                return self._run(step.step_id, scheduled, errors, start_ns)
        except Exception as exc:  # one bad step must not kill the executor
            log.exception("step_failed", step_id=step.step_id)
            if self.group is not None:  # the other ranks wait in this step's collectives: the group cannot go on
                fatal(f"step {step.step_id} failed on rank {self.group.placement.rank}: {type(exc).__name__}: {exc}")
            if self.draft is not None:
                self.draft.abandon()
            for state, _ in scheduled:
                self._seqs.pop(state.seq_id, None)
                errors.append(SeqError(state.seq_id, f"step failed: {type(exc).__name__}: {exc}"))
            return StepResult(step_id=step.step_id, errors=tuple(errors))

    def warmup(self) -> warmup.WarmupReport:
        """One step of each kind the scheduler sends (runner.warmup); KV contents and sequences are left as they
        were."""
        return warmup.run(self)

    # -- the step -----------------------------------------------------------

    def _run(self, step_id, scheduled, errors, start_ns) -> StepResult:
        draft_ns = self._propose_drafts(scheduled)
        batches = self._micro_batches(scheduled)
        sample_states = [state for batch in batches for state in batch.sample_states]
        # The masks of the constrained rows are computed while the forward runs (None: no row is constrained).
        masks = None
        if self.constraints is not None and self._samples_here:
            masks = self.constraints.start(sample_states)
        prepared_ns = time.perf_counter_ns()
        hiddens = self._forward_all(batches)
        logits, scored = None, {}
        if hiddens[0] is not None:  # the last pipeline stage (every rank without a pipeline)
            # [N, V]; the sampler widens what it needs
            logits = torch.cat([self.model.compute_logits(h[b.sample_rows]) for h, b in zip(hiddens, batches)])
            for hidden, batch in zip(hiddens, batches):
                if batch.prompt_spans:
                    scored.update(prompt_logprobs(self.model, hidden, batch.prompt_spans))
            if logits.is_cuda:
                torch.cuda.synchronize()
        forward_done_ns = time.perf_counter_ns()
        for state, num_scheduled in scheduled:
            state.num_computed_tokens += num_scheduled
        outputs, scored = self._sample(sample_states, logits, masks, errors, scored)
        outputs = with_prompt_logprobs(outputs, scored, self.has_sequence)
        if self.draft is not None:
            self.draft.confirm()
        end_ns = time.perf_counter_ns()
        timings = StepTimings(
            prepare_ns=prepared_ns - start_ns - draft_ns,
            forward_ns=forward_done_ns - prepared_ns,
            sample_ns=end_ns - forward_done_ns,
            draft_ns=draft_ns,
        )
        return StepResult(
            step_id=step_id,
            outputs=tuple(outputs),
            errors=tuple(errors),
            timings=timings,
            num_scheduled_tokens=sum(batch.num_tokens for batch in batches),
        )

    @property
    def _samples_here(self) -> bool:
        """Whether this process samples (a group's sampler rank shares its tokens with the others)."""
        return self.group is None or self.group.placement.rank == self.group.sampler_rank

    def _micro_batches(self, scheduled: list[tuple[SequenceState, int]]) -> list[StepBatch]:
        """The step's batch; over a pipeline, up to one micro-batch per stage (contiguous runs of the sequences,
        by tokens), so the stages work on different micro-batches at once."""
        parts = [scheduled]
        if self.group is not None and self.group.placement.pp_size > 1 and len(scheduled) > 1:
            parts = split_by_tokens(scheduled, self.group.placement.pp_size)
        lora = len(self.loras) > 0
        return [
            build_step_batch(part, self.block_size, self.device, rope_offset=self._rope_offset, lora=lora)
            for part in parts
        ]

    def _forward_all(self, batches: list[StepBatch]) -> list[torch.Tensor | None]:
        """Each micro-batch's hidden states; on a pipeline each comes from the previous stage and goes to the next
        (None: the stage is not the last)."""
        group = self.group
        if group is None or group.placement.pp_size == 1:
            return [self._forward(batch) for batch in batches]
        placement, hiddens, sends = group.placement, [], []
        for batch in batches:
            hidden_in = None
            if not placement.first_stage:
                hidden_in = group.recv_hidden(batch.num_tokens, self.config.hidden_size, self.dtype)
            hidden = self._forward(batch, hidden_in)
            if placement.last_stage:
                hiddens.append(hidden)
            else:
                sends.append(group.send_hidden(hidden))
                hiddens.append(None)
        group.wait_all(sends)
        return hiddens

    def _propose_drafts(self, scheduled: list[tuple[SequenceState, int]]) -> int:
        """The draft model's proposals for the sequences the plan asks it for; returns its passes' time (ns)."""
        drafting = [state for state, _ in scheduled if state.num_model_draft_tokens]
        if not drafting or self.draft is None:
            return 0
        start_ns = time.perf_counter_ns()
        self.draft.propose(drafting)
        return time.perf_counter_ns() - start_ns

    def _forward(self, batch: StepBatch, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        layer_states = self._layer_states.prepare(self.backend, batch.attn_meta)  # [num_layers]
        if hidden_in is not None:  # a later pipeline stage: the previous stage's hidden states in
            model = self.model
            return model.forward(
                batch.input_ids, batch.rope_rows, self.kv_cache, self.backend, layer_states, None, hidden_in
            )
        if not batch.lora_segments:  # no row has an adapter: the model's own path (the fused decode included)
            return self.model.forward(batch.input_ids, batch.rope_rows, self.kv_cache, self.backend, layer_states)
        lora = sequence_loras.step_deltas(self.loras, batch.lora_segments, self.model.ops.linear)
        return self.model.forward(batch.input_ids, batch.rope_rows, self.kv_cache, self.backend, layer_states, lora)

    def _sample(
        self,
        states: list[SequenceState],
        logits: torch.Tensor | None,
        pending: concurrent.futures.Future[StepMasks] | None,
        errors: list[SeqError],
        scored: dict,
    ) -> tuple[list[SeqOutput], dict]:
        """Samples every row ([R, V] logits), then appends each sequence's token (or accepted drafts and one).

        In an executor group the sampler rank samples and shares its rows, the failed rows and the prompt
        logprobs with every rank, so every rank's sequences take the same tokens. Returns the outputs and the
        prompt logprobs.
        """
        sampled_rows: list = []
        failed: dict[int, str] = {}
        if states and self._samples_here:
            assert logits is not None
            sampled_rows, failed = self._sample_rows(states, logits, pending)
        if self.group is not None:
            sampled_rows, failed, scored = self.group.share((sampled_rows, failed, scored), self.group.sampler_rank)
        outputs = []
        first_row = 0
        for i, state in enumerate(states):
            sampled = sampled_rows[first_row : first_row + state.num_sample_rows]
            first_row += state.num_sample_rows
            if i in failed:
                self._seqs.pop(state.seq_id, None)
                errors.append(SeqError(state.seq_id, failed[i]))
                continue
            num_tokens = state.accept([out.token_id for out in sampled], self.block_size)
            new_token_ids = tuple(state.token_ids[-num_tokens:])
            logprobs = tuple(out.logprob for out in sampled[:num_tokens] if out.logprob is not None)
            outputs.append(SeqOutput(state.seq_id, new_token_ids, logprobs))
        return outputs, scored

    def _sample_rows(
        self,
        states: list[SequenceState],
        logits: torch.Tensor,
        pending: concurrent.futures.Future[StepMasks] | None,
    ) -> tuple[list, dict[int, str]]:
        """Every row's sample, and the states that fail (by index, with the reason)."""
        sample_fn, request_cls = self._sample_fn
        # (state, row of it): one row per sequence, one more per draft.
        rows = [(state, j) for state in states for j in range(state.num_sample_rows)]
        requests = [request_cls(s.sampling, s.tokens_at_row(j), s.num_prompt_tokens) for s, j in rows]
        failed = self._unmatched(states)
        if pending is None:
            return sample_fn(logits, requests, self.model.ops.argmax), failed
        masks = pending.result(timeout=MASK_TIMEOUT_S)
        failed.update(masks.errors)
        bias = (_logit_rows(states, masks.rows), masks.bias)
        return sample_fn(logits, requests, self.model.ops.argmax, bias), failed

    def _unmatched(self, states: list[SequenceState]) -> dict[int, str]:
        """Constrained rows this runner cannot enforce (constraints not enabled): they fail, never run free."""
        if self.constraints is not None:
            return {}
        return {i: "this executor does not enforce constraints" for i, s in enumerate(states) if s.structured}


def _logit_rows(states: list[SequenceState], state_indices: list[int]) -> list[int]:
    """Logit rows of the given sampling states (a state with drafts has several rows; constrained ones never do)."""
    firsts, row = [], 0
    for state in states:
        firsts.append(row)
        row += state.num_sample_rows
    return [firsts[i] for i in state_indices]


def split_by_tokens(scheduled: list[tuple[SequenceState, int]], parts: int) -> list[list[tuple[SequenceState, int]]]:
    """``scheduled`` cut into at most ``parts`` contiguous non-empty runs of about equal tokens."""
    total = sum(n for _, n in scheduled)
    runs: list[list[tuple[SequenceState, int]]] = [[]]
    done = 0
    for entry in scheduled:
        boundary = total * len(runs) / parts
        if runs[-1] and done >= boundary and len(runs) < parts:
            runs.append([])
        runs[-1].append(entry)
        done += entry[1]
    return runs
