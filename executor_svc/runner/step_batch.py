"""The tensors of one step, built vectorised from the runner's sequence states.

Everything a forward needs (input ids, RoPE table rows, slot mapping, padded
block tables) is computed here once per step, never per layer.
"""

from __future__ import annotations

import dataclasses

import torch

from executor_svc.attention.metadata import AttentionMetadata, PrefillSpan
from executor_svc.lora.batch import Segment, adapter_segments
from executor_svc.serving.sequence_table import SequenceState


@dataclasses.dataclass
class StepBatch:
    """The flattened inputs of one forward."""

    input_ids: torch.Tensor  # [T] int64
    # [T] int64: each token's row in the model's RoPE tables, its position in its sequence (plus one factor set's
    # rows for a sequence on LongRoPE's long factors: models.rope).
    rope_rows: torch.Tensor
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64, rows of the hidden states to sample
    # The sequences that sample, in sample_rows order: each has state.num_sample_rows consecutive entries
    # of sample_rows (one, or one per draft plus one when it verifies drafts).
    sample_states: list[SequenceState]
    # SamplingParams.prompt_logprobs: (state, its first row, that row's position, rows) of the chunk rows that
    # predict a prompt token (each row predicts the token after it).
    prompt_spans: list[tuple[SequenceState, int, int, int]] = dataclasses.field(default_factory=list)
    # (adapter name, first row, end row) of each run of rows with one LoRA adapter (lora.batch); (): none.
    lora_segments: tuple[Segment, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Flattened tokens of the step."""
        return int(self.input_ids.shape[0])


def build_step_batch(
    scheduled: list[tuple[SequenceState, int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    rope_offset: int = 0,
    lora: bool = False,
) -> StepBatch:
    """Lays out the scheduled tokens, decode (one token) rows first.

    A sequence with drafts (docs/speculative-decoding.md) is laid out as one
    decode row per token it computes, its last known token and each draft:
    the rows share its block table and see one more position each (the step
    writes every row's K/V before any row attends), so each position runs the
    decode path plain decoding runs, and it samples at every one of them.
    ``sliding_window`` is the one the attention metadata carries (the runner
    leaves it None and sets each layer group's window on a copy).
    ``rope_offset``: the rows of one factor set in the RoPE tables of a model
    with a LongRoPE switch (``RotaryEmbedding.max_len``), added to the rows of
    the sequences on the long factors; 0: the model has one set.
    ``lora``: the runner has LoRA adapters; the rows of each adapter are then
    laid out together (decode rows by adapter, then position; prefill chunks
    by adapter) and ``lora_segments`` says where (``executor_svc.lora.batch``).
    """
    rows = _rows(scheduled, lora)
    input_ids: list[int] = []
    flat_blocks: list[int] = []
    starts, counts, block_counts = [], [], []
    # seq_id -> (state, its sampled rows in position order), in order of first appearance.
    sampled: dict[int, tuple[SequenceState, list[int]]] = {}
    prompt_spans = []
    for state, start, token_ids in rows:
        end = start + len(token_ids)
        predicting = min(end, state.num_prompt_tokens - 1) - start  # rows whose next token is a prompt token
        if state.sampling.prompt_logprobs is not None and predicting > 0:
            prompt_spans.append((state, len(input_ids), start, predicting))
        input_ids.extend(token_ids)
        num_blocks = -(-end // block_size)
        flat_blocks.extend(state.block_table[:num_blocks])
        starts.append(start)
        counts.append(len(token_ids))
        block_counts.append(num_blocks)
        if end >= len(state.token_ids):  # reaches the last known token (or a draft after it)
            sampled.setdefault(state.seq_id, (state, []))[1].append(len(input_ids) - 1)
    num_decode = sum(1 for n in counts if n == 1)
    # Built from lists, not with repeat_interleave: it forks the intra-op threads for a few dozen elements, and
    # at the start of a step the second core is often still busy with the scheduler's work on the last result,
    # so that fork waited for it (~2.5 ms a step in a W-mixed run) where the lists take microseconds.
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    query_start_loc = torch.tensor(offsets, dtype=torch.int64)
    rope_rows, slot_mapping = _rope_rows_and_slots(rows, num_decode, block_size, rope_offset)
    block_tables = _padded_block_tables(flat_blocks, block_counts)  # [S, MB]
    prefills = _prefill_spans(rows, num_decode, query_start_loc, block_counts)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor([a + b for a, b in zip(starts, counts)], dtype=torch.int64).to(device),
        query_start_loc=query_start_loc.to(device),
        num_decode_seqs=num_decode,
        prefills=prefills,
        block_size=block_size,
        sliding_window=sliding_window,
    )
    return StepBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
        rope_rows=rope_rows.to(device),
        attn_meta=meta,
        sample_rows=torch.tensor([r for _, rs in sampled.values() for r in rs], dtype=torch.int64).to(device),
        sample_states=[state for state, _ in sampled.values()],
        prompt_spans=prompt_spans,
        lora_segments=adapter_segments((state.lora_name, len(ids)) for state, _, ids in rows) if lora else (),
    )


def _rows(scheduled: list[tuple[SequenceState, int]], lora: bool) -> list[tuple[SequenceState, int, list[int]]]:
    """(state, first position, token ids) of each attention row: decode rows by context length, then chunks;
    with ``lora``, the base model's rows first, then each adapter's."""
    decodes: list[tuple[SequenceState, int, list[int]]] = []
    chunks = []
    for state, num_scheduled in scheduled:
        start = state.num_computed_tokens
        token_ids = state.token_ids[start : start + num_scheduled]
        if state.draft_token_ids:
            token_ids += state.draft_token_ids
            decodes.extend((state, start + i, [token_id]) for i, token_id in enumerate(token_ids))
        elif num_scheduled == 1:
            decodes.append((state, start, token_ids))
        else:
            chunks.append((state, start, token_ids))
    # Decode rows by context length, so backends can group similar lengths.
    if not lora:
        decodes.sort(key=lambda row: row[1])
        return decodes + chunks
    decodes.sort(key=lambda row: (row[0].lora_name or "", row[1]))
    chunks.sort(key=lambda row: row[0].lora_name or "")
    return decodes + chunks


def _padded_block_tables(flat_blocks: list[int], block_counts: list[int]) -> torch.Tensor:
    """Block tables [S, max_blocks] from their concatenation, padded with block 0."""
    width = max(block_counts)
    padded: list[int] = []
    first = 0
    for count in block_counts:
        padded.extend(flat_blocks[first : first + count])
        padded.extend([0] * (width - count))
        first += count
    return torch.tensor(padded, dtype=torch.int64).view(len(block_counts), width)


def _rope_rows_and_slots(rows, num_decode: int, block_size: int, rope_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's RoPE table row and KV slot ([T] int64 each): decode rows in Python, each chunk with a few ops.

    The row is the token's position, plus rope_offset for a sequence on the long LongRoPE factors.
    """
    rope_rows: list[int] = []
    slots: list[int] = []
    for state, start, _ in rows[:num_decode]:
        rope_rows.append(start + rope_offset if state.long_rope else start)
        slots.append(state.block_table[start // block_size] * block_size + start % block_size)
    row_parts, slot_parts = [torch.tensor(rope_rows, dtype=torch.int64)], [torch.tensor(slots, dtype=torch.int64)]
    for state, start, token_ids in rows[num_decode:]:
        chunk = torch.arange(start, start + len(token_ids), dtype=torch.int64)
        table = torch.tensor(state.block_table[: -(-(start + len(token_ids)) // block_size)], dtype=torch.int64)
        row_parts.append(chunk + rope_offset if state.long_rope else chunk)
        slot_parts.append(table[chunk // block_size] * block_size + chunk % block_size)
    if len(row_parts) == 1:
        return row_parts[0], slot_parts[0]
    return torch.cat(row_parts), torch.cat(slot_parts)


def _prefill_spans(rows, num_decode, query_start_loc, block_counts) -> tuple[PrefillSpan, ...]:
    starts = query_start_loc.tolist()
    return tuple(
        PrefillSpan(
            seq_index=i,
            query_start=starts[i],
            num_query_tokens=len(rows[i][2]),
            num_cached_tokens=rows[i][1],
            num_blocks=block_counts[i],
        )
        for i in range(num_decode, len(rows))
    )
