"""The OpenAI-compatible HTTP server: aiohttp on the scheduler's event loop.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` → server-sent events), vLLM's POST /tokenize and POST
/detokenize (tokenize.py), vLLM's POST /v1/load_lora_adapter and POST
/v1/unload_lora_adapter (loras.py: adapters, and the `model` field that names
one), GET /health, GET /metrics. Every error
leaves as OpenAI's JSON error shape. A client that goes away cancels its
handler (handler_cancellation), which closes the engine iterator and so
aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagoda.tracing import TRACEPARENT_KEY, parse_traceparent
from scheduler_svc.api.auth import bearer_token, key_is_valid, load_api_keys
from scheduler_svc.api.http import loras
from scheduler_svc.api.http.choices import Choices
from scheduler_svc.api.http.errors import ApiError, from_request_error, server_error, unauthorized, unavailable
from scheduler_svc.api.http.protocol import ParsedRequest, parse_chat, parse_completion, read_json
from scheduler_svc.api.http.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    Json,
    check_output,
    merged_usage,
)
from scheduler_svc.api.http.tokenize import detokenize_reply, parse_detokenize, parse_tokenize, tokenize_reply
from scheduler_svc.errors import RequestError

if TYPE_CHECKING:
    from scheduler_svc.config import SchedulerServiceConfig
    from scheduler_svc.engine import Engine
    from scheduler_svc.obs.metrics import SchedulerMetrics

log = structlog.get_logger("scheduler")

MAX_REQUEST_ID_CHARS = 256
# Routes that stay open when API keys are configured (probes and scrapers carry none).
OPEN_PATHS = ("/health", "/metrics")


def sse(data: Json | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class HttpApi:
    """The HTTP edge over the Engine; `start()` binds config.host:config.http_port."""

    def __init__(self, engine: Engine, config: SchedulerServiceConfig, metrics: SchedulerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.created = int(time.time())
        self.port: int | None = None
        self._keys = load_api_keys(config.api_keys, config.api_keys_file)
        self._runner: web.AppRunner | None = None

    def build_app(self) -> web.Application:
        """The aiohttp application (routes and the error/auth middleware)."""
        app = web.Application(middlewares=[self._middleware], client_max_size=self.config.max_message_bytes)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)  # at the root, where vLLM serves them
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)  # vLLM's admin routes
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    async def start(self) -> None:
        """Listen; a client disconnect cancels its handler."""
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.http_port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("http_api_listening", address=f"{self.config.host}:{self.port}", api_keys=bool(self._keys))

    async def stop(self) -> None:
        """Close the listener and open connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----- middleware ------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            if (
                self._keys
                and request.path not in OPEN_PATHS
                and not key_is_valid(bearer_token(request.headers.get("Authorization")), self._keys)
            ):
                log.warning("unauthenticated_http_call", path=request.path)
                raise unauthorized()
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            message = f"{exc.reason}: {request.method} {request.path}"
            return ApiError(exc.status, message, type=kind, code=str(exc.status)).response()
        except Exception as exc:  # a bug, not the client's fault: still an OpenAI-shaped 500
            log.exception("http_handler_failed", path=request.path)
            return server_error(f"internal error: {type(exc).__name__}").response()

    # ----- routes ----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while an executor accepts work and we are not draining, else 503."""
        serving = self.engine.is_serving
        return web.json_response({"status": "serving" if serving else "not_serving"}, status=200 if serving else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        """The scheduler's Prometheus metrics."""
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def models(self, request: web.Request) -> web.Response:
        """The served model and its LoRA adapters, in OpenAI's list shape (loras.py)."""
        model = self._served_model()
        assert self.engine.limits is not None  # known with the model
        cards = loras.model_cards(model, self.engine.lora_adapters(), self.created, self.engine.limits.max_model_len)
        return web.json_response({"object": "list", "data": cards})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the token ids of a prompt, or of a chat as its template renders it."""
        body = read_json(await request.read())
        parsed = parse_tokenize(body)
        self._lora_of(parsed.model)  # an adapter's name is fine: it shares the base model's tokenizer
        assert self.engine.tokenizer is not None and self.engine.limits is not None  # known with the model
        return web.json_response(tokenize_reply(self.engine.tokenizer, parsed, self.engine.limits.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids."""
        body = read_json(await request.read())
        parsed = parse_detokenize(body)
        self._lora_of(parsed.model)
        assert self.engine.tokenizer is not None and self.engine.limits is not None  # known with the model
        return web.json_response(detokenize_reply(self.engine.tokenizer, parsed, self.engine.limits.max_model_len))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter."""
        body = read_json(await request.read())
        return await loras.load(self.engine, body)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter."""
        body = read_json(await request.read())
        return await loras.unload(self.engine, body)

    # ----- generation ------------------------------------------------------

    def _served_model(self) -> str:
        if self.engine.model is None or self.engine.limits is None or self.engine.tokenizer is None:
            raise unavailable("no executor has connected yet")
        return self.engine.model.model_name

    def _lora_of(self, model: str | None) -> str:
        """The adapter the body's `model` names ("": the base model); a 404 for any other model (a 503 before
        one is served)."""
        return loras.lora_of_model(model, self._served_model(), self.engine.lora_adapters())

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = read_json(await request.read())
        served = self._served_model()
        request_id = _request_id(request)
        parsed = (parse_chat if chat else parse_completion)(body, request_id)
        # W3C trace context (docs/tracing.md); a malformed one is ignored, as the spec says.
        traceparent = parse_traceparent(request.headers.get(TRACEPARENT_KEY, "")) or ""
        lora = self._lora_of(parsed.model)
        parsed = dataclasses.replace(
            parsed, generation=dataclasses.replace(parsed.generation, traceparent=traceparent, lora=lora)
        )
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            log.info("http_request", path=request.path, stream=parsed.stream, user=parsed.user)
            formatter_cls = ChatFormatter if chat else CompletionFormatter
            assert self.engine.tokenizer is not None  # known with the model
            formatters: list[Formatter] = [
                formatter_cls(
                    f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                    lora or served,
                    self.engine.tokenizer,
                    parsed.generation.sampling.get("logprobs"),
                    index,
                    parsed.tools,
                )
                for index in range(parsed.n)
            ]
            return await self._run(request, parsed, formatters, chat)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _run(
        self, request: web.Request, parsed: ParsedRequest, formatters: list[Formatter], chat: bool
    ) -> web.StreamResponse:
        choices = Choices(self.engine, parsed.generation, parsed.n)
        try:
            await choices.open()
            if parsed.stream:
                return await self._stream(request, parsed, formatters, choices)
            collected = await choices.collect()
            bodies = [formatter.choice(outputs) for formatter, outputs in zip(formatters, collected)]
            usage = merged_usage([f.usage for f in formatters if f.usage is not None])
            body = formatters[0].body(bodies, usage)
            return web.json_response(body, headers={"x-request-id": parsed.generation.request_id})
        except RequestError as exc:
            log.info("request_rejected", error=str(exc))
            raise from_request_error(exc, chat=chat, aliases=parsed.param_aliases) from None
        finally:
            await choices.aclose()

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, formatters: list[Formatter], choices: Choices
    ) -> web.StreamResponse:
        for first in choices.firsts:
            check_output(first)  # a request that failed before any token gets a plain error reply
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-request-id": parsed.generation.request_id,
            }
        )
        await response.prepare(request)
        try:
            await self._write_events(response, parsed, formatters, choices)
        except ConnectionError:
            log.info("http_client_disconnected")
            return response
        await response.write_eof()
        return response

    async def _write_events(
        self, response: web.StreamResponse, parsed: ParsedRequest, formatters: list[Formatter], choices: Choices
    ) -> None:
        chat = isinstance(formatters[0], ChatFormatter)
        try:
            for formatter in formatters:
                if isinstance(formatter, ChatFormatter):
                    await response.write(sse(formatter.role_chunk()))
            if len(formatters) == 1:
                formatter = formatters[0]
                first, rest = choices.only()
                for chunk in formatter.chunks(first):
                    await response.write(sse(chunk))
                if not first.finished:
                    async for out in rest:
                        for chunk in formatter.chunks(out):
                            await response.write(sse(chunk))
            else:
                async for index, out in choices.interleave():
                    for chunk in formatters[index].chunks(out):
                        await response.write(sse(chunk))
            if parsed.include_usage:
                usage = merged_usage([f.usage for f in formatters if f.usage is not None])
                await response.write(sse(formatters[0].usage_chunk(usage)))
        except RequestError as exc:
            await response.write(sse(from_request_error(exc, chat=chat, aliases=parsed.param_aliases).body()))
        except ApiError as exc:
            await response.write(sse(exc.body()))
        await response.write(sse("[DONE]"))


def _request_id(request: web.Request) -> str:
    """The client's x-request-id (printable, at most 256 characters), else a new id."""
    given = request.headers.get("x-request-id", "").strip()
    if given and given.isprintable():
        return given[:MAX_REQUEST_ID_CHARS]
    return uuid.uuid4().hex
