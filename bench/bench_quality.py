"""Quality of the quantized modes, served side by side: perplexity over a fixed text through the server's
logprobs, greedy agreement with the first mode, and each executor's memory.

Usage:
    python bench/bench_quality.py [--model DIR] [--modes bf16,int8-w,int8-kv,int8-w+kv,gguf,q4_0] \\
        [--mode NAME="EXECUTOR FLAGS"] \\
        [--text bench/data/perplexity.txt] [--max-tokens 2048] [--segment 512] [--chunk 128] [--concurrency 4] \\
        [--prompts 16] [--new-tokens 64]

Each mode is a system started by the launcher (one executor, one scheduler, on 127.0.0.1) with the mode's
executor flags; the modes run one after the other on the same text and prompts. Another quantized mode joins
by a line in ``MODES`` (or ``--mode``). ``gguf`` serves the default model's GGUF file (SmolLM2's Q4_1) with its
blocks as stored; the other modes serve the checkpoint folder (``--model``, default: that file dequantized once),
``q4_0`` quantizing it to Q4_0 blocks at load.

- Perplexity: the text's tokens in segments of ``--segment``; one request per segment with ``prompt_logprobs``
  (each token's logprob given the segment's tokens before it; the first is not scored), computed by the server
  in prefill chunks of at most ``--chunk`` tokens, so chunks after the first read the segment's earlier tokens
  from the KV cache, as chunked prompts do.
- Text top-1: the share of those positions where the mode's most likely next token (the top alternative) is the
  first mode's.
- Agreement: greedy chat answers (``--new-tokens``) to ``--prompts`` fixed questions, against the first mode's:
  how many are identical, and the share of tokens before the first difference.
- Memory: the executor's resident set after the run, and its KV capacity in tokens (Describe).
SIGTERM or Ctrl-C stops the running system (the launcher kills its process groups).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
from stop_signals import stop_on_signals

from executor_svc.loading.model_cache import default_gguf_path
from pagoda.launch.launcher import Launcher
from pagoda.v1 import executor_pb2, executor_pb2_grpc
from pagoda_client import Client

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "fp32": "--dtype float32",
    "bf16": "--dtype bfloat16",
    "int8-kv": "--dtype bfloat16 --kv-cache-dtype int8",
    "int8-w": "--dtype bfloat16 --quantization int8",
    "int8-w+kv": "--dtype bfloat16 --quantization int8 --kv-cache-dtype int8",
    "gguf": "--dtype bfloat16 --quantization gguf",
    "q4_0": "--dtype bfloat16 --quantization q4_0",
}
# Modes that serve the default model's GGUF file instead of --model.
GGUF_FILE_MODES = ("gguf",)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue in one paragraph.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish, French and German.",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Write a short poem about a lighthouse keeper.",
    "How does a bicycle stay upright?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What is the difference between a virus and a bacterium?",
    "Suggest five names for a black cat.",
    "Explain what a hash table is to a beginner.",
    "Why do leaves change colour in autumn?",
    "Describe a quiet morning in a small harbour town.",
    "What are the rules of tic-tac-toe?",
]


def parse_modes(args: argparse.Namespace) -> dict[str, str]:
    """Mode name -> executor flags: the chosen known modes, then the ones given as NAME=FLAGS."""
    modes = {name: MODES[name] for name in args.modes.split(",") if name}
    for given in args.mode:
        name, _, flags = given.partition("=")
        modes[name] = flags
    return modes


def segments(token_ids: list[int], length: int) -> list[list[int]]:
    """Non-overlapping segments of ``length`` tokens (a shorter last one if it has at least 2)."""
    parts = [token_ids[i : i + length] for i in range(0, len(token_ids), length)]
    return [part for part in parts if len(part) >= 2]


def segment_logprobs(client: Client, part: list[int]) -> tuple[list[float], list[int]]:
    """(log p(token i | tokens before it), the most likely token there) for the segment's tokens 1, 2, ... (the
    server's prompt logprobs)."""
    result = client.generate(token_ids=part, max_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True)
    entries = result.prompt_logprobs
    if len(entries) != len(part) - 1 or any(e.sampled.token_id != t for e, t in zip(entries, part[1:])):
        raise RuntimeError(f"{len(entries)} prompt logprobs for a segment of {len(part)} tokens, or not its tokens")
    return [e.sampled.logprob for e in entries], [e.top[0].token_id for e in entries]


def perplexity(client: Client, parts: list[list[int]], concurrency: int) -> tuple[float, list[int]]:
    """(perplexity, the most likely token at each scored position) over the segments."""
    logprobs: list[float] = []
    best: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for lps, ids in pool.map(lambda part: segment_logprobs(client, part), parts):
            logprobs += lps
            best += ids
    return math.exp(-sum(logprobs) / len(logprobs)), best


def answers(client: Client, prompts: list[str], new_tokens: int, concurrency: int) -> list[list[int]]:
    """Greedy chat answers, their token ids."""

    def one(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        return client.chat(messages, max_tokens=new_tokens, temperature=0, ignore_eos=True).token_ids

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def agreement(reference: list[list[int]], mine: list[list[int]]) -> tuple[int, float]:
    """(identical answers, share of tokens before each answer's first difference)."""
    same, before = 0, 0
    for a, b in zip(reference, mine):
        same += a == b
        before += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same, before / sum(len(a) for a in reference)


def executor_memory(system: Launcher) -> tuple[float, int]:
    """(executor RSS in MiB, KV capacity in tokens) of the first executor."""
    status = Path(f"/proc/{system.executor_pids[0]}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    with grpc.insecure_channel(system.executor_addresses[0]) as channel:
        info = executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=30)
    return rss_kib / 1024, info.num_kv_blocks * info.block_size


def run_mode(name: str, flags: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One mode's figures, from a fresh system (no offload tier: every prompt is computed by this mode)."""
    system = Launcher(
        str(default_gguf_path()) if name in GGUF_FILE_MODES else args.model,
        extra_executor_args=["--kv-cache-memory", args.kv_cache_memory, "--kv-offload-dir", "", *shlex.split(flags)],
        extra_scheduler_args=["--max-num-batched-tokens", str(args.chunk)],
        log_dir=logs,
        startup_timeout_s=600,
    )
    with system, Client(system.target, timeout=600) as client:
        info = client.model_info()
        token_ids = client.tokenize(args.text.read_text(encoding="utf-8"))[: args.max_tokens]
        ppl, best = perplexity(client, segments(token_ids, args.segment), args.concurrency)
        outputs = answers(client, QUESTIONS[: args.prompts], args.new_tokens, args.concurrency)
        rss_mib, capacity = executor_memory(system)
    return dict(
        ppl=ppl, best=best, outputs=outputs, rss_mib=rss_mib, capacity=capacity,
        quant=info.quantization, kv=info.kv_cache_dtype,
    )  # fmt: skip


def report(results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    base = results[names[0]]
    print(f"{'mode':<12}{'perplexity':>11}{'vs ' + names[0]:>12}{'text top-1':>11}{'identical':>11}", end="")
    print(f"{'agreement':>11}{'executor RSS':>14}{'KV tokens':>11}  weights / KV dtype")
    for name, r in results.items():
        same, share = agreement(base["outputs"], r["outputs"])
        identical = f"{same}/{len(r['outputs'])}"
        top1 = sum(a == b for a, b in zip(base["best"], r["best"])) / len(base["best"])
        print(
            f"{name:<12}{r['ppl']:>11.4f}{(r['ppl'] / base['ppl'] - 1) * 100:>+11.2f}%{top1 * 100:>10.1f}%"
            f"{identical:>11}{share * 100:>10.1f}%{r['rss_mib']:>10.0f} MiB{r['capacity']:>11}"
            f"  {r['quant']} / {r['kv']}"
        )
    print(
        f"({len(base['best'])} tokens scored; text top-1: positions whose most likely token is {names[0]}'s; "
        f"agreement: answer tokens before the first difference from {names[0]})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--modes", default="bf16,int8-w,int8-kv,int8-w+kv,gguf,q4_0", help=f"known modes: {', '.join(MODES)}"
    )
    parser.add_argument("--mode", action="append", default=[], help='another mode: NAME="EXECUTOR FLAGS"')
    parser.add_argument("--text", type=Path, default=ROOT / "bench" / "data" / "perplexity.txt")
    parser.add_argument("--max-tokens", type=int, default=2048, help="score at most this many tokens of the text")
    parser.add_argument("--segment", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128, help="the scheduler's prefill tokens per step")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help=f"agreement questions (at most {len(QUESTIONS)})")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_quality")
    args = parser.parse_args()
    stop_on_signals()  # SIGTERM / Ctrl-C: the running system's context manager stops its process groups
    results = {}
    for name, flags in parse_modes(args).items():
        print(f"{name}: {flags}", file=sys.stderr, flush=True)
        results[name] = run_mode(name, flags, args, args.log_dir / name)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
