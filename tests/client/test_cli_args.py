"""Argument parsing of the ``pagoda`` command (no server needed)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from pagoda.launch.serve import default_offload_root, launcher_from_args, split_passthrough
from pagoda_bench.cli import is_loopback
from pagoda_client import TlsConfig
from pagoda_client.cli import build_parser, connection_of, generation_kwargs


def test_generate_flags(monkeypatch):
    monkeypatch.delenv("PAGODA_TARGET", raising=False)
    args = build_parser().parse_args(
        [
            "generate",
            "hello",
            "--max-tokens",
            "7",
            "--temperature",
            "0.5",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--min-p",
            "0.05",
            "--seed",
            "3",
            "--stop",
            "a",
            "--stop",
            "bc",
            "--ignore-eos",
            "--json",
        ]
    )
    assert args.prompt == "hello" and args.json and args.target == "127.0.0.1:50051"
    kwargs = generation_kwargs(args)
    assert kwargs["max_tokens"] == 7 and kwargs["temperature"] == 0.5 and kwargs["top_p"] == 0.9
    assert kwargs["top_k"] == 40 and kwargs["min_p"] == 0.05 and kwargs["seed"] == 3
    assert kwargs["stop"] == ["a", "bc"] and kwargs["ignore_eos"] is True
    assert kwargs["repetition_penalty"] is None and kwargs["stop_token_ids"] is None


def test_token_ids_and_environment(monkeypatch):
    monkeypatch.setenv("PAGODA_TARGET", "127.0.0.1:6000")
    monkeypatch.setenv("PAGODA_API_KEY", "k1")
    args = build_parser().parse_args(["generate", "--token-ids", "1,2, 3", "--stop-token-ids", "9,8"])
    assert args.token_ids == [1, 2, 3] and args.prompt is None
    assert generation_kwargs(args)["stop_token_ids"] == [9, 8]
    assert connection_of(args) == {"target": "127.0.0.1:6000", "api_key": "k1", "tls": False}


def test_tls_flags():
    args = build_parser().parse_args(
        [
            "models",
            "--tls-ca",
            "ca.pem",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--tls-server-name",
            "pagoda.local",
        ]
    )
    assert connection_of(args)["tls"] == TlsConfig("ca.pem", "c.pem", "k.pem", "pagoda.local")


def test_chat_flags():
    args = build_parser().parse_args(["chat", "--system", "be brief", "--max-tokens", "5"])
    assert args.message is None and args.system == "be brief"
    args = build_parser().parse_args(["chat", "What is the capital of France?"])
    assert args.message == "What is the capital of France?"


def test_bench_defaults_are_w_mixed():
    args = build_parser().parse_args(["bench"])
    assert args.backend == "pagoda" and args.workload == "random"
    assert args.num_prompts == 64 and args.seed == 0
    assert args.input_len_range == (16, 512) and args.output_len_range == (16, 256)
    assert math.isinf(args.request_rate) and args.burstiness == 1.0 and args.max_concurrency is None
    assert args.hf_batch_size == 16 and args.hf_num_threads is None and not args.compare_hf


def test_bench_flags():
    args = build_parser().parse_args(
        [
            "bench",
            "--backend",
            "hf",
            "--model",
            "/m",
            "--dtype",
            "bfloat16",
            "--hf-batch-size",
            "8",
            "--request-rate",
            "4",
            "--burstiness",
            "0.5",
            "--max-concurrency",
            "3",
            "--goodput",
            "ttft:500",
            "tpot:50",
            "--input-len-range",
            "8:9",
            "--json",
            "out.json",
            "--plot",
            "plots",
            "--max-duration-s",
            "30",
        ]
    )
    assert (args.backend, args.model, args.dtype, args.hf_batch_size) == ("hf", "/m", "bfloat16", 8)
    assert (args.request_rate, args.burstiness, args.max_concurrency) == (4.0, 0.5, 3)
    assert args.goodput == ["ttft:500", "tpot:50"] and args.input_len_range == (8, 9)
    assert (args.json_path, args.plot_dir, args.max_duration_s) == ("out.json", "plots", 30.0)


def test_serve_flags_and_passthrough():
    own, passthrough = split_passthrough(["serve", "--executors", "2", "--", "--max-num-seqs", "8"])
    assert own == ["serve", "--executors", "2"] and passthrough == ["--max-num-seqs", "8"]
    assert split_passthrough(["generate", "--", "-x"]) == (["generate", "--", "-x"], [])
    args, unknown = build_parser().parse_known_args(
        [
            "serve",
            "--model",
            "/m",
            "--executors",
            "2",
            "--port",
            "6001",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "64MiB",
            "--kv-cache-dtype",
            "int8",
            "--executor-args",
            "--num-threads 1",
            "--max-num-batched-tokens",
            "512",
        ]
    )
    assert unknown == []  # a scheduler flag pagoda serve offers (defined by the scheduler's config)
    launcher = launcher_from_args(args, unknown)
    assert launcher.target == "127.0.0.1:6001"
    executor_argv = launcher.executors[1].argv
    tier = str(default_offload_root() / "executor-1")
    assert executor_argv[:2] == [executor_argv[0], "--host"] and executor_argv[5:7] == ["--model", "/m"]
    assert executor_argv[-11:] == [
        "--kv-offload-dir",
        tier,
        "--kv-offload-dir-next-free",
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "int8",
        "--kv-cache-memory",
        "64MiB",
        "--num-threads",
        "1",
    ]
    scheduler_argv = launcher.scheduler.argv
    assert scheduler_argv[-2:] == ["--max-num-batched-tokens", "512"]
    addresses = scheduler_argv[scheduler_argv.index("--executors") + 1]
    assert addresses == ",".join(launcher.executor_addresses)
    assert len(set(launcher.executor_addresses)) == 2


def test_serve_passes_the_speculation_flags_to_the_scheduler():
    args, unknown = build_parser().parse_known_args(
        ["serve", "--speculative", "ngram", "--num-speculative-tokens", "3"]
    )
    assert unknown == []
    assert launcher_from_args(args, unknown).scheduler.argv[-4:] == [
        "--speculative",
        "ngram",
        "--num-speculative-tokens",
        "3",
    ]


def test_serve_gives_the_draft_model_to_every_executor_and_the_method_to_the_scheduler():
    args, unknown = build_parser().parse_known_args(
        ["serve", "--executors", "2", "--draft-model", "/models/draft", "--speculative", "ngram+draft"]
    )
    launcher = launcher_from_args(args, unknown)
    for executor in launcher.executors:
        assert executor.argv[-2:] == ["--draft-model", "/models/draft"]
    assert launcher.scheduler.argv[-2:] == ["--speculative", "ngram+draft"]
    assert "--draft-model" not in launcher.scheduler.argv


def test_serve_model_defaults_to_default():
    args, _ = build_parser().parse_known_args(["serve"])
    launcher = launcher_from_args(args, [])
    argv = launcher.executors[0].argv
    assert argv[argv.index("--model") + 1] == "default"
    assert "--dtype" not in argv


@pytest.mark.parametrize(
    "target,expected",
    [
        ("127.0.0.1:50051", True),
        ("localhost:1", True),
        ("[::1]:5", True),
        ("127.3.4.5:80", True),
        ("10.0.0.1:50051", False),
        ("example.com:50051", False),
    ],
)
def test_bench_is_loopback_only(target, expected):
    assert is_loopback(target) is expected


def test_unreachable_server_exit_code_and_message():
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", "generate", "hi", "--target", "127.0.0.1:1", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: UNAVAILABLE: ")
    assert proc.stdout == ""


def test_bench_refuses_non_loopback():
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", "bench", "--target", "10.1.2.3:50051", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "loopback" in proc.stderr


def test_client_imports_no_heavy_modules():
    code = (
        "import sys, pagoda_client, pagoda_client.cli, pagoda.launch.launcher; "
        "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'matplotlib', 'scheduler_svc', "
        "'executor_svc') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_throughput_ratio():
    from pagoda_bench.cli import throughput_ratio

    assert throughput_ratio({"output_throughput": 300.0}, {"output_throughput": 60.0}) == 5.0
    assert throughput_ratio({"output_throughput": 300.0}, {"output_throughput": 0.0}) is None


def test_serve_gives_each_executor_its_own_tier_and_turns_it_off_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))

    def executor_flags(*flags):
        args, unknown = build_parser().parse_known_args(["serve", "--executors", "2", *flags])
        argvs = [executor.argv for executor in launcher_from_args(args, unknown).executors]
        # The tier flags come last (nothing else is passed here).
        return [
            argv[next((i for i, a in enumerate(argv) if a.startswith("--kv-offload")), len(argv)) :] for argv in argvs
        ]

    default = tmp_path / "cache" / "kv-offload"
    assert executor_flags() == [
        ["--kv-offload-dir", str(default / f"executor-{i}"), "--kv-offload-dir-next-free"] for i in range(2)
    ]
    assert executor_flags("--kv-offload-dir", str(tmp_path / "t"), "--kv-offload-size", "2GiB") == [
        ["--kv-offload-dir", str(tmp_path / "t" / f"executor-{i}"), "--kv-offload-size", "2GiB"] for i in range(2)
    ]
    assert executor_flags("--kv-offload-dir", "") == [[], []]
    assert (
        executor_flags("--kv-offload-dir", "", "--kv-offload-memory", "1GiB") == [["--kv-offload-memory", "1GiB"]] * 2
    )


def test_serve_passes_quantization_to_every_executor():
    args, unknown = build_parser().parse_known_args(["serve", "--executors", "2", "--quantization", "int8"])
    launcher = launcher_from_args(args, unknown)
    for executor in launcher.executors:
        argv = executor.argv
        assert argv[argv.index("--quantization") + 1] == "int8"
    args, unknown = build_parser().parse_known_args(["serve"])
    assert "--quantization" not in launcher_from_args(args, unknown).executors[0].argv  # the executor's default
