"""The simulated runner behind `pagoda-executor --simulate`: no model, no torch.

It follows step plans exactly as the model runner does (the same
`SequenceTable`: block tables, limits, per-sequence errors), sleeps for the time
the cost model gives the step, and samples tokens that are a deterministic
function of the sequence: a hash of (seed, position, the four previous token
ids), or of (position, the four previous token ids) for greedy rows. So the
same request gives the same tokens on any simulated executor, alone or in any
batch, and a request moved or resumed elsewhere continues identically. Tokens
are drawn from the vocabulary minus its special tokens: a simulated sequence
never emits EOS and runs to its max_tokens (or a stop string), which keeps the
load of a benchmark exactly what it asked for.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import NoReturn

from executor_svc.config import ExecutorConfig
from executor_svc.loading.tokenizer_files import TokenizerFiles
from executor_svc.lora.errors import LoraAdapterError, LoraRegistryError
from executor_svc.serving.sequence_table import SequenceState, SequenceTable
from executor_svc.simulate.cost import SMOLLM2_BF16_CPU, StepCost, StepFeatures
from executor_svc.simulate.tokenizer import SPECIAL_TOKENS, simulated_tokenizer_files
from pagoda.step import ExecutorInfo, LogprobEntry, SeqOutput, StepPlan, StepResult, StepTimings, TokenLogprob

MODEL_NAME = "simulated"
# The key of a greedy row (no seed can be negative).
_GREEDY = -1
# Previous tokens that enter a token's hash (a short context, like an n-gram model).
_CONTEXT = 4
_KEY = struct.Struct("<qq4q")
# Temperatures below this are greedy, as in the sampler.
_GREEDY_TEMPERATURE = 1e-5
# A sampled token's logprob is a multiple of 1/_LOGPROB_SCALE in (-_LOGPROB_RANGE, 0].
_LOGPROB_SCALE = 1024
_LOGPROB_RANGE = 4


def token_hash(seed: int, position: int, previous: list[int]) -> int:
    """64 bits from (seed, position, the `_CONTEXT` previous token ids; -1 where there are fewer)."""
    context = previous[-_CONTEXT:]
    padded = [-1] * (_CONTEXT - len(context)) + context
    return int.from_bytes(hashlib.blake2b(_KEY.pack(seed, position, *padded), digest_size=8).digest(), "little")


class SimulatedRunner:
    """A `Runner` whose steps take the time of `cost` times `time_scale` and sample hashed tokens."""

    def __init__(self, info: ExecutorInfo, cost: StepCost, time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must not be negative")
        self.info = info
        self.cost = cost
        self.time_scale = time_scale
        self._table = SequenceTable(info.num_kv_blocks, info.block_size, info.vocab_size, info.max_model_len)
        # Sampled ids avoid the special tokens, which come first in the vocabulary.
        self._first_token_id = len(SPECIAL_TOKENS)

    def num_sequences(self) -> int:
        """Sequences whose state this runner holds."""
        return len(self._table.seqs)

    def reset(self) -> None:
        """Drops every sequence (a new scheduler stream starts from scratch)."""
        self._table.seqs.clear()

    def warmup(self) -> None:
        """Nothing to warm up (the servicer's start-up is the same for both runners)."""

    def add_lora(self, name: str, path: str) -> NoReturn:
        """Refused: a simulated model has no weights to adapt."""
        raise LoraAdapterError("a simulated executor (--simulate) serves no LoRA adapters")

    def remove_lora(self, name: str) -> NoReturn:
        raise LoraRegistryError(f"unknown LoRA adapter {name!r} (registered: none)")

    def lora_adapters(self) -> tuple[()]:
        return ()

    def execute(self, step: StepPlan) -> StepResult:
        """Follows `step`, samples every sequence that reaches its end, and sleeps the modelled step time."""
        start_ns = time.perf_counter_ns()
        scheduled, errors = self._table.apply(step)
        features = StepFeatures.of(
            (state.num_computed_tokens, n + len(state.draft_token_ids)) for state, n in scheduled
        )
        outputs = []
        for state, num_scheduled in scheduled:
            state.num_computed_tokens += num_scheduled
            if state.num_computed_tokens == len(state.token_ids):
                outputs.append(self._sample(state))
        prepared_ns = time.perf_counter_ns()
        step_s = self.cost.seconds(features) * self.time_scale
        remaining_s = step_s - (prepared_ns - start_ns) / 1e9
        if remaining_s > 0:
            time.sleep(remaining_s)
        timings = StepTimings(prepare_ns=prepared_ns - start_ns, forward_ns=time.perf_counter_ns() - prepared_ns)
        return StepResult(
            step_id=step.step_id,
            outputs=tuple(outputs),
            errors=tuple(errors),
            timings=timings,
            num_scheduled_tokens=features.prefill_tokens + features.decode_seqs,
        )

    def _sample(self, state: SequenceState) -> SeqOutput:
        """The next token of `state` (or its accepted drafts and one), appended to it, with logprobs when asked."""
        sampling = state.sampling
        seed = _GREEDY if sampling.temperature < _GREEDY_TEMPERATURE else sampling.seed
        rows = [self._token_at(seed, state.tokens_at_row(j)) for j in range(state.num_sample_rows)]
        num_tokens = state.accept([token_id for token_id, _ in rows], self.info.block_size)
        token_ids = tuple(token_id for token_id, _ in rows[:num_tokens])
        if sampling.logprobs is None:
            return SeqOutput(state.seq_id, token_ids)
        logprobs = tuple(self._logprobs(token_id, bits, sampling.logprobs) for token_id, bits in rows[:num_tokens])
        return SeqOutput(state.seq_id, token_ids, logprobs)

    def _token_at(self, seed: int, token_ids: list[int]) -> tuple[int, int]:
        """(token, its hash bits) after token_ids."""
        bits = token_hash(seed, len(token_ids), token_ids)
        return self._first_token_id + bits % (self.info.vocab_size - self._first_token_id), bits

    def _logprobs(self, token_id: int, bits: int, num_top: int) -> LogprobEntry:
        """A deterministic logprob for the token; the `num_top` best are it and the ids after it, less likely."""
        logprob = -((bits >> 32) % (_LOGPROB_SCALE * _LOGPROB_RANGE)) / _LOGPROB_SCALE
        sampled = TokenLogprob(token_id, logprob)
        num_choices = self.info.vocab_size - self._first_token_id
        top = tuple(
            TokenLogprob(self._first_token_id + (token_id - self._first_token_id + k) % num_choices, logprob - k / 2)
            for k in range(min(num_top, num_choices))
        )
        return LogprobEntry(sampled, top)


def simulated_runner(config: ExecutorConfig) -> tuple[SimulatedRunner, TokenizerFiles]:
    """The simulated runner and tokenizer `config` describes (`--simulate-*`, `--block-size`, `--max-model-len`)."""
    tokenizer = simulated_tokenizer_files(config.simulate_vocab_size, config.simulate_tokenizer)
    info = ExecutorInfo(
        incarnation_id="",
        model_name=config.model_name or MODEL_NAME,
        architecture="Simulated",
        dtype="none",
        kv_cache_dtype="none",
        device="simulated",
        block_size=config.block_size or 16,
        num_kv_blocks=config.simulate_kv_blocks,
        max_model_len=config.max_model_len or 8192,
        vocab_size=config.simulate_vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        tokenizer_json="",
        chat_template="",
        bos_token="",
        eos_token="",
    )
    return SimulatedRunner(info, SMOLLM2_BF16_CPU, config.simulate_time_scale), tokenizer
