"""Baseline: the same workload through Hugging Face ``generate``, in process.

Static batching: consecutive requests in batches of ``batch_size``, prompts
left-padded, each batch runs to its longest wanted output
(``min_new_tokens = max_new_tokens = longest``, greedy); a request counts
only its own wanted tokens, timed at the step that produced each of them.
Every request arrives at time 0 (later batches wait for earlier ones). One
small untimed warm-up batch runs first (kernel selection / JIT), as the
executor warms up before it reports SERVING.
torch and transformers are imported only here, lazily.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda_bench.metrics import RequestRecord
from pagoda_bench.progress import ProgressBar
from pagoda_bench.workload import BenchRequest

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HfBackendConfig:
    """The baseline's model and batching."""

    model_path: str
    dtype: str = "float32"
    batch_size: int = 16
    max_duration_s: float = 600.0
    num_threads: int | None = None
    """torch intra-op threads (None: torch's default)."""


def resolve_model_path(model: str) -> str:
    """A checkpoint folder; ``default`` is the prepared SmolLM2 folder."""
    if model != "default":
        return model
    from executor_svc.loading.model_cache import prepare_default_model

    return str(prepare_default_model())


def load_model(config: HfBackendConfig) -> Any:
    """The transformers model in eval mode, in ``config.dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(config.model_path), dtype=getattr(torch, config.dtype)
    )
    return model.eval()


def model_vocab(model: Any) -> tuple[int, tuple[int, ...]]:
    """(vocab size, EOS ids) of a loaded model."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return model.config.vocab_size, eos_ids


def _left_padded(batch: Sequence[BenchRequest], pad_id: int) -> tuple[Any, Any]:
    import torch

    longest = max(r.prompt_len for r in batch)
    ids = [[pad_id] * (longest - r.prompt_len) + list(r.prompt_token_ids) for r in batch]
    mask = [[0] * (longest - r.prompt_len) + [1] * r.prompt_len for r in batch]
    # input_ids, attention_mask: [batch, longest prompt]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def _step_clock(t0: float, deadline_s: float, step_times: list[float], batch_size: int) -> Any:
    """A stopping criterion that records each step's time and stops at the deadline."""
    import torch
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            now = time.perf_counter() - t0
            step_times.append(now)
            return torch.full((batch_size,), now > deadline_s, dtype=torch.bool)

    return StepClock()


def run_batch(model: Any, batch: Sequence[BenchRequest], t0: float, deadline_s: float) -> list[float]:
    """Generate one static batch; returns the time of each decode step."""
    import torch
    from transformers import StoppingCriteriaList

    _, eos_ids = model_vocab(model)
    pad_id = eos_ids[0] if eos_ids else 0
    input_ids, attention_mask = _left_padded(batch, pad_id)
    longest = max(r.output_len for r in batch)
    step_times: list[float] = []
    clock = _step_clock(t0, deadline_s, step_times, len(batch))
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return step_times


def warm_up(model: Any, batch_size: int) -> None:
    """An untimed tiny batch (16 prompt tokens, 4 new tokens)."""
    vocab_size, eos_ids = model_vocab(model)
    token_id = next(t for t in range(vocab_size) if t not in eos_ids)
    batch = [BenchRequest(i, (token_id,) * 16, 4) for i in range(batch_size)]
    run_batch(model, batch, time.perf_counter(), float("inf"))


def run_hf(
    model: Any, requests: Sequence[BenchRequest], config: HfBackendConfig, progress: ProgressBar
) -> tuple[list[RequestRecord], float]:
    """Run the workload in static batches (after a warm-up); returns (records, duration).

    When ``max_duration_s`` cuts a batch, its requests fail and the duration
    is the end of the last whole batch, so the throughput is that of the
    batches that ran to completion.
    """
    warm_up(model, min(config.batch_size, len(requests)))
    t0 = time.perf_counter()
    records = [RequestRecord(r.index, r.prompt_len, r.output_len, 0.0) for r in requests]
    duration_s = 0.0
    for start in range(0, len(requests), config.batch_size):
        if time.perf_counter() - t0 > config.max_duration_s:
            break
        batch = requests[start : start + config.batch_size]
        step_times = run_batch(model, batch, t0, config.max_duration_s)
        batch_records = records[start : start + config.batch_size]
        for request, record in zip(batch, batch_records):
            own_times = step_times[: request.output_len]
            record.chunk_times_s = own_times
            record.chunk_num_tokens = [1] * len(own_times)
            record.success = len(own_times) == request.output_len
            record.error = "" if record.success else "cut: --max-duration-s reached"
            progress.update(num_done=1, num_tokens=len(own_times))
        if not all(r.success for r in batch_records):
            for record in batch_records:
                record.success, record.error = False, "cut: --max-duration-s reached"
            break
        duration_s = time.perf_counter() - t0
    for record in records:
        if not record.success and not record.error:
            record.error = "not run: --max-duration-s reached"
    return records, duration_s or time.perf_counter() - t0
