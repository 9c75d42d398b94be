"""docs/configuration.md's flag tables are rendered from the config dataclasses: a change to one shows in both."""

from __future__ import annotations

import re
from pathlib import Path

from scripts import gen_config_docs

REPO = Path(__file__).resolve().parents[2]


def test_the_flag_tables_are_current():
    text = gen_config_docs.DOCS.read_text()
    assert gen_config_docs.render(text) == text, "docs/configuration.md is out of date: run `make docs`"


def test_every_table_is_rendered():
    names = re.findall(r"<!-- flags: ([\w-]+) -->", gen_config_docs.DOCS.read_text())
    assert sorted(names) == sorted(gen_config_docs.TABLES)


def test_a_changed_help_text_changes_the_docs(monkeypatch):
    from pagoda.runtime import flags

    real_rows = flags.flag_rows

    def edited(config_cls):
        return [(f, d, "EDITED" if f == "--port" else h) for f, d, h in real_rows(config_cls)]

    monkeypatch.setattr(gen_config_docs, "flag_rows", edited)
    rendered = gen_config_docs.render(gen_config_docs.DOCS.read_text())
    assert "| `--port` | `50061` | EDITED |" in rendered
