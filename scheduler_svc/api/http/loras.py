"""LoRA adapters on the OpenAI API, in vLLM's shapes: the `model` field, /v1/models, the admin routes.

A request's `model` is the served model's name or absent (the base model), or an adapter's name (that
adapter); anything else is a 404. GET /v1/models lists the base model, then every adapter (`parent`: the base
model, `root`: the adapter's folder). POST /v1/load_lora_adapter `{"lora_name", "lora_path"}` and POST
/v1/unload_lora_adapter `{"lora_name"}` take vLLM's bodies and answer its plain-text success line; API keys
guard them as every route but /health and /metrics (server.py). Their errors: 400 (a bad body or name, an
adapter that does not fit the model: the message says why), 404 (no such folder, or no such adapter), 409
(the name holds another adapter), 503 (no executor to load it on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from pagoda.step import LoraAdapter
from scheduler_svc.api.http.errors import bad_request, from_request_error, model_not_found
from scheduler_svc.api.http.protocol import Fields
from scheduler_svc.errors import RequestError

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine

log = structlog.get_logger("scheduler")

Json = dict[str, Any]


def lora_of_model(model: str | None, served: str, adapters: Sequence[LoraAdapter]) -> str:
    """The adapter a request's `model` names ("": the base model); a 404 naming what is served otherwise."""
    if not model or model == served:
        return ""
    if any(adapter.name == model for adapter in adapters):
        return model
    raise model_not_found(model, served, [adapter.name for adapter in adapters])


def model_cards(served: str, adapters: Sequence[LoraAdapter], created: int, max_model_len: int) -> list[Json]:
    """/v1/models' `data`: the base model's card, then one per adapter, as vLLM lists them."""

    def card(model_id: str, root: str, parent: str | None) -> Json:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "pagoda",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
        }

    return [card(served, served, None), *(card(a.name, a.path, served) for a in adapters)]


def _string(f: Fields, name: str) -> str:
    value: str | None = f.get(name, "str")
    if not value:
        raise bad_request(name, "required (a non-empty string)")
    return value


async def load(engine: Engine, body: Json) -> web.Response:
    """POST /v1/load_lora_adapter: the adapter registered on every executor (the same name and folder again:
    a success that changes nothing)."""
    f = Fields(body)
    name, path = _string(f, "lora_name"), _string(f, "lora_path")
    try:
        await engine.load_lora(name, path)
    except RequestError as exc:
        log.info("lora_load_refused", name=name, error=str(exc))
        raise from_request_error(exc, chat=False) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload(engine: Engine, body: Json) -> web.Response:
    """POST /v1/unload_lora_adapter: new requests naming it get a 404; those running with it finish."""
    name = _string(Fields(body), "lora_name")
    try:
        await engine.unload_lora(name)
    except RequestError as exc:
        log.info("lora_unload_refused", name=name, error=str(exc))
        raise from_request_error(exc, chat=False) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
