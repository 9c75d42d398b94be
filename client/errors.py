"""The one exception type of the Pagoda client."""

from __future__ import annotations

import grpc


def rpc_status(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a ``grpc.RpcError`` (sync or asyncio)."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    return code or grpc.StatusCode.UNKNOWN, details or ""


class PagodaError(Exception):
    """A failed call: the gRPC status code and the server's message.

    Attributes:
        code: the gRPC status code (e.g. ``grpc.StatusCode.INVALID_ARGUMENT``).
        message: the server's (or the transport's) message.
        request_id: the request id, when the call was a generation.
    """

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, request_id: str | None = None) -> PagodaError:
        """Wrap a ``grpc.RpcError`` (sync or asyncio)."""
        return cls(*rpc_status(error), request_id)

    def __reduce__(self) -> tuple[type[PagodaError], tuple[grpc.StatusCode, str, str | None]]:
        """Keeps the exception picklable (its arguments are not ``str(self)``)."""
        return (type(self), (self.code, self.message, self.request_id))
