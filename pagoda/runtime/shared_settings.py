"""Settings both services have with one meaning: defined here once, a field of each service's config.

``pagoda serve`` passes each of them to every process (both services mark them ``serve``), but ``--lora``
to the executors only.
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


def parse_lora_spec(text: str) -> str:
    """A ``--lora`` value, ``NAME=PATH`` with both parts set; kept as given."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora takes NAME=PATH (a PEFT adapter folder), not {text!r}")
    return text


def lora_specs(specs: tuple[str, ...]) -> dict[str, str]:
    """``--lora`` values as name -> path.

    Raises:
        ValueError: a name given twice.
    """
    pairs = [spec.partition("=")[::2] for spec in specs]
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):
        raise ValueError(f"--lora: a name given twice in {list(specs)}")
    return dict(pairs)


def lora_setting(help: str, serve: bool) -> Any:
    """``--lora NAME=PATH``, repeatable: LoRA adapters to register at start (docs/lora.md)."""
    return setting((), help, serve=serve, repeat=True, parse=parse_lora_spec)
