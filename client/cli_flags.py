"""The flags of ``pagoda generate``/``chat``: one per ``pagoda.params`` row, plus the call's own.

A row becomes ``--name-with-dashes`` (``Param.cli`` false hides it), typed
from its proto type, with ``Param.help`` as help; unset flags are None, so the
server's defaults apply.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from pagoda import params
from pagoda.constraint import KINDS
from pagoda_client.core.kinds import kind_of

T = TypeVar("T")

# The call's own flags (not in the table), as (flag, dest, type, help).
_CALL_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--priority", "priority", int, "lower is served first (default 0)"),
    ("--request-id", "request_id", str, "the request's id (also sent as x-request-id)"),
    ("--cache-salt", "cache_salt", str, "isolates the prefix cache from requests with another salt"),
    ("--traceparent", "traceparent", str, "W3C trace context to continue (00-<trace id>-<span id>-<flags>)"),
)


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
