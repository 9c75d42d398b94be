"""The real command-line flags of `pagoda-executor` and `pagoda-scheduler`.

Taken from the programs' argparse parsers when their config modules exist
(`build_parser()` in the module, or the config dataclass through
`pagoda.runtime.flags.build_parser`), else from the tables of
docs/configuration.md. Every flag `--x-y` has the environment variable
`PAGODA_X_Y`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
PROGRAMS = {"pagoda-executor": "executor_svc.config", "pagoda-scheduler": "scheduler_svc.config"}
_FLAG_RE = re.compile(r"`(--[a-z0-9-]+)`")
_ENV_RE = re.compile(r"`(PAGODA_[A-Z0-9_]+)`|\((PAGODA_[A-Z0-9_]+)[,)]|(PAGODA_[A-Z0-9_]+)")


def env_for_flag(flag: str) -> str:
    """`--kv-cache-memory` -> `PAGODA_KV_CACHE_MEMORY`."""
    return "PAGODA_" + flag.removeprefix("--").replace("-", "_").upper()


def _parser_of(module) -> argparse.ArgumentParser | None:
    if hasattr(module, "build_parser"):
        return module.build_parser()
    config_classes = [
        obj
        for obj in vars(module).values()
        if dataclasses.is_dataclass(obj)
        and isinstance(obj, type)
        and obj.__module__ == module.__name__
        and obj.__name__.endswith("Config")
    ]
    if len(config_classes) != 1:
        return None
    from pagoda.runtime.flags import build_parser

    return build_parser(config_classes[0], module.__name__, "")


def parser_flags(program: str) -> set[str] | None:
    """Long flags of the program's real parser, or None when it does not exist yet."""
    try:
        module = importlib.import_module(PROGRAMS[program])
    except ImportError:
        return None
    parser = _parser_of(module)
    if parser is None:
        return None
    return {
        opt for action in parser._actions for opt in action.option_strings if opt.startswith("--") and opt != "--help"
    }


def _docs_section(program: str) -> str:
    text = DOCS.read_text()
    start = text.index(f"## {program}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def docs_flags(program: str) -> set[str]:
    """Flags named in the first column of the program's table in the docs."""
    flags = set()
    for line in _docs_section(program).splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            flags.update(_FLAG_RE.findall(cells[1]))
    return flags


def program_flags(program: str) -> tuple[set[str], str]:
    """(flags, source): the real parser's flags when available, else the docs'."""
    flags = parser_flags(program)
    if flags:
        return flags, PROGRAMS[program]
    return docs_flags(program), DOCS.name


def documented_extra_envs(program: str) -> set[str]:
    """PAGODA_* variables the docs name for the program that are not a flag's
    variable (e.g. `PAGODA_CACHE_DIR`, `PAGODA_API_KEYS`)."""
    names = {next(g for g in match if g) for match in _ENV_RE.findall(_docs_section(program))}
    flag_envs = {env_for_flag(flag) for flag in docs_flags(program)}
    # The generic PAGODA_<FLAG> of the intro is not a name.
    return {name for name in names if name not in flag_envs and name != "PAGODA_"}
