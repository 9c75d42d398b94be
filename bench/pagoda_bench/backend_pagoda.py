"""Run a benchmark workload against a Pagoda server (asyncio, one channel)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda_bench.metrics import RequestRecord
from pagoda_bench.progress import ProgressBar
from pagoda_bench.workload import BenchRequest
from pagoda_client import AsyncClient, PagodaError, TlsConfig


@dataclass(frozen=True)
class PagodaBackendConfig:
    """How to reach the server and what to ask of it."""

    target: str
    api_key: str | None = None
    tls: bool | TlsConfig = False
    temperature: float = 0.0
    max_concurrency: int | None = None
    max_duration_s: float = 600.0
    request_timeout_s: float | None = None
    # Constrain a share of the requests (spread evenly over the workload's order) to this JSON schema.
    json_schema: str | None = None
    structured_fraction: float = 1.0
    # LoRA adapters the requests name in turn (request i: loras[i % len]); "" for the base model; (): none.
    loras: tuple[str, ...] = ()

    def lora_of(self, index: int) -> str | None:
        """The adapter request ``index`` names, or None for the base model."""
        return self.loras[index % len(self.loras)] or None if self.loras else None

    def schema_of(self, index: int) -> str | None:
        """The schema request ``index`` is constrained to, or None."""
        fraction = self.structured_fraction
        constrained = math.floor((index + 1) * fraction) > math.floor(index * fraction)
        return self.json_schema if constrained else None


async def _run_one(
    client: AsyncClient, request: BenchRequest, config: PagodaBackendConfig, t0: float, progress: ProgressBar
) -> RequestRecord:
    record = RequestRecord(request.index, request.prompt_len, request.output_len, time.perf_counter() - t0)
    try:
        async with client.stream(
            token_ids=request.prompt_token_ids,
            max_tokens=request.output_len,
            ignore_eos=True,
            temperature=config.temperature,
            timeout=config.request_timeout_s,
            json_schema=config.schema_of(request.index),
            lora=config.lora_of(request.index),
        ) as deltas:
            async for delta in deltas:
                if delta.token_ids:
                    record.chunk_times_s.append(time.perf_counter() - t0)
                    record.chunk_num_tokens.append(len(delta.token_ids))
                    progress.update(num_tokens=len(delta.token_ids))
                if delta.usage is not None:
                    record.cached_tokens = delta.usage.cached_tokens
        record.success = record.output_len > 0
    except PagodaError as error:
        record.error = str(error)
    except asyncio.CancelledError:
        record.error = "cancelled: --max-duration-s reached"
    progress.update(num_done=1)
    return record


async def run_pagoda_async(
    requests: Sequence[BenchRequest],
    arrivals_s: Sequence[float],
    config: PagodaBackendConfig,
    progress: ProgressBar,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; returns (records, duration)."""
    semaphore = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    async with AsyncClient(config.target, api_key=config.api_key, tls=config.tls, max_retries=0) as client:
        t0 = time.perf_counter()

        async def scheduled(request: BenchRequest, arrival_s: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, arrival_s - (time.perf_counter() - t0)))
            async with semaphore:
                return await _run_one(client, request, config, t0, progress)

        tasks = [asyncio.ensure_future(scheduled(r, a)) for r, a in zip(requests, arrivals_s)]
        await asyncio.wait(tasks, timeout=config.max_duration_s)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        duration_s = time.perf_counter() - t0
    records = [
        r
        if isinstance(r, RequestRecord)
        else RequestRecord(q.index, q.prompt_len, q.output_len, math.nan, error="not sent: --max-duration-s reached")
        for q, r in zip(requests, results)
    ]
    return records, duration_s


def run_pagoda(
    requests: Sequence[BenchRequest],
    arrivals_s: Sequence[float],
    config: PagodaBackendConfig,
    progress: ProgressBar,
) -> tuple[list[RequestRecord], float]:
    """Synchronous wrapper of ``run_pagoda_async``."""
    return asyncio.run(run_pagoda_async(requests, arrivals_s, config, progress))
