"""Service configuration from flags and the environment.

Each service describes its settings as one dataclass; `parse_config` builds an
argparse parser from its fields (help text from `field(metadata={"help": ...})`)
and fills every field from `--flag`, else `PAGODA_<FLAG>`, else the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Parse a byte size such as `1073741824`, `512MiB`, `2GB` into bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 512MiB, 2GB)")
    unit = (match.group(2) or "").upper()
    return int(float(match.group(1)) * _UNITS[unit])


def parse_bool(text: str) -> bool:
    """Parse true/false, 1/0, yes/no, on/off."""
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def flag_name(field_name: str) -> str:
    """`kv_cache_memory` -> `--kv-cache-memory`."""
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """`kv_cache_memory` -> `PAGODA_KV_CACHE_MEMORY`."""
    return "PAGODA_" + field_name.upper()


def _converter(field: dataclasses.Field[Any], hint: Any) -> Callable[[str], Any]:
    parse: Callable[[str], Any] = field.metadata.get("parse", str)
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if "parse" not in field.metadata and base[0] is bool:
        return parse_bool
    if "parse" not in field.metadata and base[0] in (int, float):
        parse = base[0]
    return parse


def build_parser(config_cls: type[DataclassInstance], prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `config_cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if field.metadata.get("internal"):
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        # A boolean flag given alone means true (`--simulate`); it also takes a value (`--simulate false`).
        bare: dict[str, Any] = (
            {"nargs": "?", "const": True} if _converter(field, hints[field.name]) is parse_bool else {}
        )
        parser.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=None,
            type=_converter(field, hints[field.name]),
            **bare,
            metavar=field.name.upper(),
            help=f"{field.metadata.get('help', '')} (env {env_name(field.name)}; default {default!r})",
        )
    return parser


def parse_config(
    config_cls: type[T],
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    environ: typing.Mapping[str, str] | None = None,
) -> T:
    """Fill `config_cls` from argv, then the environment, then the defaults."""
    environ = os.environ if environ is None else environ
    parser = build_parser(config_cls, prog, description)
    args = parser.parse_args(argv)
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config_cls):
        given = getattr(args, field.name, None)
        if given is None and env_name(field.name) in environ:
            try:
                given = _converter(field, hints[field.name])(environ[env_name(field.name)])
            except ValueError as exc:
                parser.error(f"{env_name(field.name)}: {exc}")
        if given is not None:
            values[field.name] = given
    try:
        return config_cls(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
