"""Run a benchmark workload against any OpenAI-compatible server (vLLM, llama.cpp's llama-server, Pagoda's HTTP API).

Each request is one streamed ``POST /v1/completions`` whose prompt is the workload's token ids
(every such server accepts them, and the prompt length stays exact), with ``max_tokens`` = the
wanted output length and ``ignore_eos`` (vLLM and Pagoda read it; llama.cpp's ``/v1/completions``
passes unknown fields on to its own ``/completion`` parameters, where ``ignore_eos`` is one).
The stream carries text, not tokens: ``StreamTally`` turns its chunks into the same
``RequestRecord`` the gRPC backend fills, so ``metrics`` and ``report`` read both alike.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pagoda_bench.metrics import RequestRecord
from pagoda_bench.progress import ProgressBar
from pagoda_bench.workload import BenchRequest

# Bound on GET /v1/models (the model name lookup), within --max-duration-s.
MODEL_LOOKUP_TIMEOUT_S = 30.0
# Characters of a server's error body kept in a record.
MAX_ERROR_CHARS = 300


class StreamError(Exception):
    """The server answered with an error: a non-200 status, or an error event in the stream."""


@dataclass(frozen=True)
class OpenAIBackendConfig:
    """Where the server is and what to ask of it."""

    # The server's root (``http://127.0.0.1:8000``); a trailing ``/v1`` is accepted and dropped.
    base_url: str
    # The request's "model" field; None: the first model GET /v1/models lists.
    model_name: str | None = None
    # Sent as ``Authorization: Bearer <key>``.
    api_key: str | None = None
    temperature: float = 0.0
    max_concurrency: int | None = None
    max_duration_s: float = 600.0
    request_timeout_s: float | None = None

    @property
    def root_url(self) -> str:
        """``base_url`` without a trailing slash or ``/v1``."""
        return self.base_url.rstrip("/").removesuffix("/v1")


def checkpoint_vocab(model: str) -> tuple[int, tuple[int, ...], Callable[[str], list[int]]]:
    """(vocab size, EOS ids, tokenize) of a checkpoint folder (``default``: the prepared SmolLM2).

    An OpenAI server does not tell its vocabulary, so the workload draws its token ids from the
    checkpoint the servers were started from, with the EOS rule Pagoda's executor applies.
    """
    from tokenizers import Tokenizer

    from executor_svc.loading.tokenizer_files import read_tokenizer_files
    from pagoda_bench.backend_hf import resolve_model_path

    folder = Path(resolve_model_path(model))
    files = read_tokenizer_files(folder)
    vocab_size = json.loads((folder / "config.json").read_text()).get("vocab_size")
    if not isinstance(vocab_size, int):
        raise ValueError(f"{folder}/config.json has no vocab_size")
    tokenizer = Tokenizer.from_str(files.tokenizer_json)
    return vocab_size, files.eos_token_ids, lambda text: tokenizer.encode(text, add_special_tokens=False).ids


class StreamTally:
    """Folds the chunks of one completion stream into a ``RequestRecord``.

    A chunk whose choice has text counts one token at its arrival (TTFT is the first such
    chunk, ITLs the gaps between them, as ``vllm bench serve`` measures a text stream). The
    usage chunk's ``completion_tokens``, when the server sends it, sets the total: the tokens
    that showed no text of their own (an incomplete UTF-8 character, a skipped special token)
    are credited to the finishing chunk when it came after the last text, else to the last text
    chunk. A usage below the count of text chunks is ignored (each of them holds a token).
    """

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.finished = False
        self._finish_time_s: float | None = None
        self._completion_tokens: int | None = None

    def add(self, chunk: Any, now_s: float) -> int:
        """Count one chunk received at ``now_s``; returns the tokens it added.

        Raises:
            StreamError: an error event.
        """
        if not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") == "error":
            raise StreamError(error_text(chunk))
        self._note_usage(chunk.get("usage"))
        num_tokens = 0
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("text"):
                self.record.chunk_times_s.append(now_s)
                self.record.chunk_num_tokens.append(1)
                num_tokens += 1
            elif choice.get("finish_reason") is not None:
                self._finish_time_s = now_s
            self.finished = self.finished or choice.get("finish_reason") is not None
        return num_tokens

    def close(self) -> int:
        """Reconcile with the usage; returns the tokens that adds."""
        record = self.record
        missing = (self._completion_tokens or 0) - record.output_len
        if missing <= 0:
            return 0
        if self._finish_time_s is not None and (
            not record.chunk_times_s or self._finish_time_s > record.chunk_times_s[-1]
        ):
            record.chunk_times_s.append(self._finish_time_s)
            record.chunk_num_tokens.append(missing)
        elif record.chunk_num_tokens:
            record.chunk_num_tokens[-1] += missing
        else:
            return 0  # tokens without any arrival time: nothing to time them by
        return missing

    def _note_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if isinstance(usage.get("completion_tokens"), int):
            self._completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.record.cached_tokens = details["cached_tokens"]


def error_text(body: Any) -> str:
    """The message of an OpenAI-shaped error body (``{"error": {"message": ...}}`` or flat), shortened."""
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:MAX_ERROR_CHARS]


def describe(error: BaseException, timeout_s: float | None) -> str:
    """One line for a failed call whose bound was ``timeout_s``."""
    if isinstance(error, asyncio.TimeoutError):
        return "timed out" if timeout_s is None else f"timed out after {timeout_s:g} s"
    if isinstance(error, StreamError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def completion_body(request: BenchRequest, model_name: str, temperature: float) -> dict[str, Any]:
    """The JSON body of one streamed completion that must run to ``request.output_len`` tokens."""
    return {
        "model": model_name,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        # Special tokens (EOS, past which ignore_eos runs) then show as text, so each token makes a chunk.
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _check_status(response: aiohttp.ClientResponse) -> None:
    if response.status != 200:
        text = await response.text(errors="replace")
        try:
            message = error_text(json.loads(text))
        except ValueError:
            message = text[:MAX_ERROR_CHARS]
        raise StreamError(f"HTTP {response.status}: {message}")


async def sse_payloads(content: aiohttp.StreamReader) -> AsyncIterator[Any]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``.

    Raises:
        StreamError: an ``error:`` event (llama.cpp's way of ending a stream in error).
    """
    async for raw_line in content:
        field, _, value = raw_line.decode("utf-8").strip().partition(":")
        value = value.strip()
        if field == "error":
            raise StreamError(error_text(json.loads(value)))
        if field != "data":
            continue
        if value == "[DONE]":
            return
        yield json.loads(value)


def lookup_timeout_s(config: OpenAIBackendConfig) -> float:
    """Bound on GET /v1/models."""
    return min(MODEL_LOOKUP_TIMEOUT_S, config.max_duration_s)


async def fetch_model_name(session: aiohttp.ClientSession, config: OpenAIBackendConfig) -> str:
    """The first model GET /v1/models lists."""
    timeout = aiohttp.ClientTimeout(total=lookup_timeout_s(config))
    async with session.get(f"{config.root_url}/v1/models", timeout=timeout) as response:
        await _check_status(response)
        models = (await response.json(content_type=None)).get("data") or []
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise StreamError("GET /v1/models listed no model; give --model-name")
    return str(models[0]["id"])


async def _run_one(
    session: aiohttp.ClientSession,
    request: BenchRequest,
    model_name: str,
    config: OpenAIBackendConfig,
    t0: float,
    progress: ProgressBar,
) -> RequestRecord:
    record = RequestRecord(request.index, request.prompt_len, request.output_len, time.perf_counter() - t0)
    tally = StreamTally(record)
    body = completion_body(request, model_name, config.temperature)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    try:
        async with session.post(f"{config.root_url}/v1/completions", json=body, timeout=timeout) as response:
            await _check_status(response)
            async for chunk in sse_payloads(response.content):
                progress.update(num_tokens=tally.add(chunk, time.perf_counter() - t0))
        progress.update(num_tokens=tally.close())
        record.success = tally.finished and record.output_len > 0
        if not tally.finished:
            record.error = "the stream ended without a finish_reason"
    except (aiohttp.ClientError, asyncio.TimeoutError, StreamError, ValueError) as error:
        record.error = describe(error, config.request_timeout_s)
    except asyncio.CancelledError:
        record.error = "cancelled: --max-duration-s reached"
    progress.update(num_done=1)
    return record


def _not_sent(request: BenchRequest, error: str) -> RequestRecord:
    return RequestRecord(request.index, request.prompt_len, request.output_len, math.nan, error=error)


async def run_openai_async(
    requests: Sequence[BenchRequest],
    arrivals_s: Sequence[float],
    config: OpenAIBackendConfig,
    progress: ProgressBar,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; returns (records, duration).

    When the model name cannot be looked up, no request is sent and each record says why.
    """
    semaphore = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    # No connection cap (aiohttp's default is 100): --max-concurrency is the only bound on requests in flight.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        t0 = time.perf_counter()
        try:
            model_name = config.model_name or await fetch_model_name(session, config)
        except (aiohttp.ClientError, asyncio.TimeoutError, StreamError, ValueError) as error:
            reason = f"not sent: GET /v1/models failed: {describe(error, lookup_timeout_s(config))}"
            return [_not_sent(q, reason) for q in requests], time.perf_counter() - t0
        t0 = time.perf_counter()

        async def scheduled(request: BenchRequest, arrival_s: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, arrival_s - (time.perf_counter() - t0)))
            async with semaphore:
                return await _run_one(session, request, model_name, config, t0, progress)

        tasks = [asyncio.ensure_future(scheduled(r, a)) for r, a in zip(requests, arrivals_s)]
        await asyncio.wait(tasks, timeout=config.max_duration_s)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        duration_s = time.perf_counter() - t0
    records = [
        r if isinstance(r, RequestRecord) else _not_sent(q, "not sent: --max-duration-s reached")
        for q, r in zip(requests, results)
    ]
    return records, duration_s


def run_openai(
    requests: Sequence[BenchRequest],
    arrivals_s: Sequence[float],
    config: OpenAIBackendConfig,
    progress: ProgressBar,
) -> tuple[list[RequestRecord], float]:
    """Synchronous wrapper of ``run_openai_async``."""
    return asyncio.run(run_openai_async(requests, arrivals_s, config, progress))
