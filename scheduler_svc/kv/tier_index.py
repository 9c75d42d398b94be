"""What one executor's offload tier holds, as the scheduler knows it, and whether loading from it pays.

The executor reports its tier (docs/kv-offload.md): every hash at ``Describe``,
then what changed in each step result (``tier_added``/``tier_removed``; the
first result of a stream carries everything, ``tier_reset``). The scheduler
plans against this view: a hash it sends a save for counts as held at once
(the executor serves a load of a block still queued for writing), and a hash
whose load failed is forgotten. The view may be briefly wrong either way; a
wrong "held" costs one recomputation (the load fails recoverably), never a
wrong token.

The cost model compares, per block, the measured time to load it with the
measured time to compute its tokens: exponential averages of what the
executor reports (``load_ns`` of steps that loaded; ``forward_ns`` per token
of steps large enough to be prefill-bound). Until both are measured, loads
are taken (on the CPUs measured so far a load is ~100x cheaper).

Pure Python: no torch, no numpy, no protos.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.step import BlockSave, StepResult

# Weight of the newest measurement in the averages.
EWMA_ALPHA = 0.2
# Steps computing at least this many tokens measure the prefill cost per token (decode steps cost more per token).
PREFILL_SAMPLE_TOKENS = 256


class TierCostModel:
    """Seconds to load a block vs seconds to compute one, from what steps took."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.load_s_per_block: float | None = None
        self.compute_s_per_token: float | None = None

    def observe(self, num_loaded_blocks: int, result: StepResult) -> None:
        """One step's result (num_loaded_blocks: loads its plan asked for)."""
        if num_loaded_blocks and result.timings.load_ns:
            self.load_s_per_block = _ewma(self.load_s_per_block, result.timings.load_ns / 1e9 / num_loaded_blocks)
        if result.num_scheduled_tokens >= PREFILL_SAMPLE_TOKENS and result.timings.forward_ns:
            per_token = result.timings.forward_ns / 1e9 / result.num_scheduled_tokens
            self.compute_s_per_token = _ewma(self.compute_s_per_token, per_token)

    @property
    def loads_pay(self) -> bool:
        """Whether loading a block beats computing its tokens (True until both are measured)."""
        if self.load_s_per_block is None or self.compute_s_per_token is None:
            return True
        return self.load_s_per_block <= self.block_size * self.compute_s_per_token


def _ewma(average: float | None, value: float) -> float:
    return value if average is None else (1 - EWMA_ALPHA) * average + EWMA_ALPHA * value


class TierIndex:
    """The hashes one executor's tier holds, the saves to send it, and its cost model."""

    def __init__(self, block_size: int, hashes: Iterable[int] = ()) -> None:
        self._hashes = set(hashes)
        self._saves: list[BlockSave] = []
        self.cost = TierCostModel(block_size)
        # Saves sent, and hashes forgotten because their load failed.
        self.num_saves = 0
        self.num_failed_loads = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def queue_save(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Asks the executor to store a full, computed block (unless its tier holds that hash)."""
        if block_hash not in self._hashes:
            self._hashes.add(block_hash)
            self._saves.append(BlockSave(block_id, block_hash, token_ids))

    @property
    def has_saves(self) -> bool:
        return bool(self._saves)

    def take_saves(self) -> tuple[BlockSave, ...]:
        """The saves for the next plan (it must carry them: their blocks may be reused in that step)."""
        saves, self._saves = tuple(self._saves), []
        self.num_saves += len(saves)
        return saves

    def apply(self, result: StepResult) -> None:
        """What a step result says the tier gained and lost."""
        if result.tier_reset:
            self._hashes = set(result.tier_added)
            self._hashes.update(save.block_hash for save in self._saves)
            return
        self._hashes.update(result.tier_added)
        self._hashes.difference_update(result.tier_removed)

    def forget(self, block_hashes: Iterable[int]) -> None:
        """Hashes whose load failed: not held (the executor removed them or never had them)."""
        for block_hash in block_hashes:
            self._hashes.discard(block_hash)
            self.num_failed_loads += 1
