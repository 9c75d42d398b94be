"""One child process of the launcher: its command, its output, and how to stop it.

The child's stdout and stderr go through a pipe that a thread reads line by
line: each line is kept in a ring buffer (so a crash message can show the last
ones), and written to ``<log_dir>/<name>.log`` or, without a log folder, echoed
to this process's stderr with the child's name in front.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from pagoda.channel import Tls
from pagoda.launch.health import ServingStatus

# A SIGKILLed process is gone within milliseconds unless stuck in the kernel (D state).
_KILL_WAIT_S = 10.0
# Lines kept per child; the crash-loop message shows the last 20.
_TAIL_LINES = 200
# The output thread ends at EOF, which comes when the child (and what it spawned) is gone.
_OUTPUT_JOIN_S = 2.0
logger = logging.getLogger(__name__)


def describe_exit(returncode: int) -> str:
    """``"exit code 1"`` or ``"signal SIGKILL"`` (Popen reports a signal as a negative code)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


class Child:
    """One service process that can be started again with the same command.

    Args:
        name: ``executor-0``, ``scheduler``, ...: names the log file and log lines.
        argv: the command; a restart runs the same one (same port).
        address: ``127.0.0.1:port`` of its gRPC server.
        env: its environment.
        log_dir: write its output to ``log_dir/<name>.log`` (None: echo to stderr).
        healthy_statuses: health Check answers that count as up.
        tls: TLS of the launcher's health calls to it.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        address: str,
        *,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        healthy_statuses: frozenset[ServingStatus] = frozenset({ServingStatus.SERVING}),
        tls: Tls = False,
    ) -> None:
        self.name = name
        self.argv = argv
        self.address = address
        self.env = dict(os.environ if env is None else env)
        self.log_dir = log_dir
        self.healthy_statuses = healthy_statuses
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None
        self.num_restarts = 0
        self.started_at = 0.0
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._output_threads: list[threading.Thread] = []

    @property
    def log_path(self) -> Path | None:
        """Where its output goes, or None when it is echoed."""
        return None if self.log_dir is None else self.log_dir / f"{self.name}.log"

    @property
    def pid(self) -> int:
        """Its process id while it runs, else 0."""
        return self.process.pid if self.process is not None and self.process.poll() is None else 0

    def poll(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal), else None."""
        return None if self.process is None else self.process.poll()

    def spawn(self) -> None:
        """Start the command in a new session (its own process group), output through a pipe."""
        sink: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            sink = open(self.log_path, "ab")  # noqa: SIM115 (closed by the output thread at EOF)
        try:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError:
            if sink is not None:
                sink.close()
            raise
        self.started_at = time.monotonic()
        assert self.process.stdout is not None
        thread = threading.Thread(
            target=self._copy_output, args=(self.process.stdout, sink), name=f"output-{self.name}", daemon=True
        )
        thread.start()
        self._output_threads = [t for t in self._output_threads if t.is_alive()] + [thread]

    def _copy_output(self, pipe: IO[bytes], sink: IO[bytes] | None) -> None:
        prefix = f"[{self.name}] ".encode()
        try:
            for line in pipe:
                self._tail.append(line.decode(errors="replace").rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                else:
                    with contextlib.suppress(OSError):
                        os.write(2, prefix + line)
        finally:
            pipe.close()
            if sink is not None:
                sink.close()

    def last_lines(self, num_lines: int) -> list[str]:
        """The last ``num_lines`` lines it wrote (across restarts)."""
        return list(self._tail)[-num_lines:]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group (nothing if it has exited)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def reap(self, grace_s: float) -> None:
        """Wait ``grace_s`` for it to exit, then SIGKILL its group and wait (bounded) again."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) still running after %.1fs; SIGKILL", self.name, self.process.pid, grace_s)
            self.signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d still running %.0fs after SIGKILL; not reaped", self.process.pid, _KILL_WAIT_S)

    def join_output(self) -> None:
        """Wait (bounded) until its output is copied out, after it has exited."""
        for thread in self._output_threads:
            thread.join(timeout=_OUTPUT_JOIN_S)
            if thread.is_alive():
                logger.warning("%s: output open %.0fs after exit; left to its thread", self.name, _OUTPUT_JOIN_S)
