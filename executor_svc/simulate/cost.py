"""The step-time model of the simulated executor, fitted to measured model steps.

A step's time is linear in what it computes:

    step_s = base_s
           + per_prefill_token_s * prefill_tokens      (GEMMs of prompt chunks)
           + per_prefill_pair_s * prefill_pairs        (their causal attention: query x key pairs)
           + per_decode_seq_s * decode_seqs            (GEMMs and the LM head of one-token rows)
           + per_context_token_s * context_tokens      (decode attention: KV tokens read)

`bench/fit_step_cost.py` measures real steps of a model on this machine over a
grid of batch sizes, contexts and prompt chunks, fits the five constants by
least squares (none negative), and prints them with the fit's error; the
measurements it fitted are committed next to it (`bench/data/`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """What one step computes, in the units the cost model charges for."""

    # Tokens of sequences scheduled for more than one token (prompt chunks).
    prefill_tokens: int = 0
    # (query, key) pairs of those chunks' causal attention: n * cached + n * (n + 1) / 2 each.
    prefill_pairs: int = 0
    # Sequences scheduled for one token (decoding).
    decode_seqs: int = 0
    # KV tokens those decode sequences attend to (their context, the new token included).
    context_tokens: int = 0

    @classmethod
    def of(cls, scheduled: Iterable[tuple[int, int]]) -> StepFeatures:
        """Features of a step from (tokens already computed, tokens scheduled) per sequence."""
        prefill_tokens = prefill_pairs = decode_seqs = context_tokens = 0
        for num_computed, num_scheduled in scheduled:
            if num_scheduled == 1:
                decode_seqs += 1
                context_tokens += num_computed + 1
            elif num_scheduled > 1:
                prefill_tokens += num_scheduled
                prefill_pairs += num_scheduled * num_computed + num_scheduled * (num_scheduled + 1) // 2
        return cls(prefill_tokens, prefill_pairs, decode_seqs, context_tokens)

    def row(self) -> tuple[int, int, int, int, int]:
        """The regressors in StepCost's order (1 for the constant first)."""
        return (1, self.prefill_tokens, self.prefill_pairs, self.decode_seqs, self.context_tokens)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds per unit of each feature (see the module docstring)."""

    base_s: float
    per_prefill_token_s: float
    per_prefill_pair_s: float
    per_decode_seq_s: float
    per_context_token_s: float

    def __post_init__(self) -> None:
        if any(c < 0 for c in self.coefficients()):
            raise ValueError(f"step cost constants must not be negative: {self}")

    @classmethod
    def from_coefficients(cls, coefficients: Iterable[float]) -> StepCost:
        """A cost model from coefficients in `StepFeatures.row` order."""
        return cls(*(float(c) for c in coefficients))

    def coefficients(self) -> tuple[float, float, float, float, float]:
        """The constants in `StepFeatures.row` order."""
        return (
            self.base_s,
            self.per_prefill_token_s,
            self.per_prefill_pair_s,
            self.per_decode_seq_s,
            self.per_context_token_s,
        )

    def seconds(self, features: StepFeatures) -> float:
        """Modelled time of a step that computes `features` (0 for an empty step)."""
        if features.prefill_tokens == 0 and features.decode_seqs == 0:
            return 0.0
        return sum(c * x for c, x in zip(self.coefficients(), features.row()))


# SmolLM2-135M-Instruct, bfloat16, C++ kernels, one intra-op thread (one core of this AVX-512/AMX CPU): a decode
# step of one sequence takes 24 ms, of 32 at context 512 some 78 ms. Fitted to 34 measured points (relative error:
# median 4.3%, worst 38%) by `.venv/bin/python bench/fit_step_cost.py --out bench/data/step_cost_smollm2_bf16.json`,
# which holds the measurements.
SMOLLM2_BF16_CPU = StepCost(
    base_s=2.35583e-02,
    per_prefill_token_s=3.77661e-04,
    per_prefill_pair_s=2.58806e-07,
    per_decode_seq_s=5.63838e-04,
    per_context_token_s=2.18767e-06,
)
