"""Errors the engine raises for the edges to map onto gRPC / HTTP statuses."""

from __future__ import annotations


class RequestError(Exception):
    """Base: a request that cannot be served, with a message for the client."""


class InvalidRequest(RequestError):
    """Bad input (INVALID_ARGUMENT / HTTP 400). `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(RequestError):
    """The waiting queue is full (RESOURCE_EXHAUSTED / HTTP 429)."""


class Unavailable(RequestError):
    """No executor could take the request in time (UNAVAILABLE / HTTP 503)."""


class ExecutorFailure(RequestError):
    """The executor failed this sequence alone (INTERNAL / HTTP 500)."""


class DeadlineExceeded(RequestError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED / HTTP 504)."""


class NotFound(RequestError):
    """The request names something the server does not have, e.g. a LoRA adapter (NOT_FOUND / HTTP 404)."""


class AlreadyExists(RequestError):
    """A name is taken by something else, e.g. another LoRA adapter (ALREADY_EXISTS / HTTP 409)."""
