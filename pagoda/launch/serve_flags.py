"""The service flags ``pagoda serve`` passes through: each defined once, in its service's config dataclass.

A config field made with ``setting(..., serve=True)`` becomes a ``pagoda serve``
flag with the same name, help and check; its value goes, as given, to every
process of that service (to both when both configs mark a field of that name,
as ``--otlp-endpoint``). The launcher's own flags (how many processes, ports,
supervision) live in ``pagoda.launch.serve``. Flags ``pagoda serve`` does not
know still go to the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from pagoda.runtime.flags import argparse_type, bare_flag_options, converter, flag_name

# Fields the launcher itself hands to its children (``--model``: the Launcher's model argument).
LAUNCHER_HANDLED = ("model",)


@dataclasses.dataclass(frozen=True)
class ServeFlag:
    """One passed-through flag.

    Attributes:
        name: the config field (``otlp_endpoint``).
        services: who gets it: ``executor``, ``scheduler`` or both.
        help: the field's help text.
        check: the field's converter, run on the given text (its value is passed as given).
    """

    name: str
    services: tuple[str, ...]
    help: str
    check: Callable[[str], Any]
    # The flag may be given several times (``setting(repeat=True)``).
    repeat: bool = False

    @property
    def flag(self) -> str:
        return flag_name(self.name)


def service_configs() -> dict[str, type[Any]]:
    """Each service's config dataclass, by service (imported here: they import only the shared modules)."""
    from executor_svc.config import ExecutorConfig
    from scheduler_svc.config import SchedulerServiceConfig

    return {"executor": ExecutorConfig, "scheduler": SchedulerServiceConfig}


def serve_flags() -> list[ServeFlag]:
    """Every field marked ``serve`` in a service's config, merged by name, in the configs' order."""
    found: dict[str, ServeFlag] = {}
    for service, config_cls in service_configs().items():
        for field in dataclasses.fields(config_cls):
            if not field.metadata.get("serve"):
                continue
            seen = found.get(field.name)
            if seen is None:
                found[field.name] = ServeFlag(
                    field.name,
                    (service,),
                    field.metadata["help"],
                    converter(config_cls, field),
                    bool(field.metadata.get("repeat")),
                )
            else:
                found[field.name] = dataclasses.replace(seen, services=(*seen.services, service))
    return list(found.values())


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServeFlag``, in a group per audience; each value is checked and kept as given."""
    groups: dict[tuple[str, ...], Any] = {}
    for flag in serve_flags():
        if flag.services not in groups:
            groups[flag.services] = parser.add_argument_group(f"passed to every {' and '.join(flag.services)}")
        groups[flag.services].add_argument(
            flag.flag,
            dest=flag.name,
            default=None,
            type=argparse_type(_as_given(flag.check)),
            metavar=flag.name.upper(),
            help=flag.help.replace("%", "%%"),
            **({"action": "append"} if flag.repeat else {}),
            **bare_flag_options(flag.check),
        )


def passthrough(args: argparse.Namespace, service: str) -> list[str]:
    """``--flag value`` for each serve flag of `service` the command line gave (``--flag true`` for a bare one)."""
    argv: list[str] = []
    for flag in serve_flags():
        value = getattr(args, flag.name, None)
        if service in flag.services and value is not None and flag.name not in LAUNCHER_HANDLED:
            for each in value if flag.repeat else [value]:
                argv += [flag.flag, "true" if each is True else str(each)]
    return argv


def _as_given(check: Callable[[str], Any]) -> Callable[[str], str]:
    """The text itself, once `check` accepts it: children parse it again, as their own flag."""

    def as_given(text: str) -> str:
        check(text)
        return text

    as_given.__name__ = getattr(check, "__name__", "value")
    return as_given
