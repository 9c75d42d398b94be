"""scheduler_svc and pagoda import no torch and no numpy: every module, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

CODE = """
import importlib, json, pkgutil, sys
import pagoda, scheduler_svc
packages = (scheduler_svc, pagoda)
names = sorted(m.name for p in packages for m in pkgutil.walk_packages(p.__path__, p.__name__ + "."))
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
print(json.dumps({"modules": names, "heavy": heavy}))
"""

CORE = (
    "scheduler_svc.kv.block_pool",
    "scheduler_svc.kv.kv_cache_manager",
    "scheduler_svc.core.request_queue",
    "scheduler_svc.core.scheduler",
    "scheduler_svc.core.roster",
    "scheduler_svc.core.inflight",
    "scheduler_svc.core.sequence",
    "pagoda.params",
    "pagoda.step",
)


def test_importing_every_scheduler_module_loads_neither_torch_nor_numpy():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(CORE) <= set(report["modules"])
    assert report["heavy"] == []


def test_the_scheduler_core_imports_no_grpc_and_no_protos():
    """The core speaks pagoda.step and pagoda.params (plain dataclasses), never pagoda.v1's protos."""
    code = (
        "import json, sys\n"
        f"import {', '.join(CORE)}\n"
        "wire = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google') or m.startswith('pagoda.v1'))\n"
        "print(json.dumps({'wire': wire, 'step': 'pagoda.step' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"wire": [], "step": True}
