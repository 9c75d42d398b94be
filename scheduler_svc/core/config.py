"""The configuration of one scheduler core: the limits of one executor's KV pool and batch, and its speculation.

Not a service configuration: the scheduler service's is `SchedulerServiceConfig` (scheduler_svc/config.py, from
flags and environment). The engine derives one `SchedulerConfig` per executor from it and what the executor
reports (`ExecutorInfo`: its block pool, model length, draft model) in `Engine._scheduler_config`, when the
executor's scheduler core is made.
"""

from __future__ import annotations

import dataclasses
import enum

# --speculative (docs/speculative-decoding.md): n-gram drafts, the executor's draft model, or n-gram drafts
# first and the draft model where no n-gram matches.
SPECULATIVE_METHODS = ("off", "ngram", "draft", "ngram+draft")


class DraftSource(enum.Enum):
    """Where a sequence's speculative tokens come from."""

    # Prompt lookup by the scheduler (scheduler_svc.spec.ngram): the plan carries the tokens.
    NGRAM = "ngram"
    # The executor's draft model (--draft-model): the plan carries how many.
    MODEL = "model"


# Drafts per sequence and step of each source unless --num-speculative-tokens says: the best measured
# (docs/speculative-decoding.md). Lookups are free, so long n-gram runs only cost their rejected rows; each
# draft-model token costs a pass of the draft model.
DEFAULT_DRAFT_TOKENS = {DraftSource.NGRAM: 8, DraftSource.MODEL: 4}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler core (one executor's KV pool)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int = 256
    # Token budget of one step across all sequences.
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    # A request waiting longer than this is served first, whatever its priority.
    max_priority_wait_s: float = 30.0
    # Speculative decoding (docs/speculative-decoding.md): one of SPECULATIVE_METHODS (a method with the
    # draft model only where the executor has one); drafts per sequence and step, of either source (None:
    # each source's own default, draft_tokens); no drafts while more sequences than speculative_max_batch run.
    speculative: str = "off"
    num_speculative_tokens: int | None = None
    speculative_max_batch: int = 8
    # Drafting pauses where it does not pay (scheduler_svc.spec.speculation); False: every allowed step drafts.
    speculative_adaptive: bool = True
    # The executor has a KV offload tier (docs/kv-offload.md): save full blocks to it, load prefixes from it.
    kv_offload: bool = False
    # LongRoPE (ExecutorInfo.rope_switch_len): a sequence longer than this runs on the long factors, one within
    # it on the short ones, and one that grows past it is recomputed on the long ones (docs/decisions.md,
    # model families); 0: the model has one factor set.
    rope_switch_len: int = 0
    # LoRA adapters the executor keeps resident at once (ExecutorInfo.max_loras): at most this many distinct
    # adapters among its running sequences; 0: no limit (an executor without adapters).
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.rope_switch_len < 0:
            raise ValueError(f"rope_switch_len must not be negative, got {self.rope_switch_len}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")

    def draft_tokens(self, source: DraftSource) -> int:
        """Most drafts per sequence and step from ``source``: num_speculative_tokens, else its default."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return DEFAULT_DRAFT_TOKENS[source]

    def long_rope(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens known tokens runs on LongRoPE's long factors (as transformers
        computes the next token of a sequence that long)."""
        return 0 < self.rope_switch_len < num_tokens

    @property
    def max_draft_tokens(self) -> int:
        """Most drafts per sequence and step from any source."""
        return max(self.draft_tokens(source) for source in DraftSource)
