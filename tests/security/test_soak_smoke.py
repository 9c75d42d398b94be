"""bench/soak.py runs against a live system and its report holds together."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pagoda.launch.launcher import Launcher

pytestmark = pytest.mark.integration
SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_soak_leaves_the_pool_whole(security_model_dir, tmp_path):
    soak = _load_soak()
    with Launcher(
        str(security_model_dir), dtype="float32", kv_cache_memory="128KiB", log_dir=tmp_path, startup_timeout_s=120
    ) as system:
        pids = {"scheduler": system.scheduler_pid, "executor-0": system.executor_pids[0]}
        args = soak.parse_args(["--duration-s", "6", "--concurrency", "4", "--progress-s", "60"])
        report = soak.run_load(system.target, args, pids)
        assert system.dead_child() is None
    outcomes = report["outcomes"]
    assert report["unexpected"] == [] and report["kv_pool_whole"]
    assert outcomes.get("normal/OK", 0) > 10 and outcomes.get("malformed/INVALID_ARGUMENT", 0) > 0
    assert outcomes.get("cancelled/CANCELLED", 0) > 0
    assert report["requests_total"] == sum(outcomes.values())
    assert report["executors"][0]["num_kv_blocks"] == report["executors"][0]["num_free_kv_blocks"] > 0
    assert all(rss["start"] > 0 and rss["end"] > 0 for rss in report["rss_mib"].values())


def test_rss_of_this_process_is_read_from_proc():
    import os

    soak = _load_soak()
    assert soak.rss_mib(os.getpid()) > 1 and soak.rss_mib(2**22 + 12345) is None
