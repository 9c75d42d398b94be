"""Output constraints in the executor: a matcher per constrained sequence, masks computed beside the forward.

A sequence's matcher is a function of its token ids: it is built on first use
(from a template matcher per constraint, so a schema compiles once) and then
consumes the outputs it has not seen, ``token_ids[num_prompt_tokens + consumed:]``.
A new, preempted, moved or resumed sequence and a running one take the same
path; nothing about a matcher is ever sent or saved. The engine is llguidance
(docs/structured-outputs.md); its matchers release the GIL, so the masks of a
step are computed on a worker thread while the model thread runs the forward.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Sequence

import llguidance
import numpy as np
import structlog
import tokenizers
import torch

from executor_svc.serving.sequence_table import SequenceState
from pagoda.constraint import Constraint
from pagoda.grammar import grammar_of

log = structlog.get_logger(__name__)
# Compiled constraints kept for reuse (a template matcher each, never advanced itself).
MAX_TEMPLATES = 256
# The int32 whose bits are float32 -inf: a refused token's bias.
_NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000


@dataclasses.dataclass
class MatcherState:
    """One sequence's matcher and how many of its output tokens it consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0


@dataclasses.dataclass(frozen=True)
class StepMasks:
    """The masks of a step's constrained rows."""

    # Indices into the step's sampling states, one per row of bias.
    rows: list[int]
    # [R, V] float32: 0 where a token is allowed, -inf where it is not (added to the logits).
    bias: torch.Tensor
    # Sampling-row index -> why its constraint failed (the sequence is failed, not sampled from).
    errors: dict[int, str]


class ConstraintEngine:
    """Matchers and masks for one model's tokenizer."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # Every EOS id of the model ends a match (the mask allows them all where the grammar may end).
        eos = [e for e in eos_token_ids if 0 <= e < vocab_size] or None
        self._tokenizer = llguidance.LLTokenizer(_plain_tokenizer(tokenizer_json), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._templates: collections.OrderedDict[Constraint, llguidance.LLMatcher] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        # The bias rows of the last step, reused: a step's bias is added to its logits before the next step's
        # masks start (one step at a time), and a fresh 12 MiB array per step (64 rows) costs page faults.
        self._bias = np.empty((0, vocab_size), dtype=np.int32)

    def start(self, states: Sequence[SequenceState]) -> concurrent.futures.Future[StepMasks] | None:
        """Starts the masks of the constrained ``states`` on the worker thread; None when none is constrained."""
        rows = [i for i, state in enumerate(states) if state.structured is not None]
        if not rows:
            return None
        return self._pool.submit(self.masks, [(i, states[i]) for i in rows])

    def masks(self, entries: list[tuple[int, SequenceState]]) -> StepMasks:
        """Advances each matcher over its new tokens and fills its row of the bitmask."""
        # [R, W]: bit v % 32 of word v // 32 set when token v is allowed; each row is written whole.
        bitmask = np.empty((len(entries), self.num_words), dtype=np.int32)
        errors: dict[int, str] = {}
        live: list[tuple[llguidance.LLMatcher, int]] = []
        for j, (i, state) in enumerate(entries):
            problem = self._advance(state)
            if problem is None:
                live.append((state.matcher.matcher, j))
            else:
                errors[i] = problem
                bitmask[j] = -1  # sampled freely, then failed: the token is not returned
        if live:
            self._executor.unsafe_compute_mask_ptr(live, bitmask.ctypes.data, self.num_words * 4, len(entries))
        if self._bias.shape[0] < len(entries):
            self._bias = np.empty((len(entries), self.vocab_size), dtype=np.int32)
        bias = bias_of_bitmask(bitmask, self.vocab_size, self._bias[: len(entries)])
        return StepMasks([i for i, _ in entries], bias, errors)

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The template matcher of ``constraint`` (compiled on first use, then kept, least recently used out)."""
        template = self._templates.get(constraint)
        if template is not None:
            self._templates.move_to_end(constraint)
            return template
        template = llguidance.LLMatcher(self._tokenizer, grammar_of(constraint), log_level=0)
        self._templates[constraint] = template
        if len(self._templates) > MAX_TEMPLATES:
            self._templates.popitem(last=False)
        return template

    def _advance(self, state: SequenceState) -> str | None:
        """Consumes the outputs the matcher has not seen; why it cannot, or None."""
        assert state.structured is not None
        if state.matcher is None:
            template = self.compile(state.structured)
            if template.is_error():
                return f"constraint: {template.get_error()}"
            state.matcher = MatcherState(template.deep_copy())
        ms: MatcherState = state.matcher
        num_outputs = len(state.token_ids) - state.num_prompt_tokens
        for token_id in state.token_ids[state.num_prompt_tokens + ms.num_consumed :]:
            if ms.matcher.is_stopped():  # past the end: the overlap's extra token, dropped by the scheduler
                break
            if not ms.matcher.consume_token(token_id):
                return f"constraint: output token {token_id} is not allowed here: {ms.matcher.get_error()}"
        ms.num_consumed = num_outputs
        return None


def _plain_tokenizer(tokenizer_json: str) -> str:
    """The tokenizer document without padding or truncation (they would change how llguidance tokenizes)."""
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return str(tokenizer.to_str())


def bias_of_bitmask(bitmask: np.ndarray, vocab_size: int, out: np.ndarray | None = None) -> torch.Tensor:
    """The logit bias of a bitmask: [R, V] float32, 0 where a bit is set and -inf where not.

    Built here, on the mask thread, so that applying it on the critical path is one
    vectorised add (a masked_fill over a bool mask costs several times more on the CPU).

    Args:
        bitmask: [R, W] int32, little-endian words (token v is bit v % 8 of byte v // 8).
        vocab_size: V <= 32 W.
        out: [R, V] int32 to write into (a new array when None).
    """
    refused = np.unpackbits(~bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # [R, V] 0/1
    bias = np.multiply(refused, _NEG_INF_BITS, out=out, dtype=np.int32)
    return torch.from_numpy(bias.view(np.float32))
