"""When to restart a child that exited, and when to give up: pure, clock-free.

The supervisor passes the time of each event in, so the rules are tested with
plain numbers instead of sleeping.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff between restarts and the crash-loop rule.

    Attributes:
        initial_backoff_s: delay before the first restart of a streak.
        max_backoff_s: the delay doubles per restart up to this cap.
        healthy_reset_s: a child healthy this long before it exits starts a
            new streak (its next restart waits ``initial_backoff_s`` again).
        crash_loop_exits: this many exits of one child ...
        crash_loop_window_s: ... within this many seconds is a crash loop:
            the launcher stops everything instead of restarting.
    """

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_reset_s: float = 60.0
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0:
            raise ValueError("crash_loop_exits must be >= 1 and crash_loop_window_s > 0")


@dataclass(frozen=True)
class ExitVerdict:
    """What to do about one exit.

    Attributes:
        crash_loop: give up: stop everything.
        delay_s: wait this long before the restart (0 when ``crash_loop``).
        restart_number: how many times the child will have been restarted,
            counting this restart (its count so far when ``crash_loop``).
        exits_in_window: exits counted in the crash-loop window, this one included.
    """

    crash_loop: bool
    delay_s: float
    restart_number: int
    exits_in_window: int


class RestartTracker:
    """One child's exits and health, judged by a ``RestartPolicy``.

    Args:
        policy: the rules.
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.num_restarts = 0
        self._streak = 0  # restarts since the last reset: the exponent of the backoff
        self._healthy_since: float | None = None
        self._exit_times: collections.deque[float] = collections.deque()

    def healthy(self, now: float) -> None:
        """The child answered its health check at ``now`` (only the first call of a run counts)."""
        if self._healthy_since is None:
            self._healthy_since = now

    def exited(self, now: float) -> ExitVerdict:
        """The child exited at ``now``: restart after a delay, or declare a crash loop."""
        if self._healthy_since is not None and now - self._healthy_since >= self.policy.healthy_reset_s:
            self._streak = 0
        self._healthy_since = None
        self._exit_times.append(now)
        while self._exit_times[0] <= now - self.policy.crash_loop_window_s:
            self._exit_times.popleft()
        num_exits = len(self._exit_times)
        if num_exits >= self.policy.crash_loop_exits:
            return ExitVerdict(True, 0.0, self.num_restarts, num_exits)
        delay_s = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2.0 ** min(self._streak, 32))
        self._streak += 1
        self.num_restarts += 1
        return ExitVerdict(False, delay_s, self.num_restarts, num_exits)
