"""API keys on the client API: `authorization: Bearer <key>` metadata.

Keys come from --api-keys (comma-separated) and --api-keys-file (one per
line, `#` comments); none configured means no authentication. Keys are
compared in constant time, and a refused call logs nothing of the request.
"""

from __future__ import annotations

import hmac
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from pagoda.runtime.grpc_server import Context, MalformedRequestInterceptor

if TYPE_CHECKING:
    from pagoda.runtime.grpc_server import Handler

log = structlog.get_logger("scheduler")

# Health and reflection stay open: Kubernetes probes carry no key.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def load_api_keys(keys: str, keys_file: str) -> tuple[bytes, ...]:
    """All configured keys (empty: authentication off)."""
    found = [k.strip() for k in keys.split(",") if k.strip()]
    if keys_file:
        for line in pathlib.Path(keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return tuple(k.encode() for k in found)


def key_is_valid(presented: str | None, keys: tuple[bytes, ...]) -> bool:
    """Constant-time comparison against every key (no early exit on a match)."""
    if presented is None:
        return False
    candidate = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key)
    return matched


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key with UNAUTHENTICATED."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self._keys = keys

        self._deny_unary: Handler = grpc.unary_unary_rpc_method_handler(_deny)
        self._deny_stream: Handler = grpc.unary_stream_rpc_method_handler(_deny_stream)
        self._deny_bidi: Handler = grpc.stream_stream_rpc_method_handler(_deny_bidi)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        authorization = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if isinstance(authorization, str) and key_is_valid(bearer_token(authorization), self._keys):
            return await continuation(handler_call_details)
        log.warning("unauthenticated_call", method=method)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_bidi
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


async def _deny(request: Any, context: Context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")


async def _deny_stream(request: Any, context: Context) -> AsyncIterator[None]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    yield  # pragma: no cover - makes this an async generator


async def _deny_bidi(requests: Any, context: Context) -> AsyncIterator[None]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    yield  # pragma: no cover - makes this an async generator


def build_interceptors(api_keys: str, api_keys_file: str) -> list[grpc.aio.ServerInterceptor]:
    """The client API's interceptors: API keys (when configured) first, so a
    refused call is never parsed; then malformed requests → INVALID_ARGUMENT."""
    keys = load_api_keys(api_keys, api_keys_file)
    auth = [ApiKeyInterceptor(keys)] if keys else []
    return [*auth, MalformedRequestInterceptor()]
