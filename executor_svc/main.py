"""`pagoda-executor`: load the model, size the KV cache, serve the Executor API.

With `--simulate` it serves a simulated runner instead (executor_svc.simulate.runner):
the model path, and so torch, is imported only when a model is loaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
import structlog

from executor_svc.config import ExecutorConfig, load_config
from executor_svc.loading.memory import rss_bytes
from executor_svc.loading.tokenizer_files import TokenizerFiles
from executor_svc.lora.errors import LoraAdapterError
from executor_svc.serving.metrics import ExecutorMetrics
from executor_svc.serving.sequence_table import Runner
from executor_svc.serving.servicer import ExecutorServicer
from executor_svc.serving.step_tracing import StepTracer
from pagoda.runtime import grpc_server
from pagoda.runtime.logs import configure_logging, run_logged
from pagoda.runtime.shared_settings import lora_specs
from pagoda.tracing import setup_tracing, shutdown_tracing
from pagoda.v1 import executor_pb2, executor_pb2_grpc

if TYPE_CHECKING:
    from executor_svc.kv.tier.dir_lock import TierDirLock
    from executor_svc.kv.tier.open_tier import OpenTier
    from executor_svc.parallel.collectives import GroupComm
    from executor_svc.parallel.group import GroupLeader
    from executor_svc.runner.model_runner import ModelRunner

log = structlog.get_logger("executor")
# SIGTERM: the blocks still queued for the offload tier are stored within this time.
TIER_FLUSH_TIMEOUT_S = 30.0
# This process's flags: the ranks it starts get the same ones (executor_svc.parallel.launch).
ARGV: list[str] = []
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
# The ready line leaves out what the runner's info holds empty (tokenizer, servicer) or what it logs otherwise.
_NOT_LOGGED = {f.name for f in dataclasses.fields(TokenizerFiles)} | {
    "incarnation_id",
    "draining",
    "kernels",
    "kv_offload",
    "tier_hashes",
    # The leader's local runner knows nothing of its group; group_formed logs the ranks.
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "group_ranks",
    "group_last_contact_s",
}


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A runner ready to attach, with what Describe and the ready log line report about it."""

    runner: Runner
    tokenizer: TokenizerFiles
    model_name: str
    kernels: dict[str, str]
    kernel_library: str
    bos_token_id: int | None = None
    # The offload tier the runner stores blocks in (docs/kv-offload.md); None: none.
    tier: OpenTier | None = None
    # The start-up warm-up (runner.warmup): its time and what it ran; 0 and "" for the simulated runner.
    warmup_s: float = 0.0
    warmup: str = ""


async def load_model(
    config: ExecutorConfig, servicer: ExecutorServicer, tier_lock: TierDirLock | None = None
) -> Loaded:
    """Load weights, allocate the KV cache, open the offload tier and warm up, on the model thread (torch is
    imported here only)."""
    from executor_svc.loading.memory import release_freed_memory
    from executor_svc.loading.model_cache import resolve_model
    from executor_svc.loading.tokenizer_files import load_tokenizer_files
    from executor_svc.native import loader
    from executor_svc.native.active import active_kernels

    gguf = config.quantization == "gguf"  # the default model as its Q4_1 file, served as stored
    model_path = await asyncio.to_thread(resolve_model, config.model, config.model_cache_dir or None, gguf)
    tokenizer = await asyncio.to_thread(load_tokenizer_files, model_path)
    draft_path = None
    if config.draft_model:
        draft_path = await asyncio.to_thread(resolve_draft_model, config, tokenizer)
    if config.group_size > 1:
        runner = await start_group(config, servicer, model_path, draft_path)
    else:
        runner = await servicer.run_model(build_runner, config, model_path, draft_path)
    tier = await servicer.run_model(open_runner_tier, config, runner, model_path, tier_lock, servicer.metrics)
    warmup = await servicer.run_model(runner.warmup)
    for name, path in lora_specs(config.lora).items():  # a bad one fails the start, naming the problem
        try:
            await servicer.run_model(runner.add_lora, name, path)
        except LoraAdapterError as exc:
            raise LoraAdapterError(f"--lora {name}={path}: {exc}") from None
    await servicer.run_model(release_freed_memory)  # the load's freed copies go back to the OS
    eos_token_ids = tuple(tokenizer.eos_token_ids or runner.info.eos_token_ids)
    await asyncio.to_thread(runner.enable_constraints, tokenizer.tokenizer_json, eos_token_ids)
    kernels = await servicer.run_model(active_kernels, runner)  # probes the kernels: torch work
    library = loader.loaded()
    model_name = config.model_name or runner.info.model_name
    library_path = str(library.library) if library is not None else ""
    bos_token_id = runner.config.bos_token_id
    summary = warmup.summary()
    return Loaded(runner, tokenizer, model_name, kernels, library_path, bos_token_id, tier, warmup.seconds, summary)


async def start_group(
    config: ExecutorConfig, servicer: ExecutorServicer, model_path: str, draft_path: str | None
) -> GroupLeader:
    """The leader of an executor group: its local ranks started, the group formed, every rank's shard loaded
    (docs/parallel.md)."""
    from executor_svc.parallel import launch
    from executor_svc.parallel.collectives import GroupComm
    from executor_svc.parallel.group import GroupLeader, rank_report
    from executor_svc.runner.device import resolve_device

    address = launch.group_address(config)
    local = launch.LocalRanks()
    local.start(config, ARGV, address, model_path, draft_path)
    placement = launch.placement(config)
    device = resolve_device(config.device)
    timeouts = (config.group_timeout_s, device, config.group_start_timeout_s)
    comm = await servicer.run_model(GroupComm, placement, address, *timeouts)
    runner = await servicer.run_model(build_runner, config, model_path, draft_path, comm)
    ranks = await servicer.run_model(rank_report, comm, runner)
    log.info("group_formed", world_size=placement.world_size, ranks=ranks)
    return GroupLeader(runner, comm, ranks, local)


def run_group_rank(config: ExecutorConfig) -> None:
    """A rank other than the leader: its local ranks started, its shard loaded, then the leader's calls until
    it says stop (no gRPC: only the leader serves)."""
    from executor_svc.loading.model_cache import resolve_model
    from executor_svc.loading.tokenizer_files import load_tokenizer_files
    from executor_svc.parallel import launch
    from executor_svc.parallel.collectives import GroupComm
    from executor_svc.parallel.group import follow, rank_report
    from executor_svc.runner.device import resolve_device

    launch.become_follower()
    model_path = resolve_model(config.model, config.model_cache_dir or None, config.quantization == "gguf")
    draft_path = resolve_draft_model(config, load_tokenizer_files(model_path)) if config.draft_model else None
    local = launch.LocalRanks()
    local.start(config, ARGV, config.group_address, model_path, draft_path)
    comm = GroupComm(
        launch.placement(config), config.group_address, config.group_timeout_s, resolve_device(config.device)
    )
    runner = build_runner(config, model_path, draft_path, comm)
    rank_report(comm, runner)
    follow(runner, comm)
    local.stop(config.drain_timeout_s)


def open_runner_tier(
    config: ExecutorConfig,
    runner: ModelRunner,
    model_path: str,
    lock: TierDirLock | None,
    metrics: ExecutorMetrics | None,
) -> OpenTier | None:
    """The offload tier of the --kv-offload-* flags, attached to the runner (None: no tier asked for)."""
    from executor_svc.kv.tier.identity import model_identity
    from executor_svc.kv.tier.open_tier import open_tier
    from executor_svc.kv.tier.step_io import TierStepIO
    from executor_svc.models.rope import uses_longrope
    from executor_svc.runner.device import dtype_name

    # Quantized weights give other KV: their blocks are another model's (unquantized ones keep their identity).
    quant = runner.quantization
    extra = {} if quant.name == "none" else {"quantization": quant.name, "activations": quant.target.activations}
    if uses_longrope(runner.config):
        # LongRoPE's factor set is chosen per sequence and hashed with its blocks; a tier written before that
        # holds long-factor blocks under the hashes short-factor blocks have now, so it is another namespace.
        extra["rope"] = "longrope-per-sequence"
    identity = model_identity(model_path, dtype_name(runner.dtype), **extra)
    on_store_s = metrics.tier_store_s.observe if metrics is not None else (lambda s: None)
    tier = open_tier(config, runner.kv_cache, identity, lock, on_store_s)
    if tier is not None:
        on_load_s = metrics.tier_load_s.observe if metrics is not None else (lambda s: None)
        runner.attach_tier(TierStepIO(tier.store, runner.kv_cache, on_load_s))
        if metrics is not None:
            metrics.watch_tier(tier.store)
    return tier


async def _load(config: ExecutorConfig, servicer: ExecutorServicer) -> Loaded:
    """The simulated runner, or the model with the offload tier (its directory locked first: a busy one fails
    the start at once, not after the weights are read)."""
    if config.simulate:
        return load_simulated(config)
    from executor_svc.kv.tier.open_tier import lock_dir

    return await load_model(config, servicer, lock_dir(config))


def load_simulated(config: ExecutorConfig) -> Loaded:
    """The simulated runner (`--simulate`): no model, no torch."""
    from executor_svc.simulate.runner import simulated_runner

    runner, tokenizer = simulated_runner(config)
    return Loaded(runner, tokenizer, runner.info.model_name, {"variant": "simulated"}, "")


def resolve_draft_model(config: ExecutorConfig, tokenizer: TokenizerFiles) -> str:
    """The path of ``--draft-model``, once its tokenizer is known to have the model's vocabulary.

    Raises:
        ValueError: no such model, no tokenizer beside it, or another vocabulary.
    """
    from executor_svc.loading.model_cache import resolve_model
    from executor_svc.loading.tokenizer_files import TokenizerFilesError, load_tokenizer_files, vocabulary_difference

    flag = f"--draft-model {config.draft_model!r}"
    try:
        path = resolve_model(config.draft_model, config.model_cache_dir or None)
    except FileNotFoundError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    try:
        difference = vocabulary_difference(tokenizer.tokenizer_json, load_tokenizer_files(path).tokenizer_json)
    except TokenizerFilesError as exc:
        raise ValueError(f"{flag}: {exc}; a draft model needs the model's tokenizer") from None
    if difference is not None:
        raise ValueError(f"{flag}: its tokenizer is not the model's ({difference}); drafts would be other tokens")
    return path


def build_runner(
    config: ExecutorConfig, model_path: str, draft_path: str | None = None, group: GroupComm | None = None
) -> ModelRunner:
    """Load weights and allocate the KV cache once (its default budget depends on the device the runner resolves);
    ``group``: this process is a rank of an executor group and loads its shard."""
    from executor_svc.runner.model_runner import ModelRunner

    # torch imported, no weight read yet: the ready line's rss_bytes less this one is what the model takes.
    log.info("model_loading", model=model_path, rss_bytes=rss_bytes())
    return ModelRunner(
        model_path,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        device=config.device,
        block_size=config.block_size,
        kv_cache_memory_bytes=config.kv_cache_memory,
        kv_cache_memory_fraction=config.kv_cache_memory_fraction,
        max_model_len=config.max_model_len,
        attention_backend=config.attention_backend,
        layer_ops=config.layer_ops,
        quantization=config.quantization,
        quantized_activations=config.quantized_activations,
        draft_model_path=draft_path,
        batch_invariant=config.batch_invariant,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        group=group,
    )


async def serve(config: ExecutorConfig) -> None:
    """Start serving health at once, load the model (or the simulation), then serve Execute until SIGTERM drains."""
    options = [*grpc_server.KEEPALIVE_OPTIONS, *grpc_server.message_size_options(config.max_message_bytes)]
    server = grpc.aio.server(options=options)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    await grpc_server.set_serving(health, [SERVICE_NAME], False)
    await grpc_server.set_live(health)
    metrics = ExecutorMetrics()
    servicer = ExecutorServicer(metrics)
    tracer = setup_tracing("pagoda-executor", config.otlp_endpoint, log=log)
    if tracer is not None:
        servicer.tracer = StepTracer(tracer, servicer.incarnation_id)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    credentials = grpc_server.server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
    port = grpc_server.add_port(server, f"{config.host}:{config.port}", credentials)
    await server.start()
    log.info(
        "executor_listening", address=f"{config.host}:{port}", tls=credentials is not None, tracing=tracer is not None
    )

    try:
        loaded = await _load(config, servicer)
    except BaseException:
        # Stopped while the loop runs: a server left to the garbage collector at interpreter exit
        # schedules its shutdown on a closed loop and can crash the process, so the launcher saw a
        # signal instead of this failure's exit code.
        await server.stop(grace=None)
        raise
    info = loaded.runner.info
    metrics.kv_blocks.set(info.num_kv_blocks)
    metrics.warmup_s.set(loaded.warmup_s)
    if config.metrics_port:
        metrics.serve(config.host, config.metrics_port)
    tier = loaded.tier
    kv_offload = tier.description if tier is not None else ""
    servicer.attach(loaded.runner, loaded.tokenizer, loaded.model_name, loaded.kernels, tier and tier.store, kv_offload)
    await grpc_server.set_serving(health, [SERVICE_NAME], True)
    log.info(
        "executor_ready",
        model=loaded.model_name,
        **{k: v for k, v in vars(info).items() if k not in _NOT_LOGGED},
        bos_token_id=loaded.bos_token_id,
        kernels=servicer.kernels,
        kernel_library=loaded.kernel_library,
        kv_offload=kv_offload,
        num_tier_blocks=len(tier.store.hashes()) if tier is not None else 0,
        rss_bytes=rss_bytes(),
        warmup_s=round(loaded.warmup_s, 3),
        warmup=loaded.warmup,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(servicer, health, config.drain_timeout_s)
    await server.stop(grace=2.0)
    if config.group_size > 1:  # the GroupLeader: its ranks stop after the leader drained
        await servicer.run_model(loaded.runner.close, config.drain_timeout_s)  # type: ignore[attr-defined]
    if tier is not None:
        await asyncio.to_thread(tier.close, TIER_FLUSH_TIMEOUT_S)
    shutdown_tracing()
    log.info("executor_stopped")


async def drain(servicer: ExecutorServicer, health, timeout_s: float) -> None:
    """Report draining, go NOT_SERVING, and wait for held sequences to finish."""
    servicer.draining = True
    await grpc_server.set_serving(health, [SERVICE_NAME], False)
    if servicer.runner is None:
        return
    log.info("executor_draining", num_sequences=servicer.runner.num_sequences(), timeout_s=timeout_s)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while servicer.has_active_stream and servicer.runner.num_sequences() > 0:
        if asyncio.get_running_loop().time() > deadline:
            log.warning("drain_timeout", num_sequences=servicer.runner.num_sequences())
            break
        await asyncio.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    ARGV[:] = list(sys.argv[1:] if argv is None else argv)
    config = load_config(argv)
    configure_logging(config.log_format)
    threads = config.num_threads
    if config.group_size > 1:
        from executor_svc.parallel.launch import threads_per_rank

        threads = threads_per_rank(config)
    if threads and not config.simulate:
        import torch

        torch.set_num_threads(threads)
    if config.group_rank > 0:
        run_group_rank(config)
        return
    run_logged(serve(config), log, "executor_failed")


if __name__ == "__main__":
    main()
