"""Settings both services have with one meaning: defined here once, a field of each service's config.

``pagoda serve`` passes each of them to every process (both services mark them ``serve``).
"""

from __future__ import annotations

from typing import Any

from pagoda.runtime.flags import setting
from pagoda.tracing import check_otlp_endpoint


def log_format_setting() -> Any:
    """``--log-format``."""
    return setting("auto", "`json`, `console`, `auto` (console on a terminal)", serve=True)


def otlp_endpoint_setting() -> Any:
    """``--otlp-endpoint``: empty, or an http:// or https:// URL (``pagoda.tracing.check_otlp_endpoint``)."""
    return setting(
        "",
        "export traces over OTLP/gRPC to this collector: `http://host:4317` (plaintext) or `https://host:4317` "
        "(TLS); a bare `host:port` is refused, since OTLP reads it as TLS; the standard `OTEL_*` variables also "
        "configure it (docs/tracing.md)",
        serve=True,
        doc_default="none (off)",
        parse=check_otlp_endpoint,
    )
