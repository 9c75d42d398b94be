"""Pagoda client: ``Client``, ``AsyncClient``, their options and result types.

Imports only grpcio, protobuf, the standard library and the ``pagoda``
package's pure modules (the wire code, the parameter table, channel settings).
"""

from pagoda.channel import TlsConfig
from pagoda_client._param_options import ParamOptions
from pagoda_client.aio import AsyncClient, AsyncGenerationStream
from pagoda_client.client import Client, GenerationStream
from pagoda_client.errors import PagodaError
from pagoda_client.options import CallOptions, GenerateOptions, RequestOptions, TokenizeOptions
from pagoda_client.results import (
    ExecutorStatus,
    FinishReason,
    GenerationDelta,
    GenerationResult,
    GroupRankStatus,
    LogprobEntry,
    LoraAdapter,
    ModelInfo,
    ServerStatus,
    Timings,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncGenerationStream",
    "CallOptions",
    "Client",
    "ExecutorStatus",
    "FinishReason",
    "GenerateOptions",
    "GenerationDelta",
    "GenerationResult",
    "GenerationStream",
    "GroupRankStatus",
    "LogprobEntry",
    "LoraAdapter",
    "ModelInfo",
    "PagodaError",
    "ParamOptions",
    "RequestOptions",
    "ServerStatus",
    "Timings",
    "TlsConfig",
    "TokenLogprob",
    "TokenizeOptions",
    "Usage",
]
