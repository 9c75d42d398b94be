"""``pagoda status``: each executor's kernels, in the human output and in ``--json``."""

from __future__ import annotations

import json

from pagoda.v1 import generation_pb2
from pagoda_client.cli import format_status, status_document
from pagoda_client.core.convert import status_from_pb


def _status() -> generation_pb2.ServerStatus:
    return generation_pb2.ServerStatus(
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.25,
        executors=[
            generation_pb2.ExecutorStatus(
                address="127.0.0.1:6001",
                state="READY",
                num_running=3,
                num_kv_blocks=120,
                num_free_kv_blocks=90,
                kv_cache_usage=0.25,
                kernels={"gemm": "amx-panel", "attention": "cpp", "prefill": "amx-flash"},
                kv_cache_dtype="int8",
                quantization="none",
            ),
            generation_pb2.ExecutorStatus(address="127.0.0.1:6002", state="CONNECTING"),
        ],
        num_requests_total=9,
    )


def test_executor_status_carries_its_kernels_sorted():
    status = status_from_pb(_status())
    assert status.executors[0].kernels == {"attention": "cpp", "gemm": "amx-panel", "prefill": "amx-flash"}
    assert list(status.executors[0].kernels) == ["attention", "gemm", "prefill"]
    assert status.executors[1].kernels == {}


def test_human_output_lists_the_kernels_under_their_executor():
    lines = format_status(status_from_pb(_status())).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("127.0.0.1:6001"))
    assert "READY" in lines[first] and "90/120" in lines[first]
    assert lines[first + 1] == "  kv cache dtype: int8"
    assert lines[first + 2] == "  quantization: none"
    assert lines[first + 3] == "  kernels: attention=cpp  gemm=amx-panel  prefill=amx-flash"
    assert lines[first + 4].startswith("127.0.0.1:6002") and len(lines) == first + 5  # not described: no lines


def test_json_output_has_the_kernels_of_each_executor():
    document = json.loads(json.dumps(status_document(status_from_pb(_status()))))
    assert document["executors"][0]["kernels"] == {"attention": "cpp", "gemm": "amx-panel", "prefill": "amx-flash"}
    assert document["executors"][1]["kernels"] == {}
    assert document["executors"][0]["quantization"] == "none" and document["executors"][1]["quantization"] == ""
    assert document["num_requests_total"] == 9 and document["executors"][0]["num_free_kv_blocks"] == 90
    assert document["executors"][0]["kv_cache_dtype"] == "int8" and document["executors"][1]["kv_cache_dtype"] == ""
