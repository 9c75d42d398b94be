"""The docs name only what exists: every link, and every path of the repository they cite, is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A path of this repository as the docs cite it: a top-level folder, then more parts (`executor_svc/models/rope.py`,
# `k8s/overlays/cpu/`), maybe followed by `:function`. Placeholders (`<i>`) and globs are left out.
TOP = "protos|scheduler_svc|executor_svc|client|tests|k8s|docker|bench|scripts|docs|pagoda|\\.ci"
_PATH_RE = re.compile(rf"(?<![\w./~-])((?:{TOP})/[\w./-]*[\w/])")
_LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING_RE = re.compile(r"^#+\s+(.*)$", re.MULTILINE)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(doc: Path) -> set[str]:
    return {_slug(heading) for heading in _HEADING_RE.findall(doc.read_text())}


def _cited_paths(text: str) -> set[str]:
    return {m.group(1).rstrip(".") for m in _PATH_RE.finditer(text)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cited_path_exists(doc):
    missing = sorted(p for p in _cited_paths(doc.read_text()) if not (REPO / p).exists())
    assert not missing, f"{doc.name} cites paths that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_resolves(doc):
    broken = []
    for target in _LINK_RE.findall(doc.read_text()):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{doc.name} has links to nothing: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_docs_stand_alone(doc):
    """They cite the repository's own files, never a design card outside it."""
    text = doc.read_text()
    assert "DESIGN.md" not in text and "../shared" not in text


def test_the_path_check_catches_a_missing_file():
    assert _cited_paths("see `executor_svc/models/rope.py` and scheduler_svc/nothing_here.py.") == {
        "executor_svc/models/rope.py",
        "scheduler_svc/nothing_here.py",
    }
    assert _slug("Model families") == "model-families" and _slug("`pagoda serve` (local)") == "pagoda-serve-local"
