"""``pagoda status`` of an executor group: its shape and last contact, then one line per rank; nothing for a plain
executor."""

from __future__ import annotations

import json

from pagoda.v1 import generation_pb2
from pagoda_client.cli import format_status, status_document
from pagoda_client.core.convert import status_from_pb

RANKS = [
    generation_pb2.GroupRankStatus(
        rank=0,
        host="vm",
        pid=1533,
        shard="layers 0-1, q heads 0-1, kv heads 0-0, vocab 0-191",
        rss_bytes=280 * 2**20 + 2**19,
        kv_cache_bytes=4 * 2**20,
        health="ok",
    ),
    generation_pb2.GroupRankStatus(
        rank=1,
        host="gpu-node-2",
        pid=1820,
        shard="layers 0-1, q heads 2-3, kv heads 1-1, vocab 192-383",
        rss_bytes=13 * 2**30 + 2**28,
        kv_cache_bytes=2**19,
        health="unknown",
    ),
]


def _status() -> generation_pb2.ServerStatus:
    group = generation_pb2.ExecutorStatus(
        address="127.0.0.1:6001",
        state="READY",
        num_kv_blocks=64,
        num_free_kv_blocks=64,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        group_ranks=RANKS,
        group_last_contact_s=1.26,
    )
    plain = generation_pb2.ExecutorStatus(
        address="127.0.0.1:6002", state="READY", tensor_parallel_size=1, pipeline_parallel_size=1
    )
    return generation_pb2.ServerStatus(executors=[group, plain])


def test_a_group_lists_its_shape_then_each_rank_under_its_executor():
    lines = format_status(status_from_pb(_status())).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("127.0.0.1:6001"))
    assert lines[first + 1 : first + 4] == [
        "  group: tensor 2 x pipeline 1  last contact 1.3 s ago",
        "  rank 0  vm  pid 1533  layers 0-1, q heads 0-1, kv heads 0-0, vocab 0-191  rss 280 MiB  kv 4.0 MiB  ok",
        "  rank 1  gpu-node-2  pid 1820  layers 0-1, q heads 2-3, kv heads 1-1, vocab 192-383  rss 13.2 GiB  "
        "kv 0.5 MiB  unknown",
    ]


def test_a_plain_executor_prints_nothing_about_groups():
    lines = format_status(status_from_pb(_status())).splitlines()
    assert lines[-1].startswith("127.0.0.1:6002")  # its row, and no line under it
    assert sum("group:" in line for line in lines) == 1 and sum("  rank " in line for line in lines) == 2


def test_json_output_has_each_ranks_fields():
    document = json.loads(json.dumps(status_document(status_from_pb(_status()))))
    group, plain = document["executors"]
    assert (group["tensor_parallel_size"], group["pipeline_parallel_size"]) == (2, 1)
    assert group["group_last_contact_s"] == 1.26
    assert group["group_ranks"][1] == {
        "rank": 1,
        "host": "gpu-node-2",
        "pid": 1820,
        "shard": "layers 0-1, q heads 2-3, kv heads 1-1, vocab 192-383",
        "rss_bytes": 13 * 2**30 + 2**28,
        "kv_cache_bytes": 2**19,
        "health": "unknown",
    }
    assert plain["group_ranks"] == [] and plain["tensor_parallel_size"] == 1
