"""``pagoda serve`` as a real process: ready line, a chat through it, clean stop, fail fast."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.services import read_until

from pagoda.launch.launcher import free_port
from pagoda_client import Client

pytestmark = pytest.mark.integration


def _serve(model: Path, port: int, log_dir: Path, flags: str = "") -> list[str]:
    """The command line of ``pagoda serve`` on ``model`` and ``port``, logging into ``log_dir``, plus ``flags``
    (its offload tiers under ``log_dir``, not the user's cache)."""
    argv = [sys.executable, "-m", "pagoda_client.cli", "serve", "--model", str(model), "--port", str(port)]
    return [*argv, "--log-dir", str(log_dir), "--kv-offload-dir", str(log_dir / "kv-offload"), *flags.split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _event_time(log_path, event: str) -> str:
    """ISO timestamp of the first JSON log line of ``event`` (they compare in time order)."""
    for line in log_path.read_text().splitlines():
        if f'"event": "{event}"' in line:
            return json.loads(line)["timestamp"]
    raise AssertionError(f"no {event} in {log_path}")


def test_serve_prints_ready_line_and_stops_children_on_sigint(client_tiny_model_dir, tmp_path):
    port = free_port()
    argv = _serve(client_tiny_model_dir, port, tmp_path, "--executors 2 --dtype float32 --kv-cache-memory 256KiB")
    proc = subprocess.Popen([*argv, "--max-num-seqs", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        output = read_until(proc, "Press Ctrl-C", 180)
        target = f"127.0.0.1:{port}"
        assert f'pagoda chat "What is the capital of France?" --target {target}' in output
        scheduler_pid = int(re.search(r"scheduler pid (\d+)", output).group(1))
        with Client(target, timeout=30) as client:
            status = client.status()
            assert [e.state for e in status.executors] == ["READY", "READY"]
            assert len(client.generate(token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True).token_ids) == 3
        executor_pids = [int(pid) for pid in re.findall(r"127\.0\.0\.1:\d+ \(pid (\d+)\)", output)]
        assert len(executor_pids) == 2
        argv = open(f"/proc/{scheduler_pid}/cmdline").read().split("\0")
        assert "--max-num-seqs" in argv  # unknown flags pass through to the scheduler
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert _gone(scheduler_pid) and all(_gone(pid) for pid in executor_pids)
        # Schedulers drain first: the scheduler was gone before any executor began to stop.
        scheduler_stopped = _event_time(tmp_path / "scheduler.log", "scheduler_stopped")
        for name in ("executor-0", "executor-1"):
            assert scheduler_stopped <= _event_time(tmp_path / f"{name}.log", "executor_stopped")
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


def test_serve_stops_on_a_crash_loop_with_the_childs_last_lines(client_tiny_model_dir, tmp_path):
    """The executor is SIGKILLed, and its model is gone, so every restart fails: a crash loop."""
    model = shutil.copytree(client_tiny_model_dir, tmp_path / "model")
    port = free_port()
    command = [sys.executable, "-m", "pagoda_client.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--dtype", "float32", "--kv-cache-memory", "256KiB", "--restart-backoff-s", "0.2"]
    command += ["--kv-offload-dir", str(tmp_path / "kv-offload")]
    # 5 exits, as by default; a window wide enough for 5 starts of a slow, shared machine.
    command += ["--crash-loop-window-s", "300"]
    with open(tmp_path / "serve.err", "w+") as err:  # no --log-dir: the children's output is echoed here
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            output = read_until(proc, "Press Ctrl-C", 180)
            assert "A child that exits is restarted." in output
            scheduler_pid = int(re.search(r"scheduler pid (\d+)", output).group(1))
            executor_pid = int(re.search(r"127\.0\.0\.1:\d+ \(pid (\d+)\)", output).group(1))
            model.rename(tmp_path / "model-gone")
            os.kill(executor_pid, signal.SIGKILL)
            assert proc.wait(timeout=300) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    assert f"child_exited child=executor-0 pid={executor_pid} signal=SIGKILL restart=1 delay_s=0.2" in stderr
    assert "child_exited child=executor-0" in stderr and "restart=4 delay_s=1.6" in stderr
    message = stderr[stderr.index("error: executor-0 is crash-looping") :].splitlines()
    assert message[0].startswith(
        "error: executor-0 is crash-looping: it exited 5 times within 300s (last: exit code 1)"
    )
    # At most the last 20 lines, all that the five runs wrote if fewer: the header counts what is shown.
    num_shown = int(re.fullmatch(r"Last (\d+) log lines of executor-0:", message[1]).group(1))
    assert 1 <= num_shown <= 20
    shown = message[2 : 2 + num_shown]
    assert len(shown) == num_shown and all(line.startswith("  | ") for line in shown)
    assert any("not found" in line for line in shown)  # why it failed: the executor's own error
    assert "[executor-0] " in stderr and "[scheduler] " in stderr  # children's output echoed with their names
    assert _gone(scheduler_pid) and _gone(executor_pid)
