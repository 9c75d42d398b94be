"""`pagoda-scheduler`: the client API, batching, and KV block accounting."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Sequence

import grpc
import structlog

from pagoda.runtime import grpc_server
from pagoda.runtime.logs import configure_logging, run_logged
from pagoda.tracing import setup_tracing, shutdown_tracing
from pagoda.v1 import generation_pb2, generation_pb2_grpc
from scheduler_svc.api.auth import build_interceptors
from scheduler_svc.api.http import start_http_api
from scheduler_svc.api.servicer import GenerationServicer
from scheduler_svc.config import SchedulerServiceConfig, load_config
from scheduler_svc.engine import Engine
from scheduler_svc.obs.metrics import SchedulerMetrics
from scheduler_svc.obs.request_trace import RequestTracer

log = structlog.get_logger("scheduler")
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def serve(config: SchedulerServiceConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain."""
    metrics = SchedulerMetrics()
    executor_creds = grpc_server.channel_credentials(
        config.executor_tls_ca, config.executor_tls_cert, config.executor_tls_key
    )
    tracer = setup_tracing("pagoda-scheduler", config.otlp_endpoint, log=log)
    engine = Engine(config, metrics, executor_creds, RequestTracer(tracer) if tracer is not None else None)
    options = [*grpc_server.KEEPALIVE_OPTIONS, *grpc_server.message_size_options(config.max_message_bytes)]
    server = grpc.aio.server(options=options, interceptors=build_interceptors(config.api_keys, config.api_keys_file))
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, config.max_message_bytes), server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    await grpc_server.set_serving(health, [SERVICE_NAME], False)
    await grpc_server.set_live(health)
    loop = asyncio.get_running_loop()
    health_updates: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references

    def on_health_change(serving: bool) -> None:
        task = loop.create_task(grpc_server.set_serving(health, [SERVICE_NAME], serving))
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    engine.on_health_change = on_health_change
    credentials = grpc_server.server_credentials(config.tls_cert, config.tls_key)
    port = grpc_server.add_port(server, f"{config.host}:{config.port}", credentials)
    await server.start()
    if config.metrics_port:
        metrics.serve(config.host, config.metrics_port)
    await engine.start(config.scheduler_id or f"{socket.gethostname()}:{port}")
    http_api = await start_http_api(engine, config, metrics) if config.http_port else None
    log.info(
        "scheduler_listening",
        address=f"{config.host}:{port}",
        scheduler_id=engine.scheduler_id,
        executors=config.executors,
        tls=credentials is not None,
        tracing=engine.tracer is not None,
        event_loop=config.event_loop,
    )

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler_draining", timeout_s=config.drain_timeout_s)
    await engine.drain(config.drain_timeout_s)
    await server.stop(grace=1.0)
    if http_api is not None:
        await http_api.stop()
    await engine.stop()
    shutdown_tracing()
    log.info("scheduler_stopped")


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    config = load_config(argv)
    configure_logging(config.log_format)
    run_logged(serve(config), log, "scheduler_failed", config.event_loop)


if __name__ == "__main__":
    main()
