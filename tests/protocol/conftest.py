"""Fixtures for the step-protocol tests: the tiny model and helpers."""

from __future__ import annotations

import time
import urllib.request

import pytest
from support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def scrape(port: int) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, message: str = "condition"):
    """Poll `predicate` until true; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {message}")
        time.sleep(interval_s)
