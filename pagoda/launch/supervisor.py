"""Restart children that exit unexpectedly; stop everything on a crash loop.

A thread polls every child a few times a second: an exit is logged and the
child is started again (same command, so the same port) after the backoff of
its ``RestartTracker``; a restarted child is watched until its health check
answers; a child that exits too often (``RestartPolicy``) ends supervision with
a ``CrashLoop`` that the launcher turns into a stop of everything. Children
the launcher stops on purpose are unwatched first, so they stay down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.launch.child import Child, describe_exit
from pagoda.launch.restart_policy import RestartPolicy, RestartTracker

logger = logging.getLogger(__name__)
# How many of the crashing child's last lines the crash-loop message shows.
CRASH_LOOP_LINES = 20
_JOIN_S = 5.0


def log_event(event: str, **fields: object) -> None:
    """One structured line per event: ``event key=value ...`` (the fields are also on the record)."""
    text = " ".join([event, *(f"{key}={value}" for key, value in fields.items())])
    logger.info("%s", text, extra={"event": event, "fields": fields})


def _exit_fields(returncode: int) -> dict[str, object]:
    """``exit_code=1`` or ``signal=SIGKILL`` for the event line."""
    if returncode >= 0:
        return {"exit_code": returncode}
    return {"signal": describe_exit(returncode).removeprefix("signal ")}


@dataclass(frozen=True)
class CrashLoop:
    """A child exited ``num_exits`` times within ``window_s``: supervision gave up."""

    child: str
    num_exits: int
    window_s: float
    last_exit: str
    returncode: int
    last_lines: tuple[str, ...]

    def message(self) -> str:
        """What the user reads: the child, how often it died, and its last log lines."""
        head = (
            f"{self.child} is crash-looping: it exited {self.num_exits} times within {self.window_s:.0f}s "
            f"(last: {self.last_exit}); stopping everything."
        )
        lines = [f"  | {line}" for line in self.last_lines] or ["  (no output)"]
        return "\n".join([head, f"Last {len(self.last_lines)} log lines of {self.child}:", *lines])


@dataclass
class _Watch:
    """The supervisor's view of one child."""

    tracker: RestartTracker
    watched: bool = True
    restart_at: float | None = None
    healthy: bool = False
    slow_logged: bool = False


class Supervisor:
    """Watch ``children`` from a thread (``start``/``stop``) or one ``tick`` at a time.

    Args:
        children: the processes, already started and healthy.
        policy: backoff and crash-loop rules.
        is_healthy: one bounded health check of a child.
        clock: monotonic seconds (a fake one in tests).
        poll_interval_s: time between two ticks of the thread.
        slow_start_s: log once when a restarted child is not healthy after this long.
    """

    def __init__(
        self,
        children: Sequence[Child],
        *,
        policy: RestartPolicy,
        is_healthy: Callable[[Child], bool],
        clock: Callable[[], float] = time.monotonic,
        poll_interval_s: float = 0.2,
        slow_start_s: float = 300.0,
    ) -> None:
        self.children = list(children)
        self.policy = policy
        self.lock = threading.RLock()  # held while a child's state changes; the launcher takes it too
        self.failed = threading.Event()
        self.crash_loop: CrashLoop | None = None
        self._is_healthy = is_healthy
        self._clock = clock
        self._poll_interval_s = poll_interval_s
        self._slow_start_s = slow_start_s
        self._watches = {child.name: _Watch(RestartTracker(policy)) for child in self.children}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Watch from a daemon thread until ``stop`` or a crash loop."""
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Its thread watches (started, not stopped, no crash loop)."""
        return self._thread is not None and not self._stopped.is_set() and not self.failed.is_set()

    def stop(self) -> None:
        """Stop watching (nothing is restarted after this returns)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)
            if self._thread.is_alive():
                logger.warning("supervisor thread still busy %.0fs after stop", _JOIN_S)
        with self.lock:  # a tick in progress finishes before the caller goes on
            self._thread = None

    def _run(self) -> None:
        while not self._stopped.wait(self._poll_interval_s) and not self.failed.is_set():
            try:
                self.tick()
            except Exception:  # a bug here must not end supervision silently
                logger.exception("supervisor tick failed")

    def unwatch(self, child: Child) -> None:
        """Stop restarting ``child`` (the launcher is about to stop it on purpose)."""
        with self.lock:
            self._watches[child.name].watched = False
            self._watches[child.name].restart_at = None

    def watch(self, child: Child) -> None:
        """Watch ``child`` again (the launcher has just started it)."""
        with self.lock:
            self._watches[child.name] = _Watch(self._watches[child.name].tracker)

    def tick(self) -> None:
        """Look at every child once: handle an exit, a due restart, or a first healthy answer."""
        for child in self.children:
            with self.lock:
                if self.failed.is_set() or self._stopped.is_set():
                    return
                watch = self._watches[child.name]
                if watch.watched:
                    self._tick_child(child, watch, self._clock())

    def _tick_child(self, child: Child, watch: _Watch, now: float) -> None:
        if watch.restart_at is not None:
            if now >= watch.restart_at:
                self._restart(child, watch, now)
            return
        returncode = child.poll()
        if returncode is not None:
            self._on_exit(child, watch, returncode, now)
        elif not watch.healthy:
            self._check_health(child, watch, now)

    def _on_exit(self, child: Child, watch: _Watch, returncode: int, now: float) -> None:
        verdict = watch.tracker.exited(now)
        pid = child.process.pid if child.process is not None else 0
        watch.healthy = False
        if verdict.crash_loop:
            self._give_up(child, verdict.exits_in_window, returncode)
            return
        watch.restart_at = now + verdict.delay_s
        log_event(
            "child_exited",
            child=child.name,
            pid=pid,
            **_exit_fields(returncode),
            restart=verdict.restart_number,
            delay_s=f"{verdict.delay_s:g}",
        )

    def _give_up(self, child: Child, num_exits: int, returncode: int) -> None:
        child.join_output()  # its last lines explain the exit
        self.crash_loop = CrashLoop(
            child.name,
            num_exits,
            self.policy.crash_loop_window_s,
            describe_exit(returncode),
            returncode,
            tuple(child.last_lines(CRASH_LOOP_LINES)),
        )
        log_event(
            "child_crash_loop", child=child.name, exits=num_exits, window_s=f"{self.policy.crash_loop_window_s:g}"
        )
        self.failed.set()

    def _restart(self, child: Child, watch: _Watch, now: float) -> None:
        watch.restart_at = None
        child.num_restarts = watch.tracker.num_restarts
        try:
            child.spawn()
        except OSError as error:  # e.g. the command vanished: counts as an exit
            log_event("child_spawn_failed", child=child.name, error=repr(str(error)))
            self._on_exit(child, watch, 127, now)
            return
        log_event("child_restarted", child=child.name, pid=child.pid, restart=child.num_restarts)

    def _check_health(self, child: Child, watch: _Watch, now: float) -> None:
        if self._is_healthy(child):
            watch.healthy = True
            watch.slow_logged = False
            watch.tracker.healthy(now)
            if child.num_restarts:
                log_event("child_serving", child=child.name, pid=child.pid, restart=child.num_restarts)
        elif not watch.slow_logged and time.monotonic() - child.started_at > self._slow_start_s:
            watch.slow_logged = True
            log_event("child_slow_start", child=child.name, pid=child.pid, waited_s=f"{self._slow_start_s:g}")
