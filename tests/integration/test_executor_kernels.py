"""A real executor serves on the C++ kernels built at install time, whatever the machine's build state.

Executor processes are started the way the issue's failures happened, each
with a fresh HOME and, under every old extension name in every torch
extension cache it could look at, the ``lock`` and half-written build an
interrupted JIT build leaves: once with no compiler or ninja on PATH
(``CXX``/``CC`` pointing at /bin/false), once with the compiler there (where
a JIT loader would wait on the lock forever). Each must become ready
promptly on the C++ paths, load the library installed in this environment,
and write nothing to a per-user cache (so two checkouts on one machine
never rebuild each other's kernels).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from executor_svc.native import loader
from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import LOOPBACK, free_port
from pagoda.v1 import executor_pb2, executor_pb2_grpc

pytestmark = pytest.mark.integration

# The extensions the JIT build used to cache per user (and lock while building).
OLD_EXTENSIONS = ("pagoda_cpu_attention", "pagoda_cpu_ops", "pagoda_cpu_gemm", "pagoda_cpu_prefill")
# Loading the tiny model takes seconds; a start waiting on a lock or a build never ends.
READY_BOUND_S = 90.0


@dataclasses.dataclass
class Start:
    """What one executor start showed."""

    seconds_to_ready: float
    kernels: dict[str, str]
    ready_line: dict
    log: str
    planted: dict[Path, bytes]  # stale build files -> their content before the start
    caches_before: set[Path]
    caches_after: set[Path]


@pytest.fixture(scope="module")
def installed_kernels() -> loader.Kernels:
    kernels = loader.kernels()
    if kernels is None:
        if shutil.which("c++") is None:
            pytest.skip("the C++ kernels are not installed and there is no compiler (make install builds them)")
        pytest.fail("the C++ kernels did not load although a compiler is present: see the make install output")
    return kernels


def _plant_stale_builds(cache_dirs: list[Path]) -> dict[Path, bytes]:
    """A lock and a half-written build of every old extension, in the flat and the per-Python layouts."""
    planted = {}
    for cache in cache_dirs:
        for parent in (cache, cache / "py311_cpu"):
            for name in OLD_EXTENSIONS:
                folder = parent / name
                folder.mkdir(parents=True)
                files = {
                    folder / "lock": b"",
                    folder / "build.ninja": b"ninja_required_version = 1.3\nrule compile\n  command = c++ $",
                    folder / f"{name}.so": b"\x7fELF\x02\x01\x01",  # truncated: the build died while linking
                }
                for path, content in files.items():
                    path.write_bytes(content)
                planted.update(files)
    return planted


def _tree(*roots: Path) -> set[Path]:
    return {path for root in roots if root.exists() for path in root.rglob("*")}


def _wait_ready(process: subprocess.Popen, address: str, log_path: Path) -> float:
    started = time.monotonic()
    while check_health(address) != ServingStatus.SERVING:
        if process.poll() is not None:
            pytest.fail(f"the executor exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() - started > READY_BOUND_S:
            pytest.fail(f"not ready after {READY_BOUND_S:.0f}s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return time.monotonic() - started


def _describe(address: str) -> executor_pb2.ExecutorInfo:
    with grpc.insecure_channel(address) as channel:
        return executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=10)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _start(model_dir: Path, root: Path, *, compiler: bool) -> Start:
    """Starts one executor with a fresh HOME and stale builds planted in every extension cache."""
    home, extensions = root / "home", root / "torch_extensions"
    planted = _plant_stale_builds([extensions, home / ".cache" / "torch_extensions"])
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TORCH_EXTENSIONS_DIR": str(extensions),
    }
    if not compiler:
        (root / "bin").mkdir()  # PATH: no c++, g++, gcc, ninja
        env.update(PATH=str(root / "bin"), CXX="/bin/false", CC="/bin/false")
    caches_before = _tree(home, extensions)
    port = free_port()
    address = f"{LOOPBACK}:{port}"
    log_path = root / "executor.log"
    argv = [sys.executable, "-m", "executor_svc.main", "--host", LOOPBACK, "--port", str(port)]
    argv += ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "256KiB", "--log-format", "json"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, env=env, cwd=root, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            seconds = _wait_ready(process, address, log_path)
            info = _describe(address)
        finally:
            _stop(process)
    log = log_path.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    ready = next(line for line in lines if line["event"] == "executor_ready")
    return Start(seconds, dict(info.kernels), ready, log, planted, caches_before, _tree(home, extensions))


@pytest.fixture(scope="module")
def no_compiler_start(tiny_model_dir, tmp_path_factory, installed_kernels) -> Start:
    """No compiler or ninja on PATH, CXX and CC pointing at /bin/false."""
    return _start(tiny_model_dir, tmp_path_factory.mktemp("no_compiler"), compiler=False)


@pytest.fixture(scope="module")
def stale_build_start(tiny_model_dir, tmp_path_factory, installed_kernels) -> Start:
    """The compiler on PATH as usual: where a JIT loader would wait on the locks forever."""
    return _start(tiny_model_dir, tmp_path_factory.mktemp("stale_build"), compiler=True)


def _assert_cpp_paths(start: Start, installed: loader.Kernels) -> None:
    kernels = start.kernels
    assert kernels["attention"] == "cpp" and kernels["layer_ops"] == "cpp"
    assert kernels["variant"] == installed.variant
    # fp32 linear layers: our panel GEMM where the variant has AVX-512 or AVX2 + FMA, else MKL's sgemm.
    panels = "avx512-panel" if "avx512" in installed.features else "avx2-panel"
    assert kernels["gemm"] == (panels if "f32_panels" in installed.features else "torch")
    assert kernels["prefill"] == "decode-rows+sdpa"  # the prefill kernel is bf16 only: fp32 chunks as decode rows
    assert start.ready_line["kernels"] == kernels
    assert "native_kernels_unavailable" not in start.log


def test_ready_without_a_compiler_on_the_cpp_paths(no_compiler_start, installed_kernels):
    _assert_cpp_paths(no_compiler_start, installed_kernels)


def test_stale_locks_and_half_written_builds_do_not_delay_the_start(stale_build_start, installed_kernels):
    assert stale_build_start.seconds_to_ready < READY_BOUND_S
    _assert_cpp_paths(stale_build_start, installed_kernels)
    # Nothing waited on, removed or rebuilt them: the executor never looked.
    assert {path: path.read_bytes() for path in stale_build_start.planted} == stale_build_start.planted


@pytest.mark.parametrize("start", ["no_compiler_start", "stale_build_start"])
def test_kernels_come_from_this_environment_and_nothing_is_cached_per_user(request, start, installed_kernels):
    """Two checkouts each load their own environment's build and share no cache: neither rebuilds the other's."""
    started: Start = request.getfixturevalue(start)
    library = Path(started.ready_line["kernel_library"])
    assert library == installed_kernels.library
    assert library.resolve().is_relative_to(Path(sys.prefix).resolve())
    assert started.caches_after == started.caches_before
