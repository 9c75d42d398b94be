"""Pagoda client: ``Client``, ``AsyncClient`` and their result types.

Imports only grpcio, protobuf and the standard library.
"""

from pagoda_client.aio import AsyncClient, AsyncGenerationStream
from pagoda_client.client import Client, GenerationStream
from pagoda_client.errors import PagodaError
from pagoda_client.types import (
    ExecutorStatus,
    FinishReason,
    GenerationDelta,
    GenerationResult,
    LogprobEntry,
    ModelInfo,
    ServerStatus,
    Timings,
    TlsConfig,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncGenerationStream",
    "Client",
    "ExecutorStatus",
    "FinishReason",
    "GenerationDelta",
    "GenerationResult",
    "GenerationStream",
    "LogprobEntry",
    "ModelInfo",
    "PagodaError",
    "ServerStatus",
    "Timings",
    "TlsConfig",
    "TokenLogprob",
    "Usage",
]
