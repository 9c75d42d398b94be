"""OpenAI-compatible HTTP API on the scheduler's event loop (see server.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.api.http.server import HttpApi
    from scheduler_svc.config import SchedulerServiceConfig
    from scheduler_svc.engine import Engine
    from scheduler_svc.obs.metrics import SchedulerMetrics


async def start_http_api(engine: Engine, config: SchedulerServiceConfig, metrics: SchedulerMetrics) -> HttpApi:
    """Start the HTTP server on config.host:config.http_port; returns it (``await api.stop()`` ends it)."""
    # Imported here: aiohttp loads only when the HTTP API is on.
    from scheduler_svc.api.http.server import HttpApi

    api = HttpApi(engine, config, metrics)
    await api.start()
    return api
