"""Speculative decoding served, side by side in one run: off, n-gram drafts, and draft models.

Usage:
    python bench/bench_speculative.py [--variants off,ngram] [--rounds 2] [--num-requests 8] [--k K] \\
        [--phases b1,b8,w_mixed] [--serve-args "--dtype bfloat16 --kv-cache-memory 1GiB --kv-offload-dir ''"] \\
        [--bench-args "--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"]

Variants (each a fresh ``pagoda serve``; ``--speculative`` and, given ``--k`` or
``variant@K``, ``--num-speculative-tokens K`` are passed through to the scheduler,
``--draft-model`` to the executor):
- ``off``: no speculation;
- ``ngram``: prompt-lookup drafts;
- ``draft-small``: a random-weight draft model of SmolLM2's vocabulary, 2 layers
  of width 256 (bench/random_draft.py; for the mechanics: its drafts are random);
- ``draft-early``: the model's own first ``--early-layers`` layers (with its
  embeddings, final norm and head) as the draft model: smaller, and often right;
- ``draft-self``: the model drafting for itself (``--draft-model default``): the
  upper bound of acceptance, at the price of a second full model per draft;
- ``ngram+draft``: n-gram drafts, the random draft model where none matches.
Each round runs every variant (the order rotates per round, so drift on a
shared machine hits all alike). On each:
1. the input-grounded requests of ``spec_workload.py`` (quote a report, edit a
   module; greedy, up to 256 tokens) one at a time, then 8 at a time: output
   tokens/s, the decode rate after each request's first token, and the drafts
   accepted (from the scheduler's status);
2. W-mixed (``pagoda bench``: 64 requests at once, prompts 16-512, outputs 16-256).
Prints every run, the medians and the ratios to ``off``, and how many grounded
requests gave the same tokens as ``off``. SIGTERM or Ctrl-C stops the server
it started (its whole process group) before exiting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from ab_serve import _free_port, _wait_ready
from bench_structured_serve import throughput
from draft_models import build_random_draft, build_truncated_draft
from spec_workload import grounded_requests

from pagoda_client import Client, GenerationResult

# Status counters of speculation (totals, and of the draft model's drafts).
COUNTERS = (
    "spec_num_drafts_total",
    "spec_draft_tokens_total",
    "spec_accepted_tokens_total",
    "spec_model_num_drafts_total",
    "spec_model_draft_tokens_total",
    "spec_model_accepted_tokens_total",
)
VARIANTS = ("off", "ngram", "draft-small", "draft-early", "draft-self", "ngram+draft")
_servers: list[subprocess.Popen[bytes]] = []


def variant_args(variant: str, k: int | None, drafts: dict[str, Path]) -> list[str]:
    """The ``pagoda serve`` flags of a variant (``drafts``: the draft model folders built for the run);
    ``variant@K`` gives it its own K; no K: the server's defaults (8 for n-gram, 4 for the draft model)."""
    variant, _, own_k = variant.partition("@")
    k = int(own_k) if own_k else k
    if variant == "off":
        return []
    method = "ngram" if variant == "ngram" else "ngram+draft" if variant == "ngram+draft" else "draft"
    args = ["--speculative", method, *(["--num-speculative-tokens", str(k)] if k else [])]
    if variant == "draft-self":
        return ["--draft-model", "default", *args]
    if variant in ("draft-small", "ngram+draft"):
        return ["--draft-model", str(drafts["random"]), *args]
    if variant == "draft-early":
        return ["--draft-model", str(drafts["early"]), *args]
    return args


def build_drafts(variants: list[str], early_layers: int, root: Path) -> dict[str, Path]:
    """The draft model folders the variants need, built from the default model."""
    from executor_svc.loading.model_cache import resolve_model

    target = Path(resolve_model("default"))
    drafts = {}
    names = {v.partition("@")[0] for v in variants}
    if {"draft-small", "ngram+draft"} & names:
        drafts["random"] = build_random_draft(target, root / "random-draft")
    if "draft-early" in names:
        drafts["early"] = build_truncated_draft(target, root / "early-draft", early_layers)
    return drafts


def counters(client: Client) -> dict[str, int]:
    status = client.status()
    return {name: getattr(status, name) for name in COUNTERS}


def grounded(target: str, requests: list, concurrency: int) -> tuple[float, float, list[list[int]], dict[str, int]]:
    """(output tokens/s, decode tokens/s, each request's tokens, speculation counters) at ``concurrency``.

    Decode tokens/s: the tokens after the first over the time after the first (server timings),
    summed over the requests: the prefill left out.
    """
    with Client(target, timeout=600) as client:
        before = counters(client)

        def one(messages: list) -> GenerationResult:
            return client.chat(messages, max_tokens=256, temperature=0)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, requests))
        elapsed = time.perf_counter() - start
        after = counters(client)
    outputs = [r.token_ids for r in results]
    decode_s = sum(r.timings.total_s - r.timings.time_to_first_token_s for r in results)
    decode_tok_s = sum(len(o) - 1 for o in outputs) / decode_s
    return sum(len(o) for o in outputs) / elapsed, decode_tok_s, outputs, _diff(after, before)


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in COUNTERS}


def describe(c: dict[str, int]) -> str:
    """Acceptance (accepted / drafted) and tokens per verify step, by source."""
    parts = []
    ngram = [
        c[f"spec_{n}"] - c[f"spec_model_{n}"]
        for n in ("num_drafts_total", "draft_tokens_total", "accepted_tokens_total")
    ]
    model = [c[f"spec_model_{n}"] for n in ("num_drafts_total", "draft_tokens_total", "accepted_tokens_total")]
    for source, (drafts, drafted, accepted) in (("n-gram", ngram), ("draft model", model)):
        if drafts:
            parts.append(
                f"{source}: acceptance {accepted / drafted:.2f}, {1 + accepted / drafts:.2f} tokens/verify step"
            )
    return "; ".join(parts) or "no drafts"


def serve(serve_args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``pagoda serve`` on a free 127.0.0.1 port, in its own process group (tracked for SIGTERM), once ready."""
    port = _free_port()
    command = [sys.executable, "-m", "pagoda_client.cli", "serve", "--port", str(port), *serve_args]
    with open(log, "ab") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _servers.append(server)
    target = f"127.0.0.1:{port}"
    print(f"  waiting for {target} to be ready (log: {log})", flush=True)
    _wait_ready(Path(sys.executable).parent / "pagoda", target, server)
    return server, target


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (it drains), SIGKILL after 60 s."""
    if server in _servers:
        _servers.remove(server)
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:  # the group is gone already
        server.wait()


def run_variant(variant: str, args: argparse.Namespace, requests: list, tmp: Path, drafts: dict[str, Path]) -> dict:
    serve_args = shlex.split(args.serve_args) + variant_args(variant, args.k, drafts)
    server, target = serve(serve_args, args.log)
    try:
        figures: dict[str, object] = {}
        for concurrency in (c for c in (1, 8) if f"b{c}" in args.phases):
            tok_s, decode_tok_s, outputs, spec = grounded(target, requests, concurrency)
            figures[f"b{concurrency}"], figures[f"tokens_b{concurrency}"] = tok_s, outputs
            figures[f"decode_b{concurrency}"] = decode_tok_s
            print(
                f"  {variant} grounded batch {concurrency}: {tok_s:.1f} output tok/s "
                f"({decode_tok_s:.1f} per request after its first token), {describe(spec)}",
                flush=True,
            )
        if "w_mixed" in args.phases:
            with Client(target, timeout=60) as client:
                before = counters(client)
                figures["w_mixed"] = throughput(target, shlex.split(args.bench_args), tmp)
                spec = _diff(counters(client), before)
            print(f"  {variant} W-mixed: {figures['w_mixed']:.1f} output tok/s, {describe(spec)}", flush=True)
        return figures
    finally:
        stop(server)


def _stop_servers(signum: int, frame: FrameType | None) -> None:
    """SIGTERM: kill the server this run started (its whole process group), then exit."""
    for server in list(_servers):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
    sys.exit(128 + signum)


def report(runs: dict[str, list[dict]], variants: list[str]) -> None:
    labels = {
        "b1": "grounded batch 1",
        "decode_b1": "grounded batch 1, after the first token",
        "b8": "grounded batch 8",
        "w_mixed": "W-mixed 64",
    }
    for key, label in labels.items():
        if key not in runs[variants[0]][0]:
            continue
        medians = {v: statistics.median(float(r[key]) for r in runs[v]) for v in variants}
        base = medians.get("off")
        cells = [f"{v} {m:.1f}" + (f" ({m / base:.2f}x)" if base and v != "off" else "") for v, m in medians.items()]
        print(f"{label}, output tok/s: " + ", ".join(cells))
    # Greedy bf16 tokens can change with the rows a step computes (near-ties of the GEMMs' rounding);
    # plain decoding at batch 1 vs batch 8 shows that variance without any draft.
    if "off" in runs:
        off = runs["off"][0]
        pairs = {
            f"off vs {v}, batch {b}": (off[f"tokens_b{b}"], runs[v][0][f"tokens_b{b}"])
            for v in variants
            if v != "off"
            for b in (1, 8)
            if f"tokens_b{b}" in off
        }
        if "tokens_b1" in off and "tokens_b8" in off:
            pairs["off batch 1 vs off batch 8"] = (off["tokens_b1"], off["tokens_b8"])
        for label, (first, second) in pairs.items():
            same = sum(a == b for a, b in zip(first, second))
            print(f"{label}: {same} of {len(first)} requests gave the same tokens")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants", default="off,ngram", help=f"comma-separated, of {', '.join(VARIANTS)} (each may end in @K)"
    )
    parser.add_argument("--phases", default="b1,b8,w_mixed", help="of b1 (grounded, batch 1), b8, w_mixed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--k", type=int, default=None, help="--num-speculative-tokens (default: the server's)")
    parser.add_argument("--early-layers", type=int, default=8, help="draft-early: the model's first layers kept")
    # No offload tier: what a request costs must not depend on what earlier runs left on disk.
    parser.add_argument("--serve-args", default="--dtype bfloat16 --kv-cache-memory 1GiB --kv-offload-dir ''")
    parser.add_argument(
        "--bench-args", default="--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"
    )
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench_speculative.log")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := {v.partition("@")[0] for v in variants} - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    signal.signal(signal.SIGTERM, _stop_servers)
    requests = grounded_requests(args.num_requests)
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as tmp:
        drafts = build_drafts(variants, args.early_layers, Path(tmp))
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                print(f"round {round_index + 1} {variant}:", flush=True)
                runs[variant].append(run_variant(variant, args, requests, Path(tmp), drafts))
    report(runs, variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
