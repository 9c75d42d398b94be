"""The Hugging Face static-batching baseline on a tiny random Llama."""

from __future__ import annotations

import json

import pytest

from pagoda_bench.backend_hf import HfBackendConfig, load_model, model_vocab, run_batch, run_hf
from pagoda_bench.progress import ProgressBar
from pagoda_bench.workload import random_workload
from pagoda_client.cli import main

pytest.importorskip("transformers")


def test_static_batches_give_each_request_its_wanted_tokens(client_tiny_model_dir):
    config = HfBackendConfig(str(client_tiny_model_dir), "float32", batch_size=3)
    model = load_model(config)
    assert model_vocab(model) == (384, (0,))
    requests = random_workload(5, (3, 12), (2, 9), seed=1, vocab_size=384, excluded_ids=(0,))
    records, duration_s = run_hf(model, requests, config, ProgressBar(5, enabled=False))
    assert [r.output_len for r in records] == [q.output_len for q in requests]
    assert all(r.success and r.start_s == 0.0 for r in records)
    for record in records:
        assert record.chunk_times_s == sorted(record.chunk_times_s)
        assert record.chunk_times_s[-1] <= duration_s
    # Batch 1 (requests 0..2) runs to its longest output; batch 2 starts after it.
    assert records[3].ttft_s >= max(r.e2el_s for r in records[:3])


def test_a_batch_runs_to_its_longest_output_even_past_eos(client_tiny_model_dir):
    model = load_model(HfBackendConfig(str(client_tiny_model_dir)))
    requests = random_workload(2, (4, 4), (3, 11), seed=0, vocab_size=384)
    step_times = run_batch(model, requests, t0=0.0, deadline_s=1e9)
    assert len(step_times) == max(r.output_len for r in requests)


def test_bench_cli_hf_backend_writes_json(client_tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--backend",
            "hf",
            "--model",
            str(client_tiny_model_dir),
            "--num-prompts",
            "4",
            "--input-len-range",
            "4:16",
            "--output-len-range",
            "3:6",
            "--hf-batch-size",
            "2",
            "--goodput",
            "e2el:100000",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    report = capsys.readouterr().out
    assert "Serving Benchmark Result (hf static batching, batch 2, float32)" in report
    document = json.loads(out.read_text())
    metrics = document["runs"]["hf"]["metrics"]
    records = document["runs"]["hf"]["requests"]
    wanted = [r["wanted_output_len"] for r in records]
    assert [r["output_len"] for r in records] == wanted
    assert metrics["completed"] == 4 and metrics["total_output_tokens"] == sum(wanted)
    assert metrics["goodput"] == pytest.approx(metrics["request_throughput"])
    assert document["config"]["input_len_range"] == [4, 16]


def test_time_bound_stops_at_batch_boundaries(client_tiny_model_dir):
    config = HfBackendConfig(str(client_tiny_model_dir), batch_size=2, max_duration_s=0.0)
    model = load_model(config)
    requests = random_workload(4, (3, 5), (2, 3), seed=0, vocab_size=384)
    records, _ = run_hf(model, requests, config, ProgressBar(4, enabled=False))
    assert not any(r.success for r in records)
    assert {r.error for r in records} == {"not run: --max-duration-s reached"}
    assert [r.output_len for r in records] == [0, 0, 0, 0]
