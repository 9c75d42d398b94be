"""Servers that ``pagoda bench --server`` starts, waits for and stops: Pagoda, vLLM, llama.cpp's server.

A server is a name, the base URL of its OpenAI-compatible API and the command that starts it
(``NAME=URL COMMAND...``). It runs in a process group of its own, its output goes to a log file, and it is
ready when ``GET URL/v1/models`` answers 200. Every wait is bounded and says what it waits for.
``NAME=hf[:DTYPE]`` is transformers' ``generate`` instead, run in the benchmark's own process (no server).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda_bench.backend_hf import DTYPES, HfBackendConfig, load_model

_POLL_S = 1.0
_REPORT_EVERY_S = 30.0
_STOP_GRACE_S = 30.0
_LOG_TAIL_LINES = 20


class ServerError(RuntimeError):
    """A server did not start, or exited while it was measured."""


@dataclass(frozen=True)
class ServerSpec:
    """One server to compare: ``name``, the base URL of its OpenAI API, and the command that starts it."""

    name: str
    base_url: str
    command: tuple[str, ...]
    hf_dtype: str | None = None
    """Set for the in-process transformers baseline (``NAME=hf[:DTYPE]``): its dtype, "" for ``--dtype``'s."""


def parse_server(text: str) -> ServerSpec:
    """``NAME=URL COMMAND...`` (the command split as a shell would, without running a shell), or ``NAME=hf[:DTYPE]``."""
    name, sep, rest = text.partition("=")
    kind, _, dtype = rest.strip().partition(":")
    if sep and name and kind == "hf":
        if dtype and dtype not in DTYPES:
            raise ValueError(f"--server {text!r}: the transformers baseline's dtype is one of {DTYPES}")
        return ServerSpec(name, "", (), hf_dtype=dtype)
    parts = shlex.split(rest)
    if not sep or not name or len(parts) < 2 or not parts[0].startswith(("http://", "https://")):
        raise ValueError(
            f"--server {text!r}: expected NAME=URL COMMAND..., e.g. 'vllm=http://127.0.0.1:8001 cmd', "
            "or NAME=hf[:DTYPE]"
        )
    return ServerSpec(name, parts[0].rstrip("/"), tuple(parts[1:]))


def _models(base_url: str, timeout_s: float) -> list[str] | None:
    """The model ids ``GET /v1/models`` lists, or None while it does not answer 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as reply:
            if reply.status != 200:
                return None
            return [entry["id"] for entry in json.load(reply)["data"]]
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return None


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:] if path.exists() else []
    return "\n".join(f"  | {line}" for line in lines) or "  (no output)"


@dataclass
class RunningServer:
    """A started server: its process and the model id its API serves."""

    spec: ServerSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    model: str = ""
    ready_s: float = 0.0

    def check_alive(self) -> None:
        """Raise ``ServerError`` (with its last log lines) if it exited."""
        code = self.process.poll()
        if code is not None:
            raise ServerError(
                f"{self.spec.name} exited with code {code}; last lines of {self.log_path}:\n" + _tail(self.log_path)
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/v1/models`` answers; sets ``model`` and ``ready_s`` (seconds since the start)."""
        start = time.monotonic()
        next_report = start + _REPORT_EVERY_S
        while True:
            self.check_alive()
            models = _models(self.spec.base_url, timeout_s=5.0)
            if models:
                self.model, self.ready_s = models[0], time.monotonic() - start
                return
            now = time.monotonic()
            if now - start > timeout_s:
                raise ServerError(
                    f"{self.spec.name} did not answer {self.spec.base_url}/v1/models within {timeout_s:.0f}s; "
                    f"last lines of {self.log_path}:\n" + _tail(self.log_path)
                )
            if now >= next_report:
                print(f"waiting for {self.spec.name} at {self.spec.base_url} ({now - start:.0f}s)", file=sys.stderr)
                next_report = now + _REPORT_EVERY_S
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after a grace period; bounded."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"{self.spec.name} still running {_STOP_GRACE_S:.0f}s after SIGTERM; SIGKILL", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # what it left behind in its group, too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=_STOP_GRACE_S)


@contextlib.contextmanager
def started(spec: ServerSpec, log_dir: Path, label: str, start_timeout_s: float) -> Iterator[RunningServer]:
    """``spec`` started (its output in ``log_dir/<name>-<label>.log``), ready, and stopped on exit."""
    if _models(spec.base_url, timeout_s=2.0) is not None:
        raise ServerError(f"something already answers at {spec.base_url}: stop it, or give {spec.name} another port")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}-{label}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            spec.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = RunningServer(spec, process, log_path)
    try:
        server.wait_ready(start_timeout_s)
        yield server
    finally:
        server.stop()


@dataclass
class LoadedHf:
    """The baseline as ``pagoda bench --server NAME=hf`` holds it in its turn: loaded, in this process."""

    spec: ServerSpec
    model: str
    """The checkpoint folder, where a server would give its model id."""
    ready_s: float
    hf_model: Any

    def check_alive(self) -> None:
        """It runs in this process: alive while the benchmark is."""


@contextlib.contextmanager
def loaded(config: HfBackendConfig, spec: ServerSpec) -> Iterator[LoadedHf]:
    """The model loaded (``ready_s``: how long that took) for one turn of the rotation, and freed after it."""
    start = time.monotonic()
    baseline = LoadedHf(spec, config.model_path, 0.0, load_model(config))
    baseline.ready_s = time.monotonic() - start
    try:
        yield baseline
    finally:
        baseline.hf_model = None
        gc.collect()
