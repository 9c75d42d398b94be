"""One process per tier directory: a held directory is refused by name and pid, or the next free one taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from executor_svc.kv.tier.dir_lock import TierDirBusy, lock_tier_dir

HOLD = """
import sys, time
from pathlib import Path
from executor_svc.kv.tier.dir_lock import lock_tier_dir
lock = lock_tier_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_a_held_directory_is_refused_naming_it_and_its_holder(tmp_path):
    first = lock_tier_dir(tmp_path / "tier")
    with pytest.raises(TierDirBusy, match=rf"{tmp_path / 'tier'} is in use by another process \(pid {os.getpid()}\)"):
        lock_tier_dir(tmp_path / "tier")
    first.release()
    lock_tier_dir(tmp_path / "tier").release()


def test_next_free_takes_the_first_directory_nobody_holds(tmp_path):
    held = [lock_tier_dir(tmp_path / "executor-0"), lock_tier_dir(tmp_path / "executor-0.1")]
    lock = lock_tier_dir(tmp_path / "executor-0", next_free=True)
    assert lock.directory == tmp_path / "executor-0.2"
    held[0].release()
    again = lock_tier_dir(tmp_path / "executor-0", next_free=True)
    assert again.directory == tmp_path / "executor-0"


def test_the_kernel_frees_the_directory_of_a_killed_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "tier")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(TierDirBusy, match=f"pid {holder.pid}"):
            lock_tier_dir(tmp_path / "tier")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock_tier_dir(tmp_path / "tier").release()
