"""``pagoda bench --server ...``: servers started, measured in rotated rounds and stopped; their failures bounded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.launch.launcher import free_port
from pagoda_bench.compare import ServerRuns, format_comparison, parse_servers, rotated
from pagoda_bench.servers import ServerError, ServerSpec, parse_server, started
from pagoda_client.cli import main


def _loopback(target: str) -> bool:
    return target.startswith("[127.0.0.1]")


def test_a_server_is_a_name_a_url_and_a_command():
    spec = parse_server("vllm=http://127.0.0.1:8001/ bench/vllm_cpu.sh serve 8001 --max-num-seqs '64'")
    assert spec == ServerSpec(
        "vllm", "http://127.0.0.1:8001", ("bench/vllm_cpu.sh", "serve", "8001", "--max-num-seqs", "64")
    )
    for bad in ("vllm", "=http://127.0.0.1:1 cmd", "vllm=http://127.0.0.1:1", "vllm=127.0.0.1:1 cmd"):
        with pytest.raises(ValueError, match="NAME=URL COMMAND"):
            parse_server(bad)
    with pytest.raises(ValueError, match="must differ"):
        parse_servers(["a=http://127.0.0.1:1 x", "a=http://127.0.0.1:2 y"], _loopback)
    with pytest.raises(ValueError, match="loopback"):
        parse_servers(["a=http://10.0.0.1:1 x"], _loopback)


def test_the_transformers_baseline_is_a_server_of_its_own_kind():
    assert parse_server("hf-bf16=hf:bfloat16") == ServerSpec("hf-bf16", "", (), hf_dtype="bfloat16")
    assert parse_server("hf=hf").hf_dtype == ""  # --dtype's
    with pytest.raises(ValueError, match="dtype is one of"):
        parse_server("hf=hf:int4")
    # It has no URL to check: it runs in the benchmark's process.
    assert [s.name for s in parse_servers(["a=http://127.0.0.1:1 x", "b=hf"], _loopback)] == ["a", "b"]


def test_each_round_starts_with_the_next_server():
    specs = [ServerSpec(name, "http://127.0.0.1:1", ("x",)) for name in "abc"]
    orders = ["".join(s.name for s in rotated(specs, r)) for r in range(4)]
    assert orders == ["abc", "bca", "cab", "abc"]


def _metrics(tok_s: float, ttft_ms: float = 100.0, failed: int = 0) -> dict:
    return {"output_throughput": tok_s, "ttft_ms": {"median": ttft_ms}, "failed": failed, "completed": 8}


def test_the_table_takes_first_runs_and_steady_runs_apart():
    a = ServerRuns(ServerSpec("a", "u", ("x",)), [[_metrics(50), _metrics(100), _metrics(110)]] * 3, [2.0] * 3)
    b = ServerRuns(
        ServerSpec("b", "u", ("x",)), [[_metrics(40), _metrics(50)], [_metrics(45), _metrics(55)]], [9.0, 11.0]
    )
    assert a.first() == [50, 50, 50] and sorted(b.steady()) == [50, 55]
    row_a, row_b = format_comparison([a, b]).splitlines()[2:4]
    # a: first 50, steady median 105 (0.48 of it); b: first 42.5, steady 52.5, 0.50 of a's steady.
    assert row_a.split()[:6] == ["a", "50.0", "(50-50)", "105.0", "(100-110)", "0.48"]
    assert row_b.split()[:7] == ["b", "42.5", "(40-45)", "52.5", "(50-55)", "0.81", "0.50"]
    assert a.complete() and not ServerRuns(a.spec, [[_metrics(1, failed=1)]]).complete()


def test_prompt_tokens_served_from_a_cache_are_shown_and_warned_of_when_prompts_were_new():
    cold = {**_metrics(100), "total_input_tokens": 1000, "total_cached_tokens": 0}
    warm = {**_metrics(300), "total_input_tokens": 1000, "total_cached_tokens": 940}
    a = ServerRuns(ServerSpec("a", "u", ("x",)), [[cold, cold]], [2.0])
    b = ServerRuns(ServerSpec("b", "u", ("x",)), [[cold, cold], [warm, cold]], [2.0, 2.0])
    lines = format_comparison([a, b], expect_uncached=True).splitlines()
    assert "cached %" in lines[0] and lines[2].split()[-1] == "0.0" and lines[3].split()[-1] == "94.0"
    assert lines[-1].startswith("warning: b was served up to 94.0% of a run's prompt tokens from a cache")
    assert not any(line.startswith("warning") for line in format_comparison([a, b]).splitlines())


def test_a_long_first_server_name_keeps_the_header_columns_apart():
    name = "pagoda-bf16-widened"
    runs = ServerRuns(ServerSpec(name, "u", ("x",)), [[_metrics(50), _metrics(100)]], [2.0])
    header, _, row = format_comparison([runs]).splitlines()[:3]
    assert "first/steady steady vs " + name in " ".join(header.split())
    assert len(header) == len(row) and row.split()[6] == "1.00"


def test_a_server_that_exits_is_reported_with_its_last_lines(tmp_path):
    spec = ServerSpec(
        "crash", f"http://127.0.0.1:{free_port()}", (sys.executable, "-c", "print('no model here'); exit(3)")
    )
    with pytest.raises(ServerError, match=r"crash exited with code 3(.|\n)*no model here"):
        with started(spec, tmp_path, "round1", start_timeout_s=60):
            pass


def test_a_server_that_never_answers_is_given_up_and_stopped(tmp_path):
    spec = ServerSpec("mute", f"http://127.0.0.1:{free_port()}", (sys.executable, "-c", "import time; time.sleep(600)"))
    start = time.monotonic()
    with pytest.raises(ServerError, match="did not answer .*/v1/models within 2s"):
        with started(spec, tmp_path, "round1", start_timeout_s=2):
            pass
    assert time.monotonic() - start < 60


def test_two_servers_compared_over_rotated_rounds(client_tiny_model_dir, tmp_path, capsys):
    """Pagoda twice under two names, each started by its own command twice, measured twice per start."""
    servers, ports = [], []
    for name in ("one", "two"):
        http_port, port = free_port(), free_port()
        ports.append(http_port)
        command = f"{sys.executable} -m pagoda_client.cli serve --model {client_tiny_model_dir} --dtype float32"
        command += f" --kv-cache-memory 512KiB --http-port {http_port} --port {port}"
        command += f" --kv-offload-dir {tmp_path / 'tier'}"  # one directory, kept across both servers' starts
        servers += ["--server", f"{name}=http://127.0.0.1:{http_port} {command}"]
    out = tmp_path / "compare.json"
    argv = ["bench", "--model", str(client_tiny_model_dir), "--num-prompts", "4", "--input-len-range", "40:72"]
    argv += ["--output-len-range", "2:8", "--rounds", "2", "--runs-per-start", "2", "--no-progress"]
    argv += ["--server-log-dir", str(tmp_path / "logs"), "--json", str(out), *servers]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    starts = [line.split("]")[0] + "] " + line.split()[1] for line in printed.splitlines() if "answered after" in line]
    assert starts == ["[round1] one", "[round1] two", "[round2] two", "[round2] one"]
    assert "steady vs one" in printed
    document = json.loads(out.read_text())["servers"]
    for name in ("one", "two"):
        assert len(document[name]["starts"]) == 2
        runs = [run for start in document[name]["starts"] for run in start]
        assert all(run["completed"] == 4 and run["failed"] == 0 for run in runs)
        assert document[name]["steady_output_throughput"] > 0
    # Run k of every start sends seed + k's lengths with ids salted per round and server: new to the server each
    # run, though both keep the KV blocks of every earlier start in one directory (whole blocks written there);
    # the same lengths for both servers.
    every_run = [run for name in document for start in document[name]["starts"] for run in start]
    assert all(run["total_cached_tokens"] == 0 for run in every_run)
    assert any((tmp_path / "tier").rglob("*.kvb"))  # the blocks were there to be loaded
    assert isinstance(json.loads(out.read_text())["config"]["prompt_salt"], int)
    inputs = {
        name: [[run["total_input_tokens"] for run in start] for start in document[name]["starts"]] for name in document
    }
    assert inputs["one"] == inputs["two"] and all(start == inputs["one"][0] for start in inputs["one"])
    assert inputs["one"][0][0] != inputs["one"][0][1]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "one-round1.log",
        "one-round2.log",
        "two-round1.log",
        "two-round2.log",
    ]
    # Every server stopped: nothing answers on their ports any more.
    assert all(_refused(port) for port in ports)


def test_the_transformers_baseline_takes_its_turn_in_the_rotation(client_tiny_model_dir, tmp_path, capsys):
    """A server and transformers on the same prompts, the baseline loaded in its turn and freed after it."""
    http_port, port = free_port(), free_port()
    command = f"{sys.executable} -m pagoda_client.cli serve --model {client_tiny_model_dir} --dtype float32"
    command += f" --kv-cache-memory 512KiB --http-port {http_port} --port {port}"
    out = tmp_path / "compare.json"
    argv = ["bench", "--model", str(client_tiny_model_dir), "--num-prompts", "4", "--input-len-range", "4:24"]
    argv += ["--output-len-range", "2:8", "--rounds", "2", "--runs-per-start", "2", "--no-progress"]
    argv += ["--hf-batch-size", "2", "--server-log-dir", str(tmp_path / "logs"), "--json", str(out)]
    argv += ["--server", f"pagoda=http://127.0.0.1:{http_port} {command}", "--server", "hf=hf:float32"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    starts = [line.split("]")[0] + "] " + line.split()[1] for line in printed.splitlines() if "answered after" in line]
    assert starts == ["[round1] pagoda", "[round1] hf", "[round2] hf", "[round2] pagoda"]
    document = json.loads(out.read_text())["servers"]
    assert document["hf"]["hf_dtype"] == "float32" and document["hf"]["command"] == []
    assert all(seconds > 0 for seconds in document["hf"]["ready_s"])
    for name in ("pagoda", "hf"):
        runs = [run for start in document[name]["starts"] for run in start]
        assert len(runs) == 4 and all(run["completed"] == 4 and run["failed"] == 0 for run in runs)
    # The same prompts and the same wanted outputs for both (transformers counts only each request's own tokens).
    for key in ("total_input_tokens", "total_output_tokens"):
        assert [r[key] for s in document["hf"]["starts"] for r in s] == [
            r[key] for s in document["pagoda"]["starts"] for r in s
        ]
    # The server has no log of its own.
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["pagoda-round1.log", "pagoda-round2.log"]


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_llamacpp_script_says_how_to_use_it_and_what_is_missing(tmp_path):
    script = Path(__file__).resolve().parents[2] / "bench" / "llamacpp_cpu.sh"
    env = {**os.environ, "LLAMACPP_ROOT": str(tmp_path / "absent")}
    usage = subprocess.run([script], capture_output=True, text=True, timeout=30, env=env)
    assert usage.returncode == 2 and "install | quantize TYPE [GGUF] | serve PORT" in usage.stderr
    for command in (["serve", "8123"], ["quantize", "BF16"]):
        missing = subprocess.run([script, *command], capture_output=True, text=True, timeout=30, env=env)
        assert missing.returncode == 1 and "llama.cpp is not installed" in missing.stderr
    assert not (tmp_path / "absent").exists()
