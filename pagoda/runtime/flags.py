"""Service configuration from flags and the environment.

Each service describes its settings as one dataclass whose fields are made by
`setting` (default, help text, and how the flag is offered). From that one
definition: `parse_config` builds the service's argparse parser and fills every
field from `--flag`, else `PAGODA_<FLAG>`, else the default; `pagoda serve`
offers the fields marked `serve` (`pagoda.launch.serve_flags`); and
docs/configuration.md renders its tables from `flag_rows` (`make docs`, checked
by a test).
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


def setting(
    default: Any,
    help: str,
    *,
    serve: bool = False,
    doc_default: str | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
) -> Any:
    """A config field: its default and help text (the flag's ``--help`` and its docs row).

    Args:
        serve: ``pagoda serve`` offers the flag and passes it to every process of this service.
        doc_default: the default as the docs say it, when the value alone does not (``"model's"``).
        parse: converts the flag's text (default: by the field's type).
        repeat: the flag may be given several times (a tuple of ``parse``'s values, the default ``()``);
            its environment variable holds them comma-separated.
    """
    metadata: dict[str, Any] = {"help": help, "serve": serve, "repeat": repeat}
    if doc_default is not None:
        metadata["doc_default"] = doc_default
    if parse is not None:
        metadata["parse"] = parse
    return dataclasses.field(default=default, metadata=metadata)


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


def format_size(size: int) -> str:
    """`10737418240` -> `10GiB`: the largest binary unit that divides it."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def converter(config_cls: type[DataclassInstance], field: dataclasses.Field[Any]) -> Callable[[str], Any]:
    """How the text of `field`'s flag (or environment variable) becomes its value."""
    return _converter(field, typing.get_type_hints(config_cls)[field.name])


def _converter(field: dataclasses.Field[Any], hint: Any) -> Callable[[str], Any]:
    parse: Callable[[str], Any] = field.metadata.get("parse", str)
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if "parse" not in field.metadata and base[0] is bool:
        return parse_bool
    if "parse" not in field.metadata and base[0] in (int, float):
        parse = base[0]
    return parse


def argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert` for argparse: its ValueError's message reaches the user (argparse would print only its name)."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def repeat_options(field: dataclasses.Field[Any]) -> dict[str, Any]:
    """A repeatable flag (``setting(repeat=True)``) collects every value it is given."""
    return {"action": "append"} if field.metadata.get("repeat") else {}


def bare_flag_options(convert: Callable[[str], Any]) -> dict[str, Any]:
    """A boolean flag given alone means true (`--simulate`); it also takes a value (`--simulate false`)."""
    return {"nargs": "?", "const": True} if convert is parse_bool else {}


def default_text(field: dataclasses.Field[Any]) -> str:
    """The default of `field` as the docs say it."""
    if "doc_default" in field.metadata:
        return str(field.metadata["doc_default"])
    value = field.default
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if field.metadata.get("parse") is parse_size and isinstance(value, int):
        return f"`{format_size(value)}`"
    return f"`{value}`"


def flag_rows(config_cls: type[DataclassInstance]) -> list[tuple[str, str, str]]:
    """(flag, default, help) of each field of `config_cls`, in order: the rows of its docs table."""
    return [
        (flag_name(field.name), default_text(field), str(field.metadata.get("help", "")))
        for field in dataclasses.fields(config_cls)
    ]


def build_parser(config_cls: type[DataclassInstance], prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `config_cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        default = field.default if field.default is not dataclasses.MISSING else None
        convert = _converter(field, hints[field.name])
        parser.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=None,
            type=argparse_type(convert),
            **repeat_options(field),
            **bare_flag_options(convert),
            metavar=field.name.upper(),
            help=f"{_escaped(field.metadata.get('help', ''))} (env {env_name(field.name)}; default {default!r})",
        )
    return parser


def _escaped(text: object) -> str:
    """`text` for argparse, which formats help with %."""
    return str(text).replace("%", "%%")


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
            text = environ[env_name(field.name)]
            convert = _converter(field, hints[field.name])
            try:
                repeated = field.metadata.get("repeat")
                given = [convert(item) for item in text.split(",") if item] if repeated else convert(text)
            except ValueError as exc:
                parser.error(f"{env_name(field.name)}: {exc}")
        if given is not None:
            values[field.name] = tuple(given) if isinstance(given, list) else given
    try:
        return config_cls(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
