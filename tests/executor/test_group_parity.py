"""Executor groups on gloo: every family, split by tensor and pipeline parallel, gives transformers' tokens.

Each configuration starts its ranks as processes (torch.multiprocessing), one
thread each; every rank builds its shard of every tiny checkpoint and follows
the same plans (the leader's runner calls are mirrored so: executor_svc.parallel.group),
a minimal scheduler with chunked prefill (7-token chunks, three sequences in
each step). Rank 0's greedy tokens must equal transformers' generate in fp32.
The real system with the scheduler's prefix cache, preemption and speculation
is tests/integration/test_group_e2e.py.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

from executor_svc.native import loader
from pagoda.runtime.ports import free_port
from tests.executor.conftest import ARCHS, load_hf
from tests.executor.test_model_hf_parity import _generate, greedy_prompts

NUM_NEW = 24
CONFIGS = [(2, 1), (1, 2), (2, 2)]  # (tensor, pipeline)


def _rank_main(rank: int, tp: int, pp: int, port: int, folders: dict, backend: str, results) -> None:
    """One rank: its shard of each checkpoint, the plans of ``_generate``; rank 0 puts what it generated."""
    torch.set_num_threads(1)
    try:
        from executor_svc.parallel.collectives import GroupComm
        from executor_svc.parallel.shard import Placement
        from executor_svc.runner.model_runner import ModelRunner

        comm = GroupComm(Placement(rank, tp, pp), f"127.0.0.1:{port}", 120, torch.device("cpu"))
        out = {}
        for arch, folder in folders.items():
            runner = ModelRunner(
                folder,
                dtype="float32",
                device="cpu",
                block_size=4,
                kv_cache_memory_bytes=2**20,
                attention_backend=backend,
                group=comm,
            )
            generated = _generate(runner, greedy_prompts(), NUM_NEW, chunk=7)
            out[arch] = (runner.shard.describe(), generated, getattr(runner.model, "decode_path", ""))
        if rank == 0:
            results.put(out)
        comm.close()
    except BaseException:
        results.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def _spawn(target, world: int, *args) -> tuple[object, list[int]]:
    """Starts ``target(rank, *args, results)`` for every rank as a process; the first result put and every
    rank's exit status."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return out, [proc.exitcode for proc in procs]


def run_group(tp: int, pp: int, folders: dict, backend: str = "torch") -> dict:
    """What rank 0 of a (tp x pp) group generated for each checkpoint."""
    out, codes = _spawn(_rank_main, tp * pp, tp, pp, free_port(), folders, backend)
    assert "error" not in out, out.get("error")
    assert codes == [0] * (tp * pp), codes
    return out


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens for each checkpoint and prompt."""
    out = {}
    for arch, folder in checkpoints.items():
        hf = load_hf(folder)
        with torch.no_grad():
            out[arch] = [
                hf.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False)[0, len(p) :].tolist()
                for p in greedy_prompts()
            ]
    return out


@pytest.mark.parametrize(("tp", "pp"), CONFIGS, ids=[f"tp{t}-pp{p}" for t, p in CONFIGS])
def test_every_family_split_generates_transformers_tokens(tp, pp, checkpoints, expected):
    backend = "auto"  # the C++ kernels per shard (and the fused decode of a pipeline stage) where built
    got = run_group(tp, pp, {arch: str(folder) for arch, folder in checkpoints.items()}, backend)
    assert set(got) == set(ARCHS)
    for arch, (shard, generated, _) in got.items():
        assert [generated[i] for i in range(3)] == expected[arch], f"{arch} ({shard})"
    # The shards are real: rank 0 of a split holds part of the heads or of the layers.
    shard = got["llama"][0]
    if tp == 2:
        assert "q heads 0-1," in shard, shard  # 4 heads: rank 0 the first two
    if pp == 2:
        assert shard.startswith("layers 0-0,"), shard  # 2 layers: stage 0 the first
    # A pipeline stage decodes through its layers in one C++ call where the kernels are built; tensor parallel
    # all-reduces inside the layers, so it runs them one by one.
    # (fp32 weights are packed for that call only with AVX-512 or AVX2 + FMA; elsewhere every layer runs in Python.)
    decode_path = got["llama"][2]
    kernels = loader.kernels()
    fused_here = kernels is not None and "f32_panels" in kernels.features
    if tp == 2:
        assert decode_path.startswith("per layer") if fused_here else decode_path != "fused", decode_path
    elif fused_here:
        assert decode_path == "fused", decode_path


def _anon_bytes() -> int:
    """Anonymous resident memory (what the process holds; file pages the kernel may drop are left out)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _memory_main(rank: int, tp: int, port: int, folder: str, results) -> None:
    """Loads the checkpoint as rank ``rank`` of ``tp`` (1: the whole model); puts (rank, growth of its anonymous
    RSS after loading, the growth's peak while loading (sampled every 2 ms), bytes of the model's weights)."""
    import threading
    import time

    torch.set_num_threads(1)
    try:
        from executor_svc.loading.memory import release_freed_memory
        from executor_svc.parallel.collectives import GroupComm
        from executor_svc.parallel.shard import Placement
        from executor_svc.runner.model_runner import ModelRunner

        comm = GroupComm(Placement(rank, tp, 1), f"127.0.0.1:{port}", 120, torch.device("cpu")) if tp > 1 else None
        before = _anon_bytes()
        peak = [before]
        loading = threading.Event()

        def sample() -> None:
            while not loading.is_set():
                peak[0] = max(peak[0], _anon_bytes())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        runner = ModelRunner(
            folder,
            dtype="float32",
            device="cpu",
            block_size=4,
            kv_cache_memory_bytes=2**16,
            layer_ops="torch",
            group=comm,
        )
        loading.set()
        sampler.join()
        release_freed_memory()  # as the executor does once loaded
        model = runner.model
        tensors = [model.embed, model.lm_head, model.final_norm]
        for layer in model.layers:
            tensors += [layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down]
        weights = sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        results.put((rank, _anon_bytes() - before, peak[0] - before, weights))
        if comm is not None:
            comm.close()
    except BaseException:
        results.put((rank, traceback.format_exc()))
        raise


def test_each_rank_reads_and_holds_its_shard_only(tmp_path):
    """A 100 MB checkpoint: each of two tensor-parallel ranks holds half the weights, and its memory grows, at
    its peak while loading and after, by about its half: it never reads the whole."""
    from tests.executor.conftest import make_tiny_checkpoint

    sizes = dict(hidden_size=512, intermediate_size=2048, vocab_size=8192, num_hidden_layers=4, head_dim=64)
    folder = str(make_tiny_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4, **sizes))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_memory_main, args=(0, 1, 0, folder, results))]
    procs += [ctx.Process(target=_memory_main, args=(rank, 2, port, folder, results)) for rank in range(2)]
    got = []
    for proc in procs[:1]:  # the whole model first, alone on the machine
        proc.start()
    got.append(results.get(timeout=300))
    for proc in procs[1:]:
        proc.start()
    got += [results.get(timeout=300) for _ in range(2)]
    for proc in procs:
        proc.join(timeout=60)
    assert all(isinstance(g[1], int) for g in got), got
    (_, whole_rss, whole_peak, whole_weights), *ranks = got
    assert whole_weights > 90 * 2**20
    for rank, rss, peak, weights in ranks:
        assert abs(weights - whole_weights / 2) < 0.01 * whole_weights, (rank, weights, whole_weights)
        assert rss < 0.6 * whole_rss, (rank, rss, whole_rss)
        assert peak < 0.6 * whole_peak, (rank, peak, whole_peak)


def _quantized_main(rank: int, tp: int, port: int, path: str, options: dict, results) -> None:
    """Rank ``rank`` of ``tp`` (1: the whole model) serves ``path`` with ``options``; the sampler rank puts what
    its runner reports (quantization, kernel paths) and the logits it sampled from, by token prefix."""
    torch.set_num_threads(1)
    try:
        from executor_svc.native.active import active_kernels
        from executor_svc.parallel.collectives import GroupComm
        from executor_svc.parallel.shard import Placement
        from executor_svc.runner.model_runner import ModelRunner
        from tests.executor.conftest import install_recorder

        comm = GroupComm(Placement(rank, tp, 1), f"127.0.0.1:{port}", 120, torch.device("cpu")) if tp > 1 else None
        runner = ModelRunner(
            path, dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**21, group=comm, **options
        )
        recorder = install_recorder(runner)
        _generate(runner, greedy_prompts(), 8, chunk=5)
        if rank == 0:
            # Values, not tensors: torch's queue would share a tensor's memory with a process about to exit.
            logits = {tuple(tokens): row.tolist() for tokens, row in recorder.records}
            results.put((runner.info.quantization, active_kernels(runner)["gemm"], logits))
        if comm is not None:
            comm.close()
    except BaseException:
        results.put((f"rank {rank}: {traceback.format_exc()}", "", {}))
        raise


def _served(tp: int, path: str, options: dict) -> tuple[str, str, dict]:
    out, _ = _spawn(_quantized_main, tp, tp, free_port(), path, options)
    assert not out[0].startswith("rank "), out[0]
    return out


@pytest.mark.parametrize(
    ("model", "options", "quantization"),
    [("gguf", {}, "gguf:q8_0"), ("llama", {"quantization": "int8"}, "int8")],
    ids=["gguf-q8_0-as-stored", "int8"],
)
def test_quantized_weights_are_split_and_served_per_shard(
    model, options, quantization, checkpoints, tmp_path, cpp_kernel
):
    """Two tensor-parallel ranks serve a GGUF file's Q8_0 blocks as stored (cut by rows, and by columns at whole
    blocks) and a checkpoint quantized to int8 at load (each rank its shard), on the C++ kernels: the logits
    they sample from agree with one process serving the whole model so (cosine > 0.999; a row-parallel int8
    shard's scales are over its own columns, a finer quantization than the whole model's)."""
    import gguf

    from tests.executor.test_gguf_loader import random_hf_weights, write_tiny_gguf

    if model == "gguf":
        path = str(write_tiny_gguf(tmp_path / "tiny.gguf", random_hf_weights(seed=1), gguf.GGMLQuantizationType.Q8_0))
    else:
        path = str(checkpoints[model])
    whole = _served(1, path, options)
    split = _served(2, path, options)
    assert whole[0] == split[0] == quantization
    # The C++ kernels where this CPU has them (AVX512-VNNI or AVX2), else torch's: the split is the same either way.
    kernels = loader.kernels()
    fast = kernels is not None and bool({"avx512_vnni", "avx2_int8"} & kernels.features)
    prefixes = ("vnni", "amx", "avx512", "avx2") if fast else ("torch-",)
    assert split[1] == whole[1] and split[1].startswith(prefixes), split[1]
    shared = whole[2].keys() & split[2].keys()
    assert len(shared) >= 6
    for tokens in shared:
        a, b = torch.tensor(whole[2][tokens]), torch.tensor(split[2][tokens])
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        assert cosine > 0.999, (tokens, cosine)


def _failing_main(rank: int, port: int, folder: str, results) -> None:
    """A T=2 group whose rank 1 raises in its forward at the third step; rank 0 puts how long it ran."""
    import time

    torch.set_num_threads(1)
    from executor_svc.parallel.collectives import GroupComm
    from executor_svc.parallel.shard import Placement
    from executor_svc.runner.model_runner import ModelRunner

    comm = GroupComm(Placement(rank, 2, 1), f"127.0.0.1:{port}", 120, torch.device("cpu"))
    runner = ModelRunner(folder, dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**20, group=comm)
    if rank == 1:
        forward, calls = runner.model.forward, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("a fault on rank 1 only")
            return forward(*args, **kwargs)

        runner.model.forward = failing
    start = time.monotonic()
    try:
        _generate(runner, greedy_prompts(), NUM_NEW, chunk=7)
    finally:  # not reached: the group's failure ends the process
        results.put(("finished", time.monotonic() - start))


def test_a_step_that_fails_on_one_rank_takes_the_group_down_at_once(checkpoints):
    """The ranks run each step in lockstep, so a step one rank cannot finish is not failed alone there (its peers
    would wait in the step's collectives until the timeout): that rank exits with GROUP_LOST_EXIT, and its peer
    sees its connections close and exits too, well inside the 120 s timeout."""
    from executor_svc.parallel.collectives import GROUP_LOST_EXIT

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_failing_main, args=(r, port, str(checkpoints["llama"]), results)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)  # a rank still waiting has no exit code yet
    assert [proc.exitcode for proc in procs] == [GROUP_LOST_EXIT] * 2
    assert results.empty()
