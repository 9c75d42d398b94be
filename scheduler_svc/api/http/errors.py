"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Engine errors (scheduler_svc.errors) are mapped here, so handlers only raise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from scheduler_svc.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    RequestError,
    Unavailable,
)

# Engine field names (gRPC vocabulary) → OpenAI parameter names, after "sampling."/"stopping." is cut.
_PARAM_OF_FIELD = {
    "input": "prompt",
    "text": "prompt",
    "token_ids": "prompt",
    "chat": "messages",
    "request_id": "x-request-id",
}
_INDEX = re.compile(r"\[\d+\]")


class ApiError(Exception):
    """A request the HTTP API refuses, with everything its JSON body needs."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        """A JSON response with this error's status."""
        return web.json_response(self.body(), status=self.status, dumps=json.dumps)


def bad_request(param: str | None, message: str) -> ApiError:
    """A 400 for one parameter; the message names it."""
    text = f"{param}: {message}" if param else message
    return ApiError(400, text, param=param, code="invalid_value" if param else None)


def openai_param(field: str, *, chat: bool, aliases: dict[str, str] | None = None) -> str:
    """The OpenAI parameter an engine field came from (e.g. sampling.top_p → top_p)."""
    name = field.split(".", 1)[1] if field.startswith(("sampling.", "stopping.")) else field
    name = _INDEX.sub("", name)
    if name.startswith("chat"):
        return "messages"
    name = _PARAM_OF_FIELD.get(name, name)
    if name == "prompt" and chat:
        return "messages"
    return (aliases or {}).get(name, name)


def from_request_error(exc: RequestError, *, chat: bool, aliases: dict[str, str] | None = None) -> ApiError:
    """The HTTP error for an engine error."""
    if isinstance(exc, InvalidRequest):
        param = openai_param(exc.field, chat=chat, aliases=aliases)
        detail = str(exc)[len(exc.field) + 2 :]
        return bad_request(param, detail)
    if isinstance(exc, Overloaded):
        return ApiError(429, f"server overloaded: {exc}", type="rate_limit_error", code="queue_full")
    if isinstance(exc, Unavailable):
        return unavailable(str(exc))
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, str(exc), type="timeout_error", code="deadline_exceeded")
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), type="not_found_error", code="not_found")
    if isinstance(exc, AlreadyExists):
        return ApiError(409, str(exc), type="conflict_error", code="already_exists")
    return server_error(str(exc))  # ExecutorFailure, and any other


def unavailable(message: str) -> ApiError:
    """503: no executor can serve (none connected yet, or shutting down)."""
    return ApiError(503, message, type="service_unavailable_error", code="unavailable")


def server_error(message: str) -> ApiError:
    """500: the request failed inside the system."""
    return ApiError(500, message, type="server_error", code="internal_error")


def unauthorized() -> ApiError:
    """401: API keys are configured and the request carries no valid one."""
    return ApiError(
        401,
        "missing or invalid API key (send 'Authorization: Bearer <key>')",
        type="authentication_error",
        code="invalid_api_key",
    )


def model_not_found(model: str, served: str, adapters: Sequence[str] = ()) -> ApiError:
    """404 as OpenAI answers an unknown model; the message names what is served (the base model, its adapters)."""
    loras = f" and the LoRA adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
    return ApiError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'{loras}",
        param="model",
        code="model_not_found",
    )
