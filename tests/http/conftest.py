"""A real system (one executor, a scheduler with --http-port) on the tiny random model."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from support.system import fp32_launcher
from support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def http_tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a trained tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-http") / "tiny-llama")


def wait_http_health(base_url: str, timeout_s: float = 30.0) -> None:
    """Poll GET /health until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"{base_url}/health never answered 200"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def http_system(http_tiny_model_dir, tmp_path_factory):
    """(launcher, base_url): fp32, 64 KV blocks of 16 (the whole context), HTTP API on a free port."""
    from pagoda.launch.launcher import free_port

    port = free_port()
    with fp32_launcher(http_tiny_model_dir, tmp_path_factory.mktemp("http-logs"), "512KiB", http_port=port) as system:
        base_url = f"http://127.0.0.1:{port}"
        wait_http_health(base_url)
        yield system, base_url
