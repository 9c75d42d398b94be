"""What both gRPC servers share: health, reflection, TLS credentials, limits."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Any request / response type: servicers and interceptors see every method of a service.
Context = grpc.aio.ServicerContext[Any, Any]
if TYPE_CHECKING:  # generic in the type stubs only
    Handler = grpc.RpcMethodHandler[Any, Any]

# Keepalive so a dead peer is noticed in seconds, not at the next TCP timeout.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options bounding message sizes both ways."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Register grpc.health.v1 (all NOT_SERVING until told) and reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    """Set the overall ("") and per-service health status."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def _read(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None = None
) -> grpc.ServerCredentials | None:
    """TLS server credentials; with `client_ca`, client certificates are required (mTLS)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and a key")
    return grpc.ssl_server_credentials(
        [(pathlib.Path(key).read_bytes(), pathlib.Path(cert).read_bytes())],
        root_certificates=_read(client_ca),
        require_client_auth=bool(client_ca),
    )


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (server CA, optional client certificate for mTLS)."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both cert and key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not parse (invalid UTF-8 in a string field,
    truncated bytes, wrong wire types, nesting too deep) with INVALID_ARGUMENT.

    Without it grpc answers UNKNOWN and logs a traceback per bad message.
    Unary requests and bidi streams are wrapped (the client API: a message of
    a bidi stream that does not parse ends its call with INVALID_ARGUMENT).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming and not handler.response_streaming:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, or UnicodeDecodeError from some protobuf backends
                return _Malformed(exc)

        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _checked_bidi(handler.stream_stream), deserialize, handler.response_serializer
            )
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _checked_stream(handler.unary_stream), deserialize, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _checked_unary(handler.unary_unary), deserialize, handler.response_serializer
        )


def _checked_stream(behavior: Any) -> Callable[[Any, Context], AsyncIterator[Any]]:
    async def checked_stream(request: Any, context: Context) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await _refuse(context, request)
        # aclosing: a cancelled call must close the inner handler now
        # (it aborts its request), not when it is garbage-collected.
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return checked_stream


class _MalformedInStream(Exception):
    def __init__(self, request: _Malformed) -> None:
        super().__init__(str(request))
        self.request = request


def _checked_bidi(behavior: Any) -> Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]]:
    """A bidi stream whose request does not parse ends the call with INVALID_ARGUMENT (its handler closed)."""

    async def checked_bidi(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async def parsed() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Malformed):
                    raise _MalformedInStream(request)
                yield request

        try:
            async with contextlib.aclosing(behavior(parsed(), context)) as responses:
                async for response in responses:
                    yield response
        except _MalformedInStream as exc:
            await _refuse(context, exc.request)

    return checked_bidi


def _checked_unary(behavior: Any) -> Callable[[Any, Context], Awaitable[Any]]:
    async def checked_unary(request: Any, context: Context) -> Any:
        if isinstance(request, _Malformed):
            await _refuse(context, request)
        return await behavior(request, context)

    return checked_unary


async def _refuse(context: Context, request: _Malformed) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"malformed request (not a valid protobuf message, or a string field is not UTF-8): "
        f"{type(request.error).__name__}",
    )


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `address`, with TLS when credentials are given; returns the port."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


LIVENESS_SERVICE = "liveness"


async def set_live(servicer: health.aio.HealthServicer) -> None:
    """SERVING for the "liveness" name: the process is up (Kubernetes liveness
    and startup probes ask this one, so a scheduler without executors or an
    executor loading its model is not restarted)."""
    await servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
