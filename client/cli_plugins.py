"""Subcommands of ``pagoda`` that other packages provide, found through the entry-point group ``pagoda.cli``.

A package declares ``[project.entry-points."pagoda.cli"] NAME = "module:plugin"``, where
``plugin`` is a ``CliPlugin``, and ``pagoda NAME ...`` runs it (``pagoda bench`` is one,
from ``pagoda_bench``). The client names no plug-in, so it depends on none of them, and a
plug-in's own dependencies (torch, say) stay out of the client. A plug-in that fails to load
is reported in one line on stderr and left out: the other commands work as before.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TextIO

GROUP = "pagoda.cli"


@dataclass(frozen=True)
class CliPlugin:
    """One subcommand of ``pagoda``; its name is its entry point's."""

    help: str
    """The one line ``pagoda --help`` shows for it."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds its flags to its subparser (the connection flags too, unless ``connection`` is False)."""
    run: Callable[[argparse.Namespace], int]
    """Runs it on the parsed flags; returns the exit code (``PagodaError``, ``ValueError``, ``OSError`` are
    reported as ``pagoda``'s own commands' are)."""
    connection: bool = True
    """Whether it takes the connection flags (--target, --api-key, TLS, --timeout): see ``cli_flags.connection_of``."""


def load_plugins(reserved: Collection[str], err: TextIO | None = None) -> dict[str, CliPlugin]:
    """Every installed plug-in by subcommand name, sorted; each one that cannot be used gets one line on ``err``.

    Args:
        reserved: the built-in commands' names, which a plug-in cannot take.
        err: where to report (default stderr).
    """
    err = sys.stderr if err is None else err
    plugins: dict[str, CliPlugin] = {}
    for entry in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        problem = ""
        if entry.name in reserved or entry.name in plugins:
            problem = "the command exists already"
        else:
            try:
                plugin = entry.load()
            except Exception as exc:  # whatever its import raises, the other commands must still work
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if isinstance(plugin, CliPlugin):
                    plugins[entry.name] = plugin
                    continue
                problem = f"{type(plugin).__name__} is not a pagoda_client.cli_plugins.CliPlugin"
        print(f"pagoda: plug-in {entry.name!r} ({entry.value}) left out: {problem.splitlines()[0]}", file=err)
    return plugins
