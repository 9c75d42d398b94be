"""structlog setup shared by both services: JSON lines in production, a
readable console format on a terminal; `request_id` travels in contextvars."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

import structlog

from pagoda.tracing import add_trace_id


def configure_logging(log_format: str = "auto", level: str = "INFO") -> None:
    """Configure structlog and the stdlib root logger.

    Args:
        log_format: "json", "console", or "auto" (console when stderr is a tty).
        level: log level name.
    """
    use_console = log_format == "console" or (log_format == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    numeric_level = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if not use_console else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        # One write per line (message and newline together): print() writes them apart, and under
        # PYTHONUNBUFFERED (the images set it) processes sharing a log (an executor group's ranks) interleaved
        # them, two JSON objects on one line (5,206 of 40,000 lines from two writers; none this way).
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")


EVENT_LOOPS = ("uvloop", "asyncio")


def run_logged(main: Coroutine[Any, Any, None], log: Any, failed_event: str, event_loop: str = "asyncio") -> None:
    """Runs a service's main coroutine on `event_loop` (uvloop: libuv's loop, the I/O paths in C); an exception
    ends the process with status 1 after one log line."""
    try:
        if event_loop == "uvloop":
            import uvloop

            uvloop.run(main)
        else:
            asyncio.run(main)
    except Exception:
        log.exception(failed_event)
        sys.exit(1)
