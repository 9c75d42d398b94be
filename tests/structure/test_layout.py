"""The map in the folders: one folder per import name, few modules at a service's top, imports one way."""

from __future__ import annotations

import sys

from support.installed import REPO, setup_script

from structure.import_graph import circles, graph, modules

# A service's top level holds its entry point, config and the pieces every subsystem meets; the rest is in folders
# (the executor's 14: its entry point and config, and a folder per subsystem, executor groups the last).
MAX_TOP_LEVEL_MODULES = 14
# The one folder named otherwise than its import name (documented in docs/architecture.md).
RENAMED = {"pagoda_client": "client"}


def test_no_import_circle_not_even_under_type_checking():
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_check_sees_an_import_inside_a_function_and_under_type_checking():
    edges = graph()
    # pagoda_client.cli imports the launcher only inside functions; the launcher's serve flags the configs likewise.
    assert "pagoda.launch.serve" in edges["pagoda_client.cli"]
    assert "executor_svc.config" in edges["pagoda.launch.serve_flags"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_folder_is_named_as_it_is_imported():
    for name, folder in setup_script().IMPORT_ROOTS.items():
        assert folder.rsplit("/", 1)[-1] == RENAMED.get(name, name), f"{folder} holds {name}"


def test_protos_holds_the_proto_files_only():
    others = [p for p in (REPO / "protos").rglob("*") if p.is_file() and p.suffix != ".proto"]
    assert not others, others


def test_a_service_keeps_few_modules_at_its_top_level():
    for service in ("scheduler_svc", "executor_svc"):
        top = sorted(m for m in modules() if m.count(".") == 1 and m.startswith(f"{service}."))
        assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{service} has {len(top)} top-level modules: {top}"
