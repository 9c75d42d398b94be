"""The supervisor over real (tiny) processes, ticked by hand with a fake clock.

The children are short Python commands, killed from outside with ``os.kill``;
only time is faked, so backoff and crash loops take no wall-clock seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest

from pagoda.launch.child import Child
from pagoda.launch.restart_policy import RestartPolicy
from pagoda.launch.supervisor import Supervisor

CRASH = [sys.executable, "-c", "import sys; [print('line', i) for i in range(30)]; print('boom'); sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _started(name: str, argv: list[str], tmp_path=None) -> Child:
    child = Child(name, argv, "127.0.0.1:1", log_dir=tmp_path)
    child.spawn()
    return child


def _wait_exit(child: Child) -> int:
    return child.process.wait(timeout=30)


def _events(caplog, event: str) -> list[dict]:
    return [r.fields for r in caplog.records if getattr(r, "event", None) == event]


@pytest.fixture
def children():
    started: list[Child] = []
    yield started
    for child in started:
        child.signal(signal.SIGKILL)
        child.reap(5)
        child.join_output()


def test_exit_is_logged_and_restarted_after_the_backoff(children, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.launch")
    clock = FakeClock()
    child = _started("crasher", CRASH)
    children.append(child)
    supervisor = Supervisor([child], policy=RestartPolicy(), is_healthy=lambda c: False, clock=clock)
    first_pid = child.process.pid
    assert _wait_exit(child) == 3
    supervisor.tick()
    assert _events(caplog, "child_exited") == [
        {"child": "crasher", "pid": first_pid, "exit_code": 3, "restart": 1, "delay_s": "1"}
    ]
    clock.now += 0.9
    supervisor.tick()
    assert child.process.pid == first_pid  # not due yet
    clock.now += 0.1
    supervisor.tick()
    assert child.process.pid != first_pid and child.num_restarts == 1
    assert _events(caplog, "child_restarted") == [{"child": "crasher", "pid": child.process.pid, "restart": 1}]
    assert _wait_exit(child) == 3
    supervisor.tick()
    assert _events(caplog, "child_exited")[-1]["delay_s"] == "2"  # doubled


def test_sigkill_from_outside_names_the_signal_and_health_is_watched(children, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.launch")
    clock = FakeClock()
    healthy = {"answer": True}
    child = _started("sleeper", SLEEP)
    children.append(child)
    supervisor = Supervisor([child], policy=RestartPolicy(), is_healthy=lambda c: healthy["answer"], clock=clock)
    supervisor.tick()  # first healthy answer at t=1000
    old_pid = child.pid
    os.kill(old_pid, signal.SIGKILL)
    _wait_exit(child)
    clock.now += 61  # healthy for a minute: the backoff starts over
    supervisor.tick()
    assert _events(caplog, "child_exited")[-1] == {
        "child": "sleeper",
        "pid": old_pid,
        "signal": "SIGKILL",
        "restart": 1,
        "delay_s": "1",
    }
    healthy["answer"] = False
    clock.now += 1
    supervisor.tick()
    assert child.pid not in (0, old_pid)
    supervisor.tick()
    assert _events(caplog, "child_serving") == []  # not healthy yet
    healthy["answer"] = True
    supervisor.tick()
    assert _events(caplog, "child_serving") == [{"child": "sleeper", "pid": child.pid, "restart": 1}]


def test_crash_loop_gives_up_with_the_childs_last_lines(children, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.launch")
    clock = FakeClock()
    child = _started("executor-7", CRASH, tmp_path)
    children.append(child)
    supervisor = Supervisor([child], policy=RestartPolicy(), is_healthy=lambda c: False, clock=clock)
    for _ in range(4):
        _wait_exit(child)
        supervisor.tick()  # exit seen
        clock.now += 10
        supervisor.tick()  # restarted (delays 1, 2, 4, 8 are all due after 10 s)
    _wait_exit(child)
    supervisor.tick()
    assert supervisor.failed.is_set() and supervisor.crash_loop is not None
    assert child.num_restarts == 4
    message = supervisor.crash_loop.message()
    assert message.startswith("executor-7 is crash-looping: it exited 5 times within 60s (last: exit code 3)")
    shown = message.splitlines()[2:]
    assert len(shown) == 20 and shown[-1] == "  | boom" and shown[0] == "  | line 11"
    assert _events(caplog, "child_crash_loop") == [{"child": "executor-7", "exits": 5, "window_s": "60"}]
    assert (tmp_path / "executor-7.log").read_text().count("boom") == 5  # every run's output kept in its file
    clock.now += 100
    supervisor.tick()
    assert child.poll() == 3  # nothing restarted after giving up


def test_unwatched_child_stays_down_and_watch_resumes(children):
    clock = FakeClock()
    child = _started("executor-0", SLEEP)
    children.append(child)
    supervisor = Supervisor([child], policy=RestartPolicy(), is_healthy=lambda c: True, clock=clock)
    supervisor.unwatch(child)
    child.signal(signal.SIGKILL)
    _wait_exit(child)
    clock.now += 100
    supervisor.tick()
    assert child.pid == 0
    child.spawn()
    supervisor.watch(child)
    os.kill(child.pid, signal.SIGKILL)
    _wait_exit(child)
    supervisor.tick()
    clock.now += 1
    supervisor.tick()
    assert child.pid != 0 and child.num_restarts == 1


def test_thread_restarts_in_real_time_and_stop_ends_it(children):
    child = _started("sleeper", SLEEP)
    children.append(child)
    policy = RestartPolicy(initial_backoff_s=0.1)
    supervisor = Supervisor([child], policy=policy, is_healthy=lambda c: True, poll_interval_s=0.05)
    supervisor.start()
    try:
        old_pid = child.pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while child.pid in (0, old_pid):
            assert time.monotonic() < deadline, "not restarted within 20 s"
            time.sleep(0.05)
        assert supervisor.running
    finally:
        supervisor.stop()
    assert not supervisor.running
    pid = child.pid
    os.kill(pid, signal.SIGKILL)
    _wait_exit(child)
    time.sleep(0.3)
    assert child.pid == 0  # stopped supervisors restart nothing


def test_a_start_by_hand_cancels_a_pending_restart(children):
    """``Launcher.restart`` of a child the supervisor was about to restart: one process, not two."""
    clock = FakeClock()
    child = _started("executor-0", SLEEP)
    children.append(child)
    supervisor = Supervisor([child], policy=RestartPolicy(), is_healthy=lambda c: True, clock=clock)
    os.kill(child.pid, signal.SIGKILL)
    _wait_exit(child)
    supervisor.tick()  # exit seen, restart due in 1 s
    supervisor.unwatch(child)
    child.spawn()
    supervisor.watch(child)
    by_hand = child.pid
    clock.now += 5
    supervisor.tick()
    assert child.pid == by_hand and child.num_restarts == 0
