"""Served throughput with and without output constraints, and the first-token cost of compiling a schema.

Usage:
    python bench/bench_structured_serve.py [--base REF] [--rounds 2] \\
        [--serve-args "--dtype bfloat16 --kv-cache-memory 1GiB"] \\
        [--bench-args "--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"]

One run, three variants per round (the order rotates each round, so drift on a
shared machine hits all alike), each a fresh ``pagoda serve`` and the same
W-mixed workload:
- ``base``: the code of git ref ``--base`` (default: this branch's merge base
  with main), served from this venv with its packages first on PYTHONPATH;
- ``plain``: this checkout, no request constrained;
- ``half``: this checkout, every other request constrained to a JSON schema
  (``--structured-fraction 0.5``; ``ignore_eos`` keeps the lengths of the workload).
Then, on this checkout's server, time to first token of single requests in
turn: unconstrained, a schema it has not seen (cold compile), the same schema
again (cached).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ab_serve import BENCH_TIMEOUT_S, _free_port, _wait_ready
from stop_signals import stop_on_signals

ROOT = Path(__file__).resolve().parent.parent
# The packages of a checkout and where they may live in it (setup.py's IMPORT_ROOTS; older checkouts first had
# the shared package in protos/pagoda).
PACKAGES = {
    "pagoda": ("pagoda", "protos/pagoda"),
    "pagoda_client": ("client",),
    "pagoda_bench": ("bench/pagoda_bench",),
    "scheduler_svc": ("scheduler_svc",),
    "executor_svc": ("executor_svc",),
}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror", "documentary"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "genres", "summary"],
    "additionalProperties": False,
}


def base_tree(ref: str, into: Path) -> Path:
    """A PYTHONPATH folder whose packages are those of ``ref`` (extracted from git, linked by package name)."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True, timeout=120)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=120)
    path = into / "path"
    path.mkdir()
    for name, places in PACKAGES.items():
        where = next(w for w in places if (tree / w / "__init__.py").exists())
        (path / name).symlink_to(tree / where)
    return path


def serve(serve_args: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "pagoda_client.cli", "serve", "--port", str(port), *serve_args]
    with open(log, "ab") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    target = f"127.0.0.1:{port}"
    _wait_ready(Path(sys.executable).parent / "pagoda", target, server)
    return server, target


def stop(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def throughput(target: str, bench_args: list[str], tmp: Path) -> float:
    report = tmp / "bench.json"
    bench = [str(Path(sys.executable).parent / "pagoda"), "bench", "--target", target, "--no-progress"]
    subprocess.run(
        [*bench, "--json", str(report), *bench_args], check=True, timeout=BENCH_TIMEOUT_S, stdout=subprocess.DEVNULL
    )
    return float(json.loads(report.read_text())["runs"]["pagoda"]["metrics"]["output_throughput"])


def first_token_ms(target: str, repeats: int) -> dict[str, float]:
    """Median time to first token of one request at a time: plain, a new schema each time, the same schema."""
    from pagoda_client import Client

    def ttft(**options: object) -> float:
        start = time.perf_counter()
        with client.stream("Describe a film as JSON.", max_tokens=2, temperature=0, **options) as deltas:
            for delta in deltas:
                if delta.token_ids:
                    return (time.perf_counter() - start) * 1e3
        raise RuntimeError("no token")

    samples: dict[str, list[float]] = {"plain": [], "cold": [], "cached": []}
    with Client(target, timeout=120) as client:
        ttft()  # warm the path
        for i in range(repeats):
            samples["plain"].append(ttft())
            fresh = {
                **SCHEMA,
                "properties": {**SCHEMA["properties"], f"field_{i}_{time.time_ns()}": {"type": "integer"}},
            }
            samples["cold"].append(ttft(json_schema=fresh))
            samples["cached"].append(ttft(json_schema=SCHEMA))
    return {name: statistics.median(values) for name, values in samples.items()}


def merge_base() -> str:
    out = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or "HEAD"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="git ref of the code before constraints (default: merge base)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-args", default="--dtype bfloat16 --kv-cache-memory 1GiB")
    parser.add_argument(
        "--bench-args", default="--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"
    )
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_structured_serve.log")
    args = parser.parse_args()
    stop_on_signals()
    serve_args, bench_args = shlex.split(args.serve_args), shlex.split(args.bench_args)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "schema.json").write_text(json.dumps(SCHEMA))
        base_env = {**os.environ, "PYTHONPATH": str(base_tree(args.base or merge_base(), tmp))}
        half = [*bench_args, "--json-schema", str(tmp / "schema.json"), "--structured-fraction", "0.5"]
        variants = {
            "base": (base_env, bench_args),
            "plain": (dict(os.environ), bench_args),
            "half": (dict(os.environ), half),
        }
        results: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round_index in range(args.rounds):
            for name in names[round_index % 3 :] + names[: round_index % 3]:
                env, workload = variants[name]
                server, target = serve(serve_args, env, args.log)
                try:
                    results[name].append(throughput(target, workload, tmp))
                finally:
                    stop(server)
                print(f"round {round_index + 1} {name}: {results[name][-1]:.1f} output tok/s", flush=True)
        server, target = serve(serve_args, dict(os.environ), args.log)
        try:
            ttft = first_token_ms(target, args.ttft_repeats)
        finally:
            stop(server)
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, values in results.items():
        print(f"{name}: median {medians[name]:.1f} output tok/s [{', '.join(f'{v:.1f}' for v in values)}]")
    print(
        f"plain/base = {medians['plain'] / medians['base']:.3f}, half/plain = {medians['half'] / medians['plain']:.3f}"
    )
    print("time to first token, ms (median): " + ", ".join(f"{k} {v:.1f}" for k, v in ttft.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
