"""The services' JSON log: one whole line per event, even with processes sharing the file (an executor group's
ranks, a pod's containers) and Python's buffering off, as the images run it (PYTHONUNBUFFERED=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WRITER = """
import sys
from pagoda.runtime.logs import configure_logging
import structlog
configure_logging("json")
log = structlog.get_logger("writer")
for i in range(int(sys.argv[1])):
    log.info("line_written", writer=sys.argv[2], i=i, padding="x" * 60)
"""


def test_two_unbuffered_processes_sharing_a_log_never_split_a_line(tmp_path):
    path = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    count = 5000
    with open(path, "ab") as log:
        writers = [
            subprocess.Popen([sys.executable, "-c", WRITER, str(count), name], stderr=log, env=env)
            for name in ("a", "b")
        ]
        for writer in writers:
            assert writer.wait(timeout=120) == 0
    entries = [json.loads(line) for line in path.read_text().splitlines()]  # a mixed line fails here
    assert len(entries) == 2 * count
    for name in ("a", "b"):
        assert [e["i"] for e in entries if e["writer"] == name] == list(range(count))
