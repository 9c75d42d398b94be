"""OpenAI-compatible HTTP API on the scheduler's event loop (see server.py)."""

from __future__ import annotations


async def start_http_api(engine, config, metrics):
    """Start the HTTP server on config.host:config.http_port; returns an object with `async stop()`."""
    from scheduler_svc.http_api.server import HttpApi

    api = HttpApi(engine, config, metrics)
    await api.start()
    return api
