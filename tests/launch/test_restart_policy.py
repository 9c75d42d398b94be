"""The restart rules with plain numbers for time: backoff, its cap, the healthy-minute reset, crash loops."""

from __future__ import annotations

import pytest

from pagoda.launch.restart_policy import RestartPolicy, RestartTracker

NO_CRASH_LOOP = RestartPolicy(crash_loop_exits=1000)


def _delays(tracker: RestartTracker, exit_times: list[float]) -> list[float]:
    return [tracker.exited(t).delay_s for t in exit_times]


def test_backoff_doubles_from_one_second_and_caps_at_thirty():
    tracker = RestartTracker(NO_CRASH_LOOP)
    assert _delays(tracker, [100.0 * i for i in range(8)]) == [1, 2, 4, 8, 16, 30, 30, 30]
    assert tracker.num_restarts == 8


def test_restart_numbers_count_every_restart():
    tracker = RestartTracker(NO_CRASH_LOOP)
    assert [tracker.exited(t).restart_number for t in (0.0, 10.0, 20.0)] == [1, 2, 3]


def test_a_healthy_minute_resets_the_backoff():
    tracker = RestartTracker(NO_CRASH_LOOP)
    assert _delays(tracker, [0.0, 10.0, 20.0]) == [1, 2, 4]
    tracker.healthy(30.0)
    tracker.healthy(80.0)  # still the same run: the first healthy answer counts
    assert tracker.exited(90.0).delay_s == 1  # healthy from 30 to 90: a minute
    assert tracker.exited(100.0).delay_s == 2


def test_less_than_a_healthy_minute_keeps_the_backoff_growing():
    tracker = RestartTracker(NO_CRASH_LOOP)
    assert _delays(tracker, [0.0, 10.0]) == [1, 2]
    tracker.healthy(20.0)
    assert tracker.exited(79.9).delay_s == 4
    tracker.healthy(200.0)  # healthy again, then exits at once: no reset either
    assert tracker.exited(201.0).delay_s == 8


def test_healthy_before_an_exit_does_not_carry_over_to_the_next_run():
    tracker = RestartTracker(NO_CRASH_LOOP)
    tracker.healthy(0.0)
    assert tracker.exited(10.0).delay_s == 1
    # The next run never answered its health check: 100 s later is not a healthy minute.
    assert tracker.exited(110.0).delay_s == 2


def test_five_exits_within_sixty_seconds_is_a_crash_loop():
    tracker = RestartTracker(RestartPolicy())
    verdicts = [tracker.exited(t) for t in (0.0, 5.0, 12.0, 30.0, 59.0)]
    assert [v.crash_loop for v in verdicts] == [False, False, False, False, True]
    assert verdicts[-1].exits_in_window == 5
    assert verdicts[-1].delay_s == 0
    assert verdicts[-1].restart_number == 4  # four restarts happened before it gave up


def test_exits_spread_over_more_than_the_window_are_not_a_crash_loop():
    tracker = RestartTracker(RestartPolicy())
    verdicts = [tracker.exited(15.0 * i) for i in range(10)]  # 0, 15, ..., 135: 4 per 60 s at most
    assert not any(v.crash_loop for v in verdicts)
    assert max(v.exits_in_window for v in verdicts) == 4


def test_the_crash_loop_rule_is_configurable():
    tracker = RestartTracker(RestartPolicy(crash_loop_exits=2, crash_loop_window_s=10.0))
    assert not tracker.exited(0.0).crash_loop
    assert not tracker.exited(10.0).crash_loop  # the first exit left the window
    assert tracker.exited(19.0).crash_loop


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_backoff_s": -1.0},
        {"initial_backoff_s": 10.0, "max_backoff_s": 5.0},
        {"crash_loop_exits": 0},
        {"crash_loop_window_s": 0.0},
    ],
)
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
