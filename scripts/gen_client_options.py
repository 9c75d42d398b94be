"""Render ``client/_param_options.py``: the client's typed options, one per ``pagoda.params`` row.

Usage: python -m scripts.gen_client_options [--check]
(``make proto`` runs it; a test checks the committed file is current.)
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import textwrap
from types import ModuleType

from pagoda import params

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "client" / "_param_options.py"


def _kinds() -> ModuleType:
    """``pagoda_client.core.kinds``, loaded from its file: importing ``pagoda_client``
    needs the generated module, which may be missing or stale when this runs."""
    spec = importlib.util.spec_from_file_location("_client_kinds", ROOT / "client" / "core" / "kinds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up there
    spec.loader.exec_module(module)
    return module


HEADER = '''"""Sampling and stopping parameters as client options: one key per row of ``pagoda.params``.

Generated from the table by ``make proto`` (``python -m scripts.gen_client_options``);
do not edit. ``tests/client/test_options.py`` checks that it is current.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict


class ParamOptions(TypedDict, total=False):
    """Sampling and stopping parameters; a key left out (or None) takes the server's default."""
'''


def render() -> str:
    """The module's text, from the table."""
    kind_of = _kinds().kind_of
    lines = [HEADER.rstrip("\n")]
    for row in params.fields():
        comment = textwrap.wrap(f"{row.group}: {row.spec.help}", width=110)
        lines += [""] + [f"    # {line}" for line in comment]
        lines.append(f"    {row.name}: {kind_of(row).annotation}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    text = render()
    if parser.parse_args().check:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run make proto", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
