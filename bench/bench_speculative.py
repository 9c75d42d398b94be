"""Speculative decoding served, side by side in one run: n-gram drafts off vs on.

Usage:
    python bench/bench_speculative.py [--rounds 2] [--num-requests 8] [--k 4] \\
        [--serve-args "--dtype bfloat16 --kv-cache-memory 1GiB"] \\
        [--bench-args "--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"]

Each round starts a fresh ``pagoda serve`` per variant (the order rotates each
round, so drift on a shared machine hits both alike): ``off``, and ``ngram``
(``--speculative ngram --num-speculative-tokens K``, passed through by ``pagoda
serve`` to the scheduler). On each:
1. the input-grounded requests of ``spec_workload.py`` (quote a report, edit a
   module; greedy, up to 256 tokens) one at a time, then 8 at a time: output
   tokens/s, and from the scheduler's status the draft tokens accepted;
2. W-mixed (``pagoda bench``: 64 requests at once, prompts 16-512, outputs 16-256).
Prints every run, the medians and the ratios, and whether both variants gave the
same tokens to the grounded requests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_structured_serve import serve, stop, throughput
from spec_workload import grounded_requests

from pagoda_client import Client, GenerationResult

VARIANTS = ("off", "ngram")


def grounded(target: str, requests: list, concurrency: int) -> tuple[float, float, list[list[int]], dict[str, float]]:
    """(output tokens/s, decode tokens/s, each request's tokens, speculation counters) at ``concurrency``.

    Decode tokens/s: the tokens after the first over the time after the first (server timings),
    summed over the requests: the prefill left out.
    """
    with Client(target, timeout=600) as client:
        before = client.status()

        def one(messages: list) -> GenerationResult:
            return client.chat(messages, max_tokens=256, temperature=0)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, requests))
        elapsed = time.perf_counter() - start
        after = client.status()
    counters = {
        name: getattr(after, name) - getattr(before, name)
        for name in ("spec_num_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total")
    }
    outputs = [r.token_ids for r in results]
    decode_s = sum(r.timings.total_s - r.timings.time_to_first_token_s for r in results)
    decode_tok_s = sum(len(o) - 1 for o in outputs) / decode_s
    return sum(len(o) for o in outputs) / elapsed, decode_tok_s, outputs, counters


def describe(counters: dict[str, float]) -> str:
    drafts, drafted, accepted = counters.values()
    if not drafts:
        return "no drafts"
    return f"acceptance {accepted / drafted:.2f}, {1 + accepted / drafts:.2f} tokens per verify step"


def run_variant(variant: str, args: argparse.Namespace, requests: list, tmp: Path) -> dict[str, object]:
    serve_args = shlex.split(args.serve_args)
    if variant == "ngram":
        serve_args += ["--speculative", "ngram", "--num-speculative-tokens", str(args.k)]
    server, target = serve(serve_args, dict(os.environ), args.log)
    try:
        figures: dict[str, object] = {}
        for concurrency in (1, 8):
            tok_s, decode_tok_s, outputs, counters = grounded(target, requests, concurrency)
            figures[f"b{concurrency}"], figures[f"tokens_b{concurrency}"] = tok_s, outputs
            figures[f"decode_b{concurrency}"] = decode_tok_s
            print(
                f"  {variant} grounded batch {concurrency}: {tok_s:.1f} output tok/s "
                f"({decode_tok_s:.1f} per request after its first token), {describe(counters)}",
                flush=True,
            )
        figures["w_mixed"] = throughput(target, shlex.split(args.bench_args), tmp)
        print(f"  {variant} W-mixed: {figures['w_mixed']:.1f} output tok/s", flush=True)
        return figures
    finally:
        stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--serve-args", default="--dtype bfloat16 --kv-cache-memory 1GiB")
    parser.add_argument(
        "--bench-args", default="--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"
    )
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_speculative.log")
    args = parser.parse_args()
    requests = grounded_requests(args.num_requests)
    runs: dict[str, list[dict[str, object]]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            shift = round_index % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                print(f"round {round_index + 1} {variant}:", flush=True)
                runs[variant].append(run_variant(variant, args, requests, Path(tmp)))
    labels = {
        "b1": "grounded batch 1",
        "decode_b1": "grounded batch 1, after the first token",
        "b8": "grounded batch 8",
        "w_mixed": "W-mixed 64",
    }
    for key, label in labels.items():
        medians = {v: statistics.median(float(r[key]) for r in runs[v]) for v in VARIANTS}  # type: ignore[arg-type]
        print(
            f"{label}: off {medians['off']:.1f}, ngram {medians['ngram']:.1f} output tok/s "
            f"-> {medians['ngram'] / medians['off']:.2f}x"
        )
    # Greedy bf16 tokens can change with the rows a step computes (near-ties of the GEMMs' rounding);
    # plain decoding at batch 1 vs batch 8 shows that variance without any draft.
    pairs = {
        "off vs ngram, batch 1": (runs["off"][0]["tokens_b1"], runs["ngram"][0]["tokens_b1"]),
        "off vs ngram, batch 8": (runs["off"][0]["tokens_b8"], runs["ngram"][0]["tokens_b8"]),
        "off batch 1 vs off batch 8": (runs["off"][0]["tokens_b1"], runs["off"][0]["tokens_b8"]),
    }
    for label, (first, second) in pairs.items():
        same = sum(a == b for a, b in zip(first, second))  # type: ignore[call-overload]
        print(f"{label}: {same} of {len(first)} requests gave the same tokens")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
