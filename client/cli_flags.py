"""The flags the ``pagoda`` commands share: the connection's, and ``generate``/``chat``'s.

The connection flags (``connection_parser``, read back by ``connection_of``) are every
client command's, the plug-ins' too (``cli_plugins``). Those of ``generate`` and ``chat``
are one per ``pagoda.params`` row, plus the call's own: a row becomes
``--name-with-dashes`` (``Param.cli`` false hides it), typed from its proto type, with
``Param.help`` as help; unset flags are None, so the server's defaults apply.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, TypeVar

from pagoda import params
from pagoda.channel import Tls, TlsConfig
from pagoda.constraint import KINDS
from pagoda_client.client import DEFAULT_TARGET
from pagoda_client.core.kinds import kind_of

T = TypeVar("T")

# The call's own flags (not in the table), as (flag, dest, type, help).
_CALL_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--priority", "priority", int, "lower is served first (default 0)"),
    ("--request-id", "request_id", str, "the request's id (also sent as x-request-id)"),
    ("--cache-salt", "cache_salt", str, "isolates the prefix cache from requests with another salt"),
    ("--lora", "lora", str, "run with this LoRA adapter, by name (pagoda models lists them)"),
    ("--traceparent", "traceparent", str, "W3C trace context to continue (00-<trace id>-<span id>-<flags>)"),
)


def connection_parser() -> argparse.ArgumentParser:
    """A parent parser of the connection flags: target, API key, TLS, deadline, OTLP endpoint."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--target",
        default=os.environ.get("PAGODA_TARGET", DEFAULT_TARGET),
        help="scheduler host:port; several comma-separated (a:50051,b:50051) or a name with several addresses, "
        "over which calls spread and broken streams resume (default $PAGODA_TARGET or %(default)s)",
    )
    group.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"), help="default $PAGODA_API_KEY")
    group.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca)")
    group.add_argument("--tls-ca", help="CA certificate (PEM) of the server")
    group.add_argument("--tls-cert", help="client certificate (PEM), for mTLS")
    group.add_argument("--tls-key", help="client key (PEM), for mTLS")
    group.add_argument("--tls-server-name", help="expected server name in its certificate")
    group.add_argument("--timeout", type=float, default=None, help="deadline of each call in seconds")
    group.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("PAGODA_OTLP_ENDPOINT", ""),
        help="export a client span per generation over OTLP/gRPC, e.g. http://127.0.0.1:4317 "
        "(default $PAGODA_OTLP_ENDPOINT, else the OTEL_* variables; off when none is set)",
    )
    return parser


def connection_of(args: argparse.Namespace) -> dict[str, Any]:
    """Target, API key and TLS settings from the parsed flags."""
    tls: Tls = False
    if args.tls or args.tls_ca or args.tls_cert:
        tls = TlsConfig(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    return {"target": args.target, "api_key": args.api_key, "tls": tls}


def file_text(path: str) -> str:
    """An argparse type: the text of the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None


def list_of(scalar: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type for comma-separated values: ``list_of(int)("1,2, 3") == [1, 2, 3]``."""

    def parse(text: str) -> list[T]:
        try:
            return [scalar(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}") from None

    return parse


def add_param_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per table row with ``cli`` set, then the call's own flags."""
    for row in params.fields():
        if not row.spec.cli:
            continue
        flag, kind = "--" + row.name.replace("_", "-"), kind_of(row)
        if kind.scalar is bool and not kind.repeated:
            group.add_argument(flag, dest=row.name, action="store_true", default=None, help=row.spec.help)
        elif kind.repeated and kind.scalar is str:
            group.add_argument(flag, dest=row.name, action="append", help=row.spec.help + " (repeatable)")
        elif kind.repeated:
            group.add_argument(
                flag, dest=row.name, type=list_of(kind.scalar), help=row.spec.help + " (comma-separated)"
            )
        else:
            group.add_argument(flag, dest=row.name, type=kind.scalar, help=row.spec.help)
    for flag, dest, kind_type, help_text in _CALL_FLAGS:
        group.add_argument(flag, dest=dest, type=kind_type, help=help_text)
    add_structured_flags(group)


def add_structured_flags(group: argparse._ArgumentGroup) -> None:
    """The output constraint: at most one of these flags (the server refuses several)."""
    group.add_argument("--json-schema", type=file_text, metavar="FILE", help="the output matches this JSON schema")
    group.add_argument("--json-object", action="store_true", default=None, help="the output is a JSON object")
    group.add_argument("--regex", metavar="R", help="the whole output matches this regular expression")
    group.add_argument("--grammar", type=file_text, metavar="FILE", help="the output matches this Lark grammar")
    group.add_argument("--choice", type=list_of(str), metavar="A,B,C", help="the output is one of these strings")


def generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options of ``Client.stream`` from the parsed flags (None where not given)."""
    names = [row.name for row in params.fields() if row.spec.cli] + [dest for _, dest, _, _ in _CALL_FLAGS]
    names += list(KINDS)
    return {name: getattr(args, name) for name in names}
