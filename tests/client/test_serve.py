"""``pagoda serve`` as a real process: ready line, a chat through it, clean stop, fail fast."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.launch.launcher import free_port
from pagoda_client import Client

pytestmark = pytest.mark.integration


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"no {marker!r} in output: {''.join(lines)}")


def _serve(model: Path, port: int, log_dir: Path, flags: str = "") -> list[str]:
    """The command line of ``pagoda serve`` on ``model`` and ``port``, logging into ``log_dir``, plus ``flags``."""
    argv = [sys.executable, "-m", "pagoda_client.cli", "serve", "--model", str(model), "--port", str(port)]
    return [*argv, "--log-dir", str(log_dir), *flags.split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_prints_ready_line_and_stops_children_on_sigint(client_tiny_model_dir, tmp_path):
    port = free_port()
    argv = _serve(client_tiny_model_dir, port, tmp_path, "--executors 2 --dtype float32 --kv-cache-memory 256KiB")
    proc = subprocess.Popen([*argv, "--max-num-seqs", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        output = _read_until(proc, "Press Ctrl-C", 180)
        target = f"127.0.0.1:{port}"
        assert f'pagoda chat "What is the capital of France?" --target {target}' in output
        scheduler_pid = int(re.search(r"scheduler pid (\d+)", output).group(1))
        with Client(target, timeout=30) as client:
            status = client.status()
            assert [e.state for e in status.executors] == ["READY", "READY"]
            assert len(client.generate(token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True).token_ids) == 3
        argv = open(f"/proc/{scheduler_pid}/cmdline").read().split("\0")
        assert "--max-num-seqs" in argv  # unknown flags pass through to the scheduler
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert _gone(scheduler_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_fails_fast_with_the_childs_exit_code(tmp_path):
    start = time.monotonic()
    argv = _serve(tmp_path / "missing", free_port(), tmp_path / "logs")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "executor-0 exited with code" in proc.stderr
    assert time.monotonic() - start < 60


def test_launcher_kill_and_restart_executor(client_tiny_model_dir, tmp_path):
    from pagoda.launch.health import ServingStatus, check_health
    from pagoda.launch.launcher import Launcher

    with Launcher(
        str(client_tiny_model_dir), dtype="float32", kv_cache_memory="256KiB", log_dir=tmp_path, startup_timeout_s=180
    ) as system:
        old_pid = system.executor_pids[0]
        address = system.executor_addresses[0]
        system.kill_executor(0)
        assert system.executor_pids == [0] and _gone(old_pid)
        assert system.dead_child() == ("executor-0", -signal.SIGKILL)
        system.restart_executor(0)
        assert system.executor_pids[0] not in (0, old_pid)
        assert check_health(address) == ServingStatus.SERVING
        assert system.dead_child() is None
        scheduler_pid = system.scheduler_pid
    assert _gone(scheduler_pid)
