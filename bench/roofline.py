"""Where W-mixed's time goes on this CPU, against the machine's limits (a benchmark, never a test).

1. Peaks, measured by bench/roofline_probe.c (compiled here with the system gcc): the matrix instructions'
   throughput (``vdpbf16ps``, ``vpdpbusd``; AMX ``tdpbf16ps`` / ``tdpbusd`` where the CPU has them; on a CPU
   with AVX2 alone ``vfmadd231ps``, what bf16 runs as there, and the AVX2 int8 kernel's four-instruction
   product) on one core and on all, and read / copy bandwidth over a buffer far larger than the L3, on 4 KiB
   and 2 MiB pages.
   The best of every repeat of ``--rounds`` rounds (each the probes, then the kernels); the spread is printed.
2. Pagoda's kernels at W-mixed's shapes: the bf16 and int8 (``executor_svc.quant`` int8 mode) panel GEMMs of
   SmolLM2-135M's layers over 30 layers of distinct weights (so they stream from memory as in a step); paged
   decode attention (batch 64, each sequence's blocks in order or scattered) in bytes/s and paged prefill
   attention (one 512-token prompt) in FLOP/s, over bf16 and int8 KV caches. Each call timed, the best of its
   ``--repeats`` passes a round over all rounds.
3. W-mixed stepped through the real scheduler (``scheduler_svc.core``, one plan at a time): a fresh server's
   first run, and a repeat whose prompts the prefix cache holds (what ``pagoda bench``'s steady runs are).
   Per step max(FLOPs at the peak, bytes at the read bandwidth), summed, is the floor; the same steps timed
   with (2)'s rates, summed, are what the kernels alone would take ("kernel-achievable").

Assumptions of the floor: every FLOP of the linear layers (2 x params x tokens; the LM head only for rows
that sample) at the all-core peak of the instruction the GEMM runs on (bf16: AMX or ``vdpbf16ps``, AVX2
alone ``vfmadd231ps``; int8: AMX-INT8 or ``vpdpbusd``, AVX2 alone its product), attention FLOPs (QK^T and
PV: 4 x heads x head_dim per query-key pair and layer) at the bf16 peak, both together on the same units;
bytes: every weight once a step (LM head only when a row samples), every KV row each sequence attends to read
once and each new one written once, at the best all-core read bandwidth; activations, norms, embeddings,
sampling, Python and thread fork/join cost nothing.
Kernel-achievable: GEMM time interpolated between the measured rows, decode attention at the measured bytes/s
(blocks in order; scattered printed beside) of the step's mean context, prefill attention at the measured
FLOP/s; nothing else.

Usage: python bench/roofline.py [--measured-tok-s bf16=N,int8=N] [--measured-steady-tok-s bf16=N,int8=N]
    [--rounds 3] [--repeats 2] [--buffer-mib 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_kv_kernels import make_caches

from executor_svc.attention.cpp_backend import TOKEN_ROWS_MAX_CONTEXT
from executor_svc.attention.metadata import PrefillSpan
from executor_svc.attention.sdpa_prefill import SdpaPrefill
from executor_svc.models.layer_ops import get_layer_ops
from executor_svc.native import loader
from executor_svc.quant.modes import MODES, Target
from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import SeqOutput, StepResult
from pagoda_bench.workload import BenchRequest, random_workload
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence

# SmolLM2-135M.
HIDDEN, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB = 576, 30, 9, 3, 64, 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
LM_HEAD = (VOCAB, HIDDEN)
LINEAR_PARAMS = NUM_LAYERS * sum(n * k for n, k in SHAPES.values())
LINEAR_OUT = NUM_LAYERS * sum(n for n, _ in SHAPES.values())
ATTN_FLOPS_PER_PAIR = 4 * NUM_HEADS * HEAD_DIM * NUM_LAYERS  # QK^T and PV, all layers

# W-mixed: prompts, outputs, seed; the scheduler's limits and the KV budget it is served with.
NUM_PROMPTS, PROMPT_RANGE, OUTPUT_RANGE, SEED = 64, (16, 512), (16, 256), 0
MAX_NUM_SEQS, MAX_BATCHED_TOKENS, KV_CACHE_BYTES = 64, 2048, 1 << 30

GEMM_ROWS = (1, 16, 32, 64, 128, 512, 2048)  # decode batches and prefill chunks
MAX_SAMPLED_ROWS = 128  # the LM head runs on sampled rows only
PREFILL_GEMM_LAYERS = 4
CONTEXTS = (128, 256, 512, 768)
DECODE_BATCH, PREFILL_CHUNK = 64, 512
PROBE = Path(__file__).with_name("roofline_probe.c")
PROBE_REPEATS = 6  # a round's repeats of each probe (0.1 s each for the compute ones)
INSTRUCTIONS = {
    "bf16": "vdpbf16ps",
    "vnni": "vpdpbusd",
    "amx": "tdpbf16ps",
    "amx_int8": "tdpbusd",
    "fma": "vfmadd231ps",
    "avx2_int8": "vpmaddubsw+",  # vpsignb, vpmaddubsw, vpmaddwd, vpaddd: the AVX2 int8 kernel's product
}
PROBE_NEEDS = {
    "bf16": {"avx512_bf16"},
    "vnni": {"avx512_vnni"},
    "amx": {"amx_bf16"},
    "amx_int8": {"amx_int8"},
    "fma": {"avx2", "fma"},
    "avx2_int8": {"avx2", "fma"},
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one W-mixed configuration reads and runs on (bf16: bf16 weights and KV; int8: int8 both)."""

    name: str
    weight_bytes: int  # per weight element
    scale_bytes: int  # per output channel
    kv_row_bytes: int  # one (token, kv head) row of K or of V, its scale included
    kv_block_size: int  # the CPU default
    gemm_probes: tuple[str, ...]  # the instruction its GEMMs run on, in the order the kernels prefer them

    def weight_bytes_of(self, params: int, out_features: int) -> int:
        return params * self.weight_bytes + out_features * self.scale_bytes

    @property
    def kv_token_bytes(self) -> int:
        """K and V of one token, all layers."""
        return NUM_LAYERS * 2 * NUM_KV_HEADS * self.kv_row_bytes


# On a CPU with AVX2 alone the bf16 GEMMs run fp32 FMAs (bf16 weights widened to fp32 panels) and the int8
# ones the AVX2 product; the floor still counts bf16 weights' 2 bytes, what the model needs to read.
VARIANTS = (
    Variant("bf16", 2, 0, 2 * HEAD_DIM, 32, ("amx", "bf16", "fma")),
    Variant("int8", 1, 4, HEAD_DIM + 4, 64, ("amx_int8", "vnni", "avx2_int8")),
)
BF16_PROBES = VARIANTS[0].gemm_probes  # attention FLOPs


# -- 1. the machine --------------------------------------------------------------------------------------


def cpu_info() -> tuple[str, frozenset[str], int, int]:
    """(model name, flags, usable threads, L3 bytes)."""
    first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    field = dict(
        (k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)
    )
    l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    l3_bytes = int(l3.read_text().strip().rstrip("K")) * 1024 if l3.exists() else 32 << 20
    return field["model name"], frozenset(field["flags"].split()), len(os.sched_getaffinity(0)), l3_bytes


def build_probe(flags: frozenset[str], folder: str) -> Path:
    """The probe compiled into ``folder``: the AVX-512 probes (and AMX's where the CPU has AMX), or on a CPU
    with AVX2 alone its probes only."""
    binary = Path(folder) / "roofline_probe"
    cflags = ["-O2", "-mavx2", "-mfma", "-fopenmp"]
    if {"avx512f", "avx512_bf16", "avx512_vnni"} <= flags:
        cflags += ["-mavx512f", "-mavx512bf16", "-mavx512vnni"]
    if {"amx_tile", "amx_bf16", "amx_int8"} <= flags:
        cflags += ["-mamx-tile", "-mamx-bf16", "-mamx-int8", "-DWITH_AMX"]
    subprocess.run(["gcc", *cflags, "-o", str(binary), str(PROBE)], check=True)
    return binary


def measure_peaks(binary: Path, flags: frozenset[str], threads: int, mib: int, peaks: dict[str, list[float]]):
    """One round of every probe this CPU runs, 1 thread and all; each repeat's value appended to ``peaks``."""
    for probe in (p for p, needs in PROBE_NEEDS.items() if needs <= flags):
        for n in sorted({1, threads}):
            peaks.setdefault(f"{probe} x{n}", []).extend(_run(binary, probe, n, PROBE_REPEATS))
    for kind, counts in (("read", sorted({1, threads})), ("copy", [threads])):
        for pages in ("4k", "huge"):
            for n in counts:
                peaks.setdefault(f"{kind} {pages} x{n}", []).extend(_run(binary, kind, n, PROBE_REPEATS, mib, pages))


def _run(binary: Path, *args) -> list[float]:
    out = subprocess.run([str(binary), *map(str, args)], check=True, capture_output=True, text=True).stdout
    return [float(v) for v in out.split()]


def compute_peak(peaks: dict[str, list[float]], probes: tuple[str, ...], threads: int) -> tuple[str, float]:
    """(probe, all-core G/s) of the first of ``probes`` this CPU ran: the best all-core repeat, or the best
    one-core repeat times the cores where that is more (cores share no unit these loops use; on a shared
    machine an all-core repeat rarely has every core to itself)."""
    probe = next(p for p in probes if f"{p} x{threads}" in peaks)
    return probe, max(max(peaks[f"{probe} x{threads}"]), threads * max(peaks[f"{probe} x1"]))


def read_bandwidth(peaks: dict[str, list[float]]) -> float:
    """The best read GB/s of any thread count and page size (bandwidth is shared: no scaling)."""
    return max(max(values) for key, values in peaks.items() if key.startswith("read"))


# -- 2. Pagoda's kernels ----------------------------------------------------------------------------------


def best_per_call(calls: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each call's best time over ``repeats`` passes over all of them (a busy moment costs one pass, not all)."""
    best = [math.inf] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def packed_weights(kernels, variant: Variant) -> tuple[Callable, list[tuple[str, object]]]:
    """(run(x, packed, out_features), [(shape, packed weight)]): 30 layers of distinct weights (so a decode step's
    stream from memory), then the LM head; packed as the executor packs them."""
    gen = torch.Generator().manual_seed(0)
    pack, run = _gemm_path(kernels, variant)
    weights = [(name, pack(_weight(shape, gen))) for _ in range(NUM_LAYERS) for name, shape in SHAPES.items()]
    return run, [*weights, ("lm_head", pack(_weight(LM_HEAD, gen)))]


def gemm_seconds(run: Callable, weights: list[tuple[str, object]], repeats: int) -> dict[tuple[str, int], float]:
    """(shape, rows) -> seconds a call, averaged over the layers.

    Prefill-sized calls (past 128 rows) take the first ``PREFILL_GEMM_LAYERS`` layers only: a weight read once
    serves so many rows that where it comes from hardly matters, and the run stays short.
    """
    gen = torch.Generator().manual_seed(1)
    shapes = {**SHAPES, "lm_head": LM_HEAD}
    seconds = {}
    for rows in GEMM_ROWS:
        x = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
        named = weights if rows <= MAX_SAMPLED_ROWS else weights[: PREFILL_GEMM_LAYERS * len(SHAPES)]
        calls = [lambda w=w, n=name, x=x[shapes[name][1]]: run(x, w, shapes[n][0]) for name, w in named]
        best = best_per_call(calls, 2 * repeats)
        for name in shapes:
            times = [t for (n, _), t in zip(named, best) if n == name]
            if times:
                seconds[name, rows] = sum(times) / len(times)
    return seconds


def _weight(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)


def _gemm_path(kernels, variant: Variant):
    """(pack(bf16 weight), run(x, packed, out_features)) as the executor builds and calls the layer."""
    if variant.name == "bf16":
        gemm = kernels.ops
        if gemm.bf16_kernels_ready():
            return gemm.pack_bf16, lambda x, p, n: gemm.linear_bf16(x, p, n, None)
        ops = get_layer_ops("cpp", torch.device("cpu"), torch.bfloat16)  # AVX2 alone: widened fp32 panels
        return ops.pack, lambda x, p, n: ops.linear(x, p)
    target = Target(torch.device("cpu"), torch.bfloat16, kernels, "auto")
    return (lambda w: MODES["int8"].quantize(w, target)), (lambda x, layer, n: layer(x))


def decode_seconds(ops, variant: Variant, context: int, l3_bytes: int, repeats: int) -> tuple[float, float]:
    """Seconds of one layer's decode attention, batch 64, every sequence at ``context`` tokens: (each sequence's
    blocks in order, as a fresh server allocates a prompt's; scattered at random, as a long-running server's
    free list and bench/bench_kv_kernels.py have them), the two taking turns.

    Enough layers of cache that a pass reads 4x the L3 (at most 30), so the rows come from memory.
    """
    layer_bytes = DECODE_BATCH * context * 2 * NUM_KV_HEADS * variant.kv_row_bytes
    num_layers = min(NUM_LAYERS, math.ceil(4 * l3_bytes / layer_bytes))
    blocks_per_seq = -(-context // variant.kv_block_size)
    num_blocks = DECODE_BATCH * blocks_per_seq
    caches = make_caches(variant.name, num_layers, num_blocks + 1, variant.kv_block_size)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(DECODE_BATCH, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)  # [B, H, D]
    in_order = torch.arange(num_blocks).view(DECODE_BATCH, blocks_per_seq)  # [B, blocks]
    scattered = torch.randperm(num_blocks, generator=gen).view(DECODE_BATCH, blocks_per_seq)
    lens = torch.full((DECODE_BATCH,), context)
    calls = [
        lambda c=c, t=t: ops.paged_decode(q, c.k, c.v, t, lens, HEAD_DIM**-0.5, 0, 0.0, c.k_scale, c.v_scale)
        for t in (in_order, scattered)
        for c in caches
    ]
    best = best_per_call(calls, repeats)
    return sum(best[:num_layers]) / num_layers, sum(best[num_layers:]) / num_layers


def prefill_seconds(ops, variant: Variant, repeats: int) -> float:
    """Seconds of one layer's prefill attention over one 512-token prompt (nothing cached): the C++ kernel, or
    where it does not run (no AMX-BF16 or AVX512-BF16) what the executor runs instead: the decode kernel with
    each token a row of its own (up to TOKEN_ROWS_MAX_CONTEXT tokens of context), else SDPA."""
    num_blocks = -(-PREFILL_CHUNK // variant.kv_block_size)
    caches = make_caches(variant.name, NUM_LAYERS, num_blocks, variant.kv_block_size)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(PREFILL_CHUNK, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty(PREFILL_CHUNK, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    tables, spans = torch.arange(num_blocks).view(1, num_blocks), torch.tensor([[0, PREFILL_CHUNK, 0, 0]])
    if ops.bf16_kernels_ready():
        calls = [
            lambda c=c: ops.paged_prefill(q, c.k, c.v, tables, spans, HEAD_DIM**-0.5, out, 0, 0.0, c.k_scale, c.v_scale)
            for c in caches
        ]
    elif PREFILL_CHUNK <= TOKEN_ROWS_MAX_CONTEXT:
        rows, lens = tables.expand(PREFILL_CHUNK, num_blocks).contiguous(), torch.arange(1, PREFILL_CHUNK + 1)
        calls = [
            lambda c=c: ops.paged_decode(q, c.k, c.v, rows, lens, HEAD_DIM**-0.5, 0, 0.0, c.k_scale, c.v_scale)
            for c in caches
        ]
    else:
        kv = torch.randn(2, PREFILL_CHUNK, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)  # fresh K/V
        span = PrefillSpan(0, 0, PREFILL_CHUNK, 0, num_blocks)
        sdpa = SdpaPrefill((span,), [None], [tables[0]])
        calls = [lambda c=c: sdpa.run(q, kv[0], kv[1], c, HEAD_DIM**-0.5, out) for c in caches]
    return sum(best := best_per_call(calls, repeats)) / len(best)


@dataclasses.dataclass(frozen=True)
class Rates:
    """A variant's kernels, measured: seconds a call."""

    gemm: dict[tuple[str, int], float]  # (shape, rows) -> one layer's call
    decode: dict[tuple[int, bool], float]  # (context, blocks scattered) -> one layer's decode attention, batch 64
    prefill: float  # one layer's prefill attention over one 512-token prompt


def measure_kernels(kernels, variant: Variant, gemms: tuple, l3_bytes: int, repeats: int) -> Rates:
    """One round of the variant's kernels (``gemms``: packed_weights' answer)."""
    decode = {}
    for context in CONTEXTS:
        decode[context, False], decode[context, True] = decode_seconds(
            kernels.ops, variant, context, l3_bytes, 2 * repeats
        )
    return Rates(gemm_seconds(*gemms, repeats), decode, prefill_seconds(kernels.ops, variant, repeats))


def fastest(a: Rates | None, b: Rates) -> Rates:
    """Each kernel's best of two rounds."""
    if a is None:
        return b
    return Rates(
        {key: min(t, b.gemm[key]) for key, t in a.gemm.items()},
        {key: min(t, b.decode[key]) for key, t in a.decode.items()},
        min(a.prefill, b.prefill),
    )


# -- 3. W-mixed, step by step -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """What one planned step computes."""

    num_tokens: int
    num_sampled: int  # rows that run the LM head
    decode_contexts: tuple[int, ...]  # KV tokens each one-token row attends to (its own included)
    prefill_chunks: tuple[tuple[int, int], ...]  # (tokens cached before, tokens in the chunk)

    @property
    def attention_pairs(self) -> tuple[int, int]:
        """(decode, prefill) query-key pairs (causal within a chunk)."""
        prefill = sum(n * cached + n * (n + 1) // 2 for cached, n in self.prefill_chunks)
        return sum(self.decode_contexts), prefill

    @property
    def kv_tokens(self) -> int:
        """KV tokens read (every context row once) and written (the step's own)."""
        read = sum(self.decode_contexts) + sum(cached + n for cached, n in self.prefill_chunks)
        return read + self.num_tokens


def w_mixed_steps(variant: Variant, prompts_cached: bool) -> list[Step]:
    """W-mixed's steps as the scheduler plans them (one plan in flight), all 64 requests arriving at once.

    ``prompts_cached``: the workload's second run on the same server (``pagoda bench``'s steady runs), each
    prompt's full blocks served from the prefix cache that the first run filled (1 GiB of KV, as served).
    """
    requests = random_workload(NUM_PROMPTS, PROMPT_RANGE, OUTPUT_RANGE, SEED, VOCAB)
    config = SchedulerConfig(
        num_blocks=KV_CACHE_BYTES // (variant.kv_block_size * variant.kv_token_bytes),
        block_size=variant.kv_block_size,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=PROMPT_RANGE[1] + OUTPUT_RANGE[1],
    )
    scheduler = Scheduler(config)
    if prompts_cached:
        _run_workload(scheduler, requests, 0)
    return _run_workload(scheduler, requests, len(requests) if prompts_cached else 0)


def _run_workload(scheduler: Scheduler, requests: list[BenchRequest], first_id: int) -> list[Step]:
    """Every step of ``requests`` to the end, each sampled token a fixed id (never a stop)."""
    greedy = SamplingParams(temperature=0.0)
    for r in requests:
        seq = SchedulerSequence(
            first_id + r.index,
            f"r{first_id + r.index}",
            list(r.prompt_token_ids),
            greedy,
            StoppingCriteria(r.output_len),
        )
        scheduler.add(seq)
    steps = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduled = [(s.seq_id, s.num_scheduled_tokens) for s in (*plan.new_seqs, *plan.scheduled_seqs)]
        seqs = [(scheduler.get(seq_id), n) for seq_id, n in scheduled]
        sampled = [seq.seq_id for seq, _ in seqs if seq.num_pending_tokens]
        steps.append(
            Step(
                sum(n for _, n in seqs),
                len(sampled),
                tuple(seq.num_computed_tokens for seq, n in seqs if n == 1),
                tuple((seq.num_computed_tokens - n, n) for seq, n in seqs if n > 1),
            )
        )
        outputs = tuple(SeqOutput(seq_id, (11,)) for seq_id in sampled)
        scheduler.update(StepResult(plan.step_id, "roofline", outputs))
    return steps


def floor_seconds(steps: list[Step], variant: Variant, gemm_peak: float, attn_peak: float, bw: float) -> dict:
    """The floor: per step max(FLOPs at the peaks, bytes at the read bandwidth), summed (peaks in G/s, GB/s).

    Also each part summed over all steps on its own (compute parts at their peak, byte parts at ``bw``)."""
    totals = dict.fromkeys(("floor", "GEMM FLOPs", "attention FLOPs", "weight bytes", "KV bytes"), 0.0)
    totals["compute-bound steps"] = 0
    head_bytes = variant.weight_bytes_of(LM_HEAD[0] * LM_HEAD[1], LM_HEAD[0])
    for step in steps:
        gemm_flops = 2 * (LINEAR_PARAMS * step.num_tokens + LM_HEAD[0] * LM_HEAD[1] * step.num_sampled)
        parts = {
            "GEMM FLOPs": gemm_flops / gemm_peak / 1e9,
            "attention FLOPs": ATTN_FLOPS_PER_PAIR * sum(step.attention_pairs) / attn_peak / 1e9,
            "weight bytes": (variant.weight_bytes_of(LINEAR_PARAMS, LINEAR_OUT) + head_bytes * bool(step.num_sampled))
            / bw
            / 1e9,
            "KV bytes": step.kv_tokens * variant.kv_token_bytes / bw / 1e9,
        }
        compute, memory = parts["GEMM FLOPs"] + parts["attention FLOPs"], parts["weight bytes"] + parts["KV bytes"]
        for name, seconds in parts.items():
            totals[name] += seconds
        totals["floor"] += max(compute, memory)
        totals["compute-bound steps"] += compute >= memory
    return totals


def kernel_seconds(steps: list[Step], variant: Variant, rates: Rates) -> dict:
    """The kernels alone: each step's GEMMs and attention at the rates measured for them, summed by kind."""
    rows = np.array(GEMM_ROWS, dtype=float)
    per_call = [np.array([rates.gemm[name, r] for r in GEMM_ROWS]) for name in SHAPES]
    head_rows = [r for r in GEMM_ROWS if r <= MAX_SAMPLED_ROWS]
    head = np.array([rates.gemm["lm_head", r] for r in head_rows])
    contexts = np.array(CONTEXTS, dtype=float)
    layer_bytes = [DECODE_BATCH * c * 2 * NUM_KV_HEADS * variant.kv_row_bytes for c in CONTEXTS]
    decode_bps = {
        scattered: np.array([b / rates.decode[c, scattered] for b, c in zip(layer_bytes, CONTEXTS)])
        for scattered in (False, True)
    }
    prefill_flops_s = 4 * NUM_HEADS * HEAD_DIM * PREFILL_CHUNK * (PREFILL_CHUNK + 1) / 2 / rates.prefill
    names = ("GEMM, steps with prompt chunks", "GEMM, decode-only steps", "LM head", "decode attention")
    totals = dict.fromkeys((*names, "prefill attention", "decode attention if scattered"), 0.0)
    for step in steps:
        gemm = NUM_LAYERS * sum(np.interp(step.num_tokens, rows, t) for t in per_call)
        totals[names[0] if step.prefill_chunks else names[1]] += gemm
        if step.num_sampled:  # at most MAX_NUM_SEQS rows sample, within the measured ones
            totals["LM head"] += np.interp(step.num_sampled, head_rows, head)
        decode_pairs, prefill_pairs = step.attention_pairs
        if step.decode_contexts:
            mean_context = decode_pairs / len(step.decode_contexts)
            bytes_read = decode_pairs * variant.kv_token_bytes
            totals["decode attention"] += bytes_read / np.interp(mean_context, contexts, decode_bps[False])
            totals["decode attention if scattered"] += bytes_read / np.interp(mean_context, contexts, decode_bps[True])
        totals["prefill attention"] += ATTN_FLOPS_PER_PAIR * prefill_pairs / prefill_flops_s
    totals["kernels"] = sum(v for k, v in totals.items() if k != "decode attention if scattered")
    return totals


# -- the report -------------------------------------------------------------------------------------------


def print_peaks(peaks: dict[str, list[float]]) -> None:
    print("peaks (best; spread over all repeats of all rounds):")
    for key, values in peaks.items():
        probe, threads = key.rsplit(" x", 1)
        label = INSTRUCTIONS.get(probe, probe)
        unit = (
            "GB/s"
            if probe.startswith(("read", "copy"))
            else "GOP/s"
            if "int8" in probe or probe in ("vnni", "avx2_int8")
            else "GFLOP/s"
        )
        print(f"  {label:<14} {threads} thr  {max(values):8.1f} {unit:<8} [{min(values):.1f}-{max(values):.1f}]")


def print_gemms(gemm: dict, variant: Variant, instruction: str, peak: float, bw: float) -> None:
    print(
        f"{variant.name} GEMMs, G(FL)OP/s, % of {instruction}'s {peak:.0f}, and the weights' bytes/s as % of "
        f"{bw:.1f} GB/s (b), by rows:"
    )
    print(f"  {'shape':<16}" + "".join(f"{r:>16}" for r in GEMM_ROWS))
    for name, (n, k) in {**SHAPES, "lm_head": LM_HEAD}.items():
        cells = []
        for rows in GEMM_ROWS:
            if (name, rows) not in gemm:
                cells.append(f"{'':>16}")
                continue
            t = gemm[name, rows]
            flops, weight_gbs = 2 * rows * n * k / t / 1e9, variant.weight_bytes_of(n * k, n) / t / 1e9
            cells.append(f"{flops:6.0f} {100 * flops / peak:3.0f}%{100 * weight_gbs / bw:4.0f}%b")
        print(f"  {name + f' {n}x{k}':<16}" + "".join(cells))


def print_attention(variant: Variant, rates: Rates, bw: float, peak: float) -> None:
    for scattered in (False, True):
        cells = []
        for context in CONTEXTS:
            seconds = rates.decode[context, scattered]
            gbs = DECODE_BATCH * context * 2 * NUM_KV_HEADS * variant.kv_row_bytes / seconds / 1e9
            cells.append(f"ctx {context} {seconds * 1e6:.0f} us {gbs:.1f} GB/s ({100 * gbs / bw:.0f}%)")
        blocks = "scattered" if scattered else "in order"
        print(
            f"{variant.name} KV decode attention, batch {DECODE_BATCH}, blocks {blocks}, a layer: " + ", ".join(cells)
        )
    flops = 4 * NUM_HEADS * HEAD_DIM * PREFILL_CHUNK * (PREFILL_CHUNK + 1) / 2 / rates.prefill / 1e9
    print(
        f"{variant.name} KV prefill attention, {PREFILL_CHUNK} tokens, a layer: {rates.prefill * 1e6:.0f} us, "
        f"{flops:.0f} GFLOP/s ({100 * flops / peak:.0f}% of {peak:.0f})"
    )


def print_floors(steps: list[Step], label: str, floor: dict, kernels: dict, measured: float | None) -> None:
    num_output = sum(step.num_sampled for step in steps)
    print(f"W-mixed {label}: {len(steps)} steps, {sum(s.num_tokens for s in steps)} tokens computed")
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in floor.items() if k not in ("floor", "compute-bound steps"))
    print(
        f"  floor {floor['floor']:.2f} s = {num_output / floor['floor']:.0f} tok/s; "
        f"{floor['compute-bound steps']} steps compute-bound; each part alone: {parts}"
    )
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in kernels.items() if k != "kernels")
    print(f"  kernel-achievable {kernels['kernels']:.2f} s = {num_output / kernels['kernels']:.0f} tok/s ({parts})")
    if measured:
        run_s = num_output / measured
        print(
            f"  measured {measured:.0f} tok/s = {run_s:.2f} s: {100 * floor['floor'] / run_s:.0f}% of the floor's "
            f"tok/s, {100 * kernels['kernels'] / run_s:.0f}% of kernel-achievable's; outside the kernels "
            f"{run_s - kernels['kernels']:.2f} s"
        )


def _per_variant(text: str) -> dict[str, float]:
    """``bf16=500,int8=680`` -> {"bf16": 500.0, "int8": 680.0}."""
    return {k: float(v) for k, v in (item.split("=") for item in filter(None, text.split(",")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--measured-tok-s", default="", help="Pagoda's W-mixed output tok/s, a fresh server's first run: bf16=N,int8=N"
    )
    parser.add_argument(
        "--measured-steady-tok-s", default="", help="the same, later runs on that server (prompts in the prefix cache)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the probes and kernels (best taken)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the kernels a round (best per call)")
    parser.add_argument("--buffer-mib", type=int, default=1024, help="the bandwidth probes' buffer")
    args = parser.parse_args()
    measured = {False: _per_variant(args.measured_tok_s), True: _per_variant(args.measured_steady_tok_s)}
    model, flags, threads, l3_bytes = cpu_info()
    kernels = loader.kernels()
    if kernels is None or not ({"avx512f", "avx512_bf16", "avx512_vnni"} <= flags or {"avx2", "fma"} <= flags):
        raise SystemExit("needs AVX-512 (BF16, VNNI) or AVX2 + FMA, and the installed C++ kernels (make install)")
    print(
        f"CPU {model}: {threads} threads, L3 {l3_bytes >> 20} MiB, torch threads {torch.get_num_threads()}; "
        f"flags {' '.join(sorted(f for f in flags if f.startswith(('avx512', 'amx', 'avx2', 'fma'))))}"
    )
    load_at_start = os.getloadavg()[0]
    peaks: dict[str, list[float]] = {}
    rates: dict[str, Rates] = {}
    with tempfile.TemporaryDirectory() as folder:
        binary = build_probe(flags, folder)
        gemms = {variant.name: packed_weights(kernels, variant) for variant in VARIANTS}
        for _ in range(args.rounds):  # rounds ~30 s apart: a busy spell of the machine spoils one, not all
            measure_peaks(binary, flags, threads, args.buffer_mib, peaks)
            for variant in VARIANTS:
                round_rates = measure_kernels(kernels, variant, gemms[variant.name], l3_bytes, args.repeats)
                rates[variant.name] = fastest(rates.get(variant.name), round_rates)
    print(
        f"load average (1 min) {load_at_start:.2f} at the start (other work: above ~0.1 it shared the cores), "
        f"{os.getloadavg()[0]:.2f} at the end (this run's own included); figures are the best of their repeats"
    )
    print_peaks(peaks)
    bw = read_bandwidth(peaks)
    attn_probe, attn_peak = compute_peak(peaks, BF16_PROBES, threads)
    print(f"  floor uses: read {bw:.1f} GB/s; attention at {INSTRUCTIONS[attn_probe]} {attn_peak:.0f} GFLOP/s")
    for variant in VARIANTS:
        probe, gemm_peak = compute_peak(peaks, variant.gemm_probes, threads)
        print_gemms(rates[variant.name].gemm, variant, INSTRUCTIONS[probe], gemm_peak, bw)
        print_attention(variant, rates[variant.name], bw, attn_peak)
    for variant in VARIANTS:
        _, gemm_peak = compute_peak(peaks, variant.gemm_probes, threads)
        for cached in (False, True):
            steps = w_mixed_steps(variant, cached)
            label = f"{variant.name}, " + ("repeated (prompts in the prefix cache)" if cached else "first run")
            floor = floor_seconds(steps, variant, gemm_peak, attn_peak, bw)
            kernel = kernel_seconds(steps, variant, rates[variant.name])
            print_floors(steps, label, floor, kernel, measured[cached].get(variant.name))


if __name__ == "__main__":
    main()
