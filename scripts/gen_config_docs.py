"""Renders the flag tables of docs/configuration.md from the services' config dataclasses (``make docs``).

Each table sits between a ``<!-- flags: NAME -->`` and an ``<!-- end flags -->``
line; the prose around them is written by hand. ``--check`` exits 1 when the
file differs from what this renders (tests/protocol/test_config_docs.py runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pagoda.launch.serve_flags import serve_flags, service_configs
from pagoda.runtime.flags import flag_rows

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
_TABLE_RE = re.compile(r"(<!-- flags: (?P<name>[\w-]+) -->\n)(.*?)(<!-- end flags -->)", re.DOTALL)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _service_table(service: str) -> str:
    rows = [(f"`{flag}`", default, text) for flag, default, text in flag_rows(service_configs()[service])]
    return _table(("flag", "default", "meaning"), rows)


def _serve_launcher_table() -> str:
    from pagoda.launch.serve import add_serve_arguments

    parser = argparse.ArgumentParser(prog="pagoda serve")
    add_serve_arguments(parser)
    passed = {flag.flag for flag in serve_flags()}
    rows = []
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if flags and flags[0] not in passed:
            default = "none" if action.default in (None, "") else f"`{str(action.default).lower()}`"
            rows.append((f"`{flags[0]}`", default, action.help or ""))
    return _table(("flag", "default", "meaning"), rows)


def _serve_passthrough_table() -> str:
    rows = [(f"`{flag.flag}`", " and ".join(flag.services), flag.help) for flag in serve_flags()]
    return _table(("flag", "passed to", "meaning"), rows)


TABLES = {
    "pagoda-executor": lambda: _service_table("executor"),
    "pagoda-scheduler": lambda: _service_table("scheduler"),
    "pagoda-serve": _serve_launcher_table,
    "pagoda-serve-passthrough": _serve_passthrough_table,
}


def render(text: str) -> str:
    """`text` with every marked table rendered anew."""

    def one(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise SystemExit(f"{DOCS}: unknown table {name!r} (known: {', '.join(TABLES)})")
        return match.group(1) + TABLES[name]() + match.group(4)

    return _TABLE_RE.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the docs differ instead of writing them")
    args = parser.parse_args(argv)
    text = DOCS.read_text()
    rendered = render(text)
    if args.check:
        if rendered != text:
            print(f"{DOCS} is out of date with the config dataclasses: run `make docs`", file=sys.stderr)
            return 1
        return 0
    DOCS.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
