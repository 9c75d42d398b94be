"""Executor groups on the CPU (gloo): step time, communication per step and memory per rank, side by side.

Configurations, each rank a process (torch.multiprocessing spawn): T=1 P=1 on one thread (the reference), T=2
P=1 and T=1 P=2 on one thread per rank, T=1 P=1 on two threads (as many cores as T=2), and with ``--with-2x2``
T=2 P=2. ``--pin`` puts rank r on core r (mod the cores), a two-thread rank on two: one core each for sure, but
on a machine others are using every collective then waits for its core's other work (gloo all-reduces of 2 KiB
took 2.4 ms pinned against 0.4 ms unpinned on a 2-core machine under a load of 2.3).

The leader shares every plan with its ranks as a served group does (executor_svc.parallel.group); the plans are
those of a minimal scheduler: a prefill chunk of N tokens (one new sequence a step), and decode steps of B
sequences at context C (placed at C as prefix-cache hits over zeroed KV blocks, so no prompt is computed first;
each step reads C keys a sequence as a real decode).

Communication is counted in the ranks by wrapping torch.distributed's calls (the product code is unchanged) and
printed next to the arithmetic model: per micro-batch a tensor-parallel rank all-reduces 2 x its layers (+1 for
the embedding on the first stage) of tokens x hidden x 4 bytes (gloo sums fp32), the last stage gathers
sampled rows x vocabulary x 4 bytes of logits on its first rank (each other rank sends its slice), and each
stage but the last sends tokens x hidden x dtype bytes; the plan broadcast and the sampled tokens' share are
pickles. Memory: each rank's RSS after loading, the bytes
of its model's tensors and of its KV cache (every rank sized for the same blocks).

A model whose heads the tensor-parallel size does not divide (SmolLM2-135M: 9 heads, 3 KV heads) runs, in every
configuration, as a copy padded with zero heads (zero q/k/v rows, zero o_proj columns; 12 heads, 4 KV heads):
the same function (the same greedy tokens), about 7% more multiply-adds a token and a third more attention heads,
and a split the group accepts.

    .venv/bin/python bench/bench_parallel.py [--model DIR] [--dtype bfloat16] [--with-2x2]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pickle
import random
import shutil
import statistics
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor_svc.loading.model_cache import resolve_model
from pagoda import step as t
from pagoda.params import SamplingParams
from pagoda.runtime.ports import free_port

BLOCK_SIZE = 16
GROUP_TIMEOUT_S = 120.0
PER_LAYER = "per-layer decode"  # the T=1 reference again, on the decode path of group ranks


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to run the model: tensor- and pipeline-parallel sizes, intra-op threads per rank."""

    tp: int
    pp: int
    threads: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        return f"T={self.tp} P={self.pp} {self.threads} thr"


@dataclasses.dataclass(frozen=True)
class Workload:
    """What each timed step computes: ``num_seqs`` sequences, ``num_tokens`` tokens, one sampled row each."""

    name: str
    num_seqs: int
    num_tokens: int
    context: int  # decode: the context of the first step; 0: a prefill chunk of num_tokens (one sequence)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every rank of every configuration is given."""

    model_path: str
    dtype: str
    workloads: tuple[Workload, ...]
    num_warmup: int
    num_steps: int
    num_blocks: int  # the KV pool every rank holds
    cores: tuple[int, ...]  # to pin the ranks to; (): not pinned


# -- the plans (the leader's minimal scheduler) ------------------------------


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def decode_blocks_per_seq(work: Workload, setup: Setup) -> int:
    return blocks_for(work.context + setup.num_warmup + setup.num_steps + 2)


def build_plans(work: Workload, setup: Setup, step_ids, vocab_size: int) -> tuple[list, list]:
    """(untimed plans: placing the sequences and the warm-up; timed plans) of a workload."""
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0)
    steps = setup.num_warmup + setup.num_steps
    per_seq = decode_blocks_per_seq(work, setup) if work.context else 0

    def new(seq_id: int, num_tokens: int, num_blocks: int, num_computed: int) -> t.NewSequence:
        token_ids = tuple(rng.randrange(3, vocab_size) for _ in range(num_tokens))
        block_ids = tuple(range(seq_id * per_seq, seq_id * per_seq + num_blocks))  # prefill: always from 0
        num_scheduled = num_tokens - num_computed
        return t.NewSequence(
            seq_id, f"r{seq_id}", token_ids, num_tokens, greedy, block_ids, num_computed, num_scheduled
        )

    if not work.context:  # a new sequence each step, on the blocks of the one it drops
        plans = [
            t.StepPlan(
                next(step_ids),
                new_seqs=(new(k, work.num_tokens, blocks_for(work.num_tokens), 0),),
                dropped_seq_ids=(k - 1,) if k else (),
            )
            for k in range(steps)
        ]
        return plans[: setup.num_warmup], plans[setup.num_warmup :]
    # Decode: sequence i on blocks i * per_seq onwards, placed at the context as prefix-cache hits.
    first = tuple(new(i, work.context, blocks_for(work.context), work.context - 1) for i in range(work.num_seqs))
    plans = [t.StepPlan(next(step_ids), new_seqs=first)]
    for k in range(1, steps + 1):  # step k computes position context + k - 1
        grown = blocks_for(work.context + k) > blocks_for(work.context + k - 1)
        scheduled = tuple(
            t.ScheduledSequence(i, 1, (i * per_seq + blocks_for(work.context + k) - 1,) if grown else ())
            for i in range(work.num_seqs)
        )
        plans.append(t.StepPlan(next(step_ids), scheduled_seqs=scheduled))
    return plans[: 1 + setup.num_warmup], plans[1 + setup.num_warmup :]


# -- counting the communication, in a rank ---------------------------------


class CommCounter:
    """This process's torch.distributed calls, per step plan: kind -> [calls, bytes] (step None: outside a step).

    ``install`` wraps the calls the product makes (collectives.py); the object broadcasts are measured by the
    tensors torch sends for them (the size and the pickled bytes).
    """

    def __init__(self) -> None:
        self.step_id: int | None = None
        self.by_step: dict[int | None, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self._object_bytes = 0

    def add(self, kind: str, num_bytes: int) -> None:
        entry = self.by_step[self.step_id][kind]
        entry[0] += 1
        entry[1] += num_bytes

    def install(self) -> None:
        from executor_svc.parallel.group import PING

        c10d = dist.distributed_c10d
        all_reduce, gather, isend, recv = dist.all_reduce, dist.gather, dist.isend, dist.recv
        broadcast, broadcast_object_list = c10d.broadcast, dist.broadcast_object_list

        def counted_all_reduce(tensor, *args, **kwargs):
            self.add("all_reduce", tensor.nbytes)
            return all_reduce(tensor, *args, **kwargs)

        def counted_gather(tensor, gather_list=None, *args, **kwargs):  # the dst receives, the others send
            received = sum(out.nbytes for out in gather_list) - tensor.nbytes if gather_list else tensor.nbytes
            self.add("gather", received)
            return gather(tensor, gather_list, *args, **kwargs)

        def counted_isend(tensor, *args, **kwargs):
            self.add("send", tensor.nbytes)
            return isend(tensor, *args, **kwargs)

        def counted_recv(tensor, *args, **kwargs):
            self.add("recv", tensor.nbytes)
            return recv(tensor, *args, **kwargs)

        def counted_broadcast(tensor, *args, **kwargs):  # inside broadcast_object_list
            self._object_bytes += tensor.nbytes
            return broadcast(tensor, *args, **kwargs)

        def counted_broadcast_object_list(objects, *args, **kwargs):
            self._object_bytes = 0
            out = broadcast_object_list(objects, *args, **kwargs)
            value = objects[0]
            if isinstance(value[0], str):  # a runner call, a ping or stop of the leader (group.py)
                is_step = value[0] == "execute"
                self.step_id = value[1][0].step_id if is_step else None
                kind = "plan" if is_step else "ping" if value[0] == PING else "call"
            else:
                kind = "sample"  # (sampled rows, failed rows, prompt logprobs) of the sampler rank
            self.add(kind, self._object_bytes)
            return out

        dist.all_reduce, dist.gather, dist.isend, dist.recv = (
            counted_all_reduce,
            counted_gather,
            counted_isend,
            counted_recv,
        )
        c10d.broadcast, dist.broadcast_object_list = counted_broadcast, counted_broadcast_object_list


def held_bytes(root: Any) -> int:
    """Bytes of the distinct tensors reachable from ``root`` through executor_svc objects, lists, tuples and dicts
    (a model's weights, packed panels and RoPE tables). Tensors, not storages: a shard's tensor used as read can
    be a view of the whole checkpoint tensor, mapped from the file, of which only the rows read are resident."""
    seen, tensors, total, stack = set(), set(), 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if (obj.data_ptr(), obj.nbytes) not in tensors:  # views of the same bytes count once
                tensors.add((obj.data_ptr(), obj.nbytes))
                total += obj.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("executor_svc"):
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ()))
    return total


# -- a rank ---------------------------------------------------------------


def pin(cores: list[int]) -> None:
    """Every thread of this process (and those it starts) on ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)


def rank_main(rank: int, cfg: Config, setup: Setup, port: int, results) -> None:
    """One rank: its shard, then the leader's plans (rank 0 times them); puts its report."""
    cores = list(setup.cores)
    if cores:
        pin(cores[: cfg.threads] if cfg.threads > 1 else [cores[rank % len(cores)]])
    torch.set_num_threads(cfg.threads)
    try:
        results.put(_run_rank(rank, cfg, setup, port))
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def _run_rank(rank: int, cfg: Config, setup: Setup, port: int) -> dict[str, Any]:
    from executor_svc.loading.memory import rss_bytes
    from executor_svc.parallel.collectives import GroupComm
    from executor_svc.parallel.group import GroupLeader, follow
    from executor_svc.parallel.launch import LocalRanks
    from executor_svc.parallel.shard import Placement
    from executor_svc.runner.model_runner import ModelRunner

    counter = CommCounter()
    comm = None
    if cfg.world_size > 1:
        counter.install()
        placement = Placement(rank, cfg.tp, cfg.pp)
        comm = GroupComm(placement, f"127.0.0.1:{port}", GROUP_TIMEOUT_S, torch.device("cpu"))
    budget = setup.num_blocks * _bytes_per_block(setup, comm.placement if comm else None)
    runner = ModelRunner(
        setup.model_path,
        dtype=setup.dtype,
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=budget,
        group=comm,
    )
    out = {
        "rank": rank,
        "holds": runner.shard.describe() if runner.shard is not None else "the whole model",
        "rss_bytes": rss_bytes(),
        "weight_bytes": held_bytes(runner.model),
        "kv_bytes": runner.kv_cache.num_bytes,
        "kv_blocks": runner.kv_cache.num_blocks,
        "decode_path": runner.model.decode_path,
    }
    if comm is not None and rank != 0:
        follow(runner, comm)
    else:
        leader = runner if comm is None else GroupLeader(runner, comm, [], LocalRanks())
        out.update(_lead(leader, runner, setup))
        if comm is not None:
            leader.close(GROUP_TIMEOUT_S)
    out["comm"] = {step: {k: list(v) for k, v in kinds.items()} for step, kinds in counter.by_step.items()}
    if comm is not None:
        comm.close()
    return out


def _bytes_per_block(setup: Setup, placement) -> int:
    """A KV block's bytes on this rank (its layers and KV heads), so every rank holds ``num_blocks``."""
    from executor_svc.kv.cache import KVCacheSpec
    from executor_svc.models.registry import parse_model_config
    from executor_svc.parallel.shard import GroupShard
    from executor_svc.runner.device import resolve_dtype

    config = parse_model_config(json.loads((Path(setup.model_path) / "config.json").read_text()))
    if placement is not None:
        config = GroupShard(config, placement).config
    dtype = resolve_dtype(setup.dtype, torch.device("cpu"))
    return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, dtype).bytes_per_block


def _lead(leader: Any, runner: Any, setup: Setup) -> dict[str, Any]:
    """Every workload's plans through ``leader``: the timed steps' times (ms), ids and pickled plan size.

    On a single rank whose decode runs fused, the decode workloads run again on the per-layer path, which every
    group rank runs (model_runner._build_model turns the fused decode off there): times keyed (path, workload).
    """
    step_ids = itertools.count(1)
    passes = [("", setup.workloads)]
    if leader is runner and getattr(runner.model, "fused_decode", None) is not None:
        passes.append((PER_LAYER, tuple(w for w in setup.workloads if w.context)))
    times, steps, plan_bytes = {}, {}, {}
    for path, works in passes:
        if path:
            runner.model.fused_decode = None
        for work in works:
            untimed, timed = build_plans(work, setup, step_ids, runner.config.vocab_size)
            for plan in untimed:
                _check(leader.execute(plan))
            times[path, work.name] = []
            steps[work.name] = [plan.step_id for plan in timed]
            plan_bytes[work.name] = statistics.mean(len(pickle.dumps(("execute", (plan,)))) + 8 for plan in timed)
            for plan in timed:
                start_ns = time.perf_counter_ns()
                _check(leader.execute(plan))
                times[path, work.name].append((time.perf_counter_ns() - start_ns) / 1e6)
            leader.reset()
    return {"times_ms": times, "step_ids": steps, "plan_bytes": plan_bytes}


def _check(result: t.StepResult) -> None:
    if result.errors:
        raise RuntimeError(f"step {result.step_id}: {result.errors[0]}")


def run_config(cfg: Config, setup: Setup) -> list[dict[str, Any]]:
    """Every rank's report, by rank, of one configuration."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, cfg, setup, port, results)) for r in range(cfg.world_size)]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=900) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    failed = [r["error"] for r in reports if "error" in r]
    if failed:
        raise RuntimeError(f"{cfg.label}: {failed[0]}")
    return sorted(reports, key=lambda r: r["rank"])


# -- the padded copy --------------------------------------------------------


def splittable_copy(model_path: str, tp: int, into: Path) -> tuple[str, str]:
    """``model_path`` when ``tp`` splits its heads and MLP; else a copy padded with zero heads (q heads go with
    the added KV heads, their o_proj columns are zero) and zero MLP rows, which computes the same function.
    Returns (path, what was padded: "" for nothing)."""
    from safetensors.torch import load_file, save_file

    folder = Path(model_path)
    config = json.loads((folder / "config.json").read_text())
    heads, inter = config["num_attention_heads"], config["intermediate_size"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    group = heads // kv
    new_kv = next(k for k in itertools.count(kv) if (k % tp == 0 or tp % k == 0) and k * group % tp == 0)
    new_heads, new_inter = new_kv * group, -(-inter // tp) * tp
    if (new_heads, new_inter) == (heads, inter):
        return model_path, ""
    rows = {"q_proj": new_heads * head_dim, "k_proj": new_kv * head_dim, "v_proj": new_kv * head_dim}
    rows.update(gate_proj=new_inter, up_proj=new_inter)
    cols = {"o_proj": new_heads * head_dim, "down_proj": new_inter}
    out = into / f"{folder.name}-{new_heads}h{new_kv}kv"
    out.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, out / file.name)
        elif file.suffix == ".safetensors":
            tensors = load_file(file)
            for name, tensor in tensors.items():
                if "qkv_proj" in name or "gate_up_proj" in name or ".experts." in name:
                    raise SystemExit(f"{name}: only separate q/k/v and MLP projections are padded; give --tp")
                proj = name.split(".")[-2]
                if proj in rows:
                    tensors[name] = _pad(tensor, 0, rows[proj])
                elif proj in cols and name.endswith("weight"):
                    tensors[name] = _pad(tensor, 1, cols[proj])
            save_file(tensors, out / file.name, metadata={"format": "pt"})
    config.update(num_attention_heads=new_heads, num_key_value_heads=new_kv, head_dim=head_dim)
    config["intermediate_size"] = new_inter
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out), f"{heads} heads/{kv} KV heads/{inter} MLP -> {new_heads}/{new_kv}/{new_inter} (zero-padded)"


def _pad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


# -- the arithmetic model and the report ---------------------------------------


def comm_model(cfg: Config, rank: int, work: Workload, config: dict, dtype_bytes: int) -> dict[str, tuple]:
    """Per step, what a rank should send: kind -> (calls, bytes)."""
    from executor_svc.parallel.shard import Placement, stage_layers

    place = Placement(rank, cfg.tp, cfg.pp)
    first, end = stage_layers(config["num_hidden_layers"], cfg.pp, place.pp_rank)
    micro_batches = min(cfg.pp, work.num_seqs)
    hidden_bytes = work.num_tokens * config["hidden_size"]
    out = {}
    if cfg.tp > 1:
        per_batch = 2 * (end - first) + (1 if place.first_stage else 0)
        out["all_reduce"] = (micro_batches * per_batch, per_batch * hidden_bytes * 4)
        if place.last_stage:
            shard = -(-config["vocab_size"] // cfg.tp)
            slices = cfg.tp - 1 if place.tp_rank == 0 else 1  # the first rank receives the others' slices
            out["gather"] = (micro_batches, slices * work.num_seqs * shard * 4)
    if cfg.pp > 1 and not place.last_stage:
        out["send"] = (micro_batches, hidden_bytes * dtype_bytes)
    if cfg.pp > 1 and not place.first_stage:
        out["recv"] = (micro_batches, hidden_bytes * dtype_bytes)
    return out


def per_step(report: dict, step_ids: list[int]) -> dict[str, tuple[float, float]]:
    """The mean calls and bytes of each kind over the given steps."""
    kinds = {k for s in step_ids for k in report["comm"].get(s, {})}
    return {
        k: tuple(statistics.mean(report["comm"].get(s, {}).get(k, [0, 0])[i] for s in step_ids) for i in (0, 1))
        for k in kinds
    }


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    print(f"\n{title}")
    for line in [headers, *rows]:
        print("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))))


def print_step_times(configs: list[Config], reports: dict, setup: Setup) -> None:
    """Median step time per configuration and workload, its ratio to the first, and the ideal ratio."""
    base = reports[configs[0]][0]["times_ms"]
    rows = []
    for cfg in configs:
        times = reports[cfg][0]["times_ms"]
        for path in dict.fromkeys(path for path, _ in times):
            cells = []
            for work in setup.workloads:
                if (path, work.name) not in times:
                    cells.append("")
                    continue
                ms = statistics.median(times[path, work.name])
                micro_batches = min(cfg.pp, work.num_seqs)
                ideal = (micro_batches + cfg.pp - 1) / (micro_batches * cfg.pp * cfg.tp * cfg.threads)
                cells.append(f"{ms:.1f} x{ms / statistics.median(base['', work.name]):.2f} ({ideal:.2f})")
            rows.append([f"{cfg.label} {path}".strip(), *cells])
    title = (
        f"Step time on rank 0: median ms of {setup.num_steps} steps, x{{ratio to {configs[0].label}}} "
        "(ideal ratio: 1 / (ranks x threads) x pipeline bubble (m + P - 1) / m, m micro-batches)"
    )
    print_table(title, ["config", *(w.name for w in setup.workloads)], rows)
    print("decode path: " + "; ".join(f"{c.label}: {reports[c][0]['decode_path']}" for c in configs))


def print_communication(configs: list[Config], reports: dict, setup: Setup, config: dict, dtype_bytes: int) -> None:
    """Each group rank's calls and bytes per step against the arithmetic model."""
    rows, pings = [], 0
    for cfg in (c for c in configs if c.world_size > 1):
        lead = reports[cfg][0]
        for work in setup.workloads:
            for rank_report in reports[cfg]:
                measured = per_step(rank_report, lead["step_ids"][work.name])
                pings += measured.get("ping", (0, 0))[0]
                model = comm_model(cfg, rank_report["rank"], work, config, dtype_bytes)
                model["plan"] = (1, lead["plan_bytes"][work.name])
                cells, same = [], True
                for kind in ("all_reduce", "gather", "send", "recv", "plan"):
                    got, want = measured.get(kind, (0, 0)), model.get(kind, (0, 0))
                    same &= got == want
                    cells.append(f"{got[0]:g}/{want[0]:g} {got[1] / 1024:.1f}/{want[1] / 1024:.1f}")
                sample = measured.get("sample", (0, 0))
                cells.append(f"{sample[0]:g} {sample[1] / 1024:.2f}")
                rows.append([cfg.label, work.name, rank_report["rank"], *cells, "yes" if same else "NO"])
    headers = ["config", "workload", "rank", "all-reduce", "gather", "send", "recv", "plan bcast", "sample"]
    title = "Communication per step, each rank: calls measured/model KiB measured/model (sample: no model)"
    print_table(title, [*headers, "=model"], rows)
    print(f"leader pings in timed steps: {pings:g}")


def print_memory(configs: list[Config], reports: dict) -> None:
    """Each rank's model tensors, KV cache and RSS after loading, against the first configuration's."""
    base = reports[configs[0]][0]
    mib = 2**20
    rows = [
        [
            cfg.label,
            r["rank"],
            r["holds"],
            f"{r['weight_bytes'] / mib:.1f} x{r['weight_bytes'] / base['weight_bytes']:.2f}",
            f"{r['kv_bytes'] / mib:.1f} x{r['kv_bytes'] / base['kv_bytes']:.2f} ({r['kv_blocks']})",
            f"{r['rss_bytes'] / mib:.0f} x{r['rss_bytes'] / base['rss_bytes']:.2f}",
        ]
        for cfg in configs
        for r in reports[cfg]
    ]
    headers = ["config", "rank", "holds", "model tensors MiB", "KV MiB (blocks)", "RSS after load MiB"]
    print_table(f"Memory per rank (x: to {configs[0].label})", headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="checkpoint folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the T>1 configurations")
    parser.add_argument("--batch-sizes", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="decode context")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="prefill chunk")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per workload")
    parser.add_argument("--with-2x2", action="store_true", help="also T=tp P=2")
    parser.add_argument("--pin", action="store_true", help="rank r on core r (one core each; see above)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    configs = [Config(1, 1), Config(args.tp, 1), Config(1, 2), Config(1, 1, 2)]
    configs += [Config(args.tp, 2)] if args.with_2x2 else []
    workloads = (Workload(f"prefill {args.prefill_tokens}", 1, args.prefill_tokens, 0),) + tuple(
        Workload(f"decode B={b}", b, b, args.context) for b in map(int, args.batch_sizes.split(","))
    )
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        path, padded = splittable_copy(resolve_model(args.model), args.tp, Path(tmp))
        config = json.loads((Path(path) / "config.json").read_text())
        cores = tuple(sorted(os.sched_getaffinity(0))) if args.pin else ()
        setup = Setup(path, args.dtype, workloads, args.warmup, args.steps, 0, cores)
        decode_blocks = [w.num_seqs * decode_blocks_per_seq(w, setup) for w in workloads if w.context]
        setup = dataclasses.replace(setup, num_blocks=max(blocks_for(args.prefill_tokens), *decode_blocks))
        print(f"model {resolve_model(args.model)} ({args.dtype}), block {BLOCK_SIZE}, torch {torch.__version__}")
        if padded:
            print(f"T={args.tp} does not split it: every configuration runs a copy with {padded}")
        pinned = f"ranks pinned to cores {list(cores)}" if cores else "ranks not pinned"
        print(f"{pinned}; load average before {load_before[0]:.2f} {load_before[1]:.2f}")
        reports = {}
        for cfg in configs:
            start = time.monotonic()
            reports[cfg] = run_config(cfg, setup)
            print(f"  {cfg.label}: {time.monotonic() - start:.0f} s")
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    print_step_times(configs, reports, setup)
    print_communication(configs, reports, setup, config, dtype_bytes)
    print_memory(configs, reports)
    load_after = os.getloadavg()
    print(f"\nload average after {load_after[0]:.2f} {load_after[1]:.2f}")
    print(f"this machine has {os.cpu_count()} cores: no speed-up is claimed")


if __name__ == "__main__":
    main()
