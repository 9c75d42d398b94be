"""``pagoda bench``: its flags and the run (workload, backends, report).

A plug-in of the ``pagoda`` command: ``plugin`` is the ``pagoda.cli`` entry point named
``bench`` (pyproject.toml), which ``pagoda_client.cli`` finds when it builds its parser;
the client itself never imports this package. The backends are imported only when they run.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import secrets
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pagoda_bench.compare import add_compare_arguments
from pagoda_bench.metrics import RequestRecord, compute_metrics, parse_goodput
from pagoda_bench.progress import ProgressBar
from pagoda_bench.report import format_report, write_json, write_plots
from pagoda_bench.workload import (
    BenchRequest,
    arrival_times,
    parse_range,
    random_workload,
    sharegpt_workload,
)
from pagoda_client.cli_flags import connection_of, file_text
from pagoda_client.cli_plugins import CliPlugin


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagoda bench`` (connection flags are added by the caller)."""
    parser.add_argument("--backend", choices=("pagoda", "hf", "openai"), default="pagoda")
    parser.add_argument(
        "--base-url", help="--backend openai: an OpenAI-compatible server's root, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model-name", help="--backend openai: the requests' model (default: GET /v1/models' first)")
    parser.add_argument(
        "--workload", "--dataset-name", dest="workload", choices=("random", "sharegpt", "prefix"), default="random"
    )
    parser.add_argument("--dataset-path", help="ShareGPT JSON file (sharegpt workload)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=parse_range, default=(16, 512), metavar="LOW:HIGH")
    parser.add_argument("--output-len-range", type=parse_range, default=(16, 256), metavar="LOW:HIGH")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens (prefix workload)")
    parser.add_argument("--suffix-len-range", type=parse_range, default=(16, 64), metavar="LOW:HIGH")
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write metrics and per-request records")
    parser.add_argument("--plot", dest="plot_dir", metavar="DIR", help="write PNG charts (needs matplotlib)")
    parser.add_argument(
        "--model", default="default", help="checkpoint folder for --backend hf / --compare-hf, vocabulary of openai"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="dtype of the HF baseline"
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-num-threads", type=int, default=None, help="torch threads of the HF baseline")
    parser.add_argument("--compare-hf", action="store_true", help="run pagoda, then the HF baseline")
    parser.add_argument("--max-duration-s", type=float, default=600.0, help="bound on each run's wall time")
    parser.add_argument("--request-timeout-s", type=float, default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--json-schema", type=file_text, metavar="FILE", help="constrain --structured-fraction of the requests to it"
    )
    parser.add_argument(
        "--structured-fraction", type=float, default=1.0, help="share of requests --json-schema constrains"
    )
    add_compare_arguments(parser)


def run_command(args: argparse.Namespace) -> int:
    """``pagoda bench``, on the parsed flags (the connection's too)."""
    return run_bench(args, connection_of(args))


def is_loopback(target: str) -> bool:
    """Whether ``host:port`` names this machine."""
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_workload(
    args: argparse.Namespace,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    tokenize: Callable[[str], list[int]],
    ids_salt: int | str | None = None,
) -> list[BenchRequest]:
    """The requests of ``args.workload`` (random and prefix: token ids salted with ``ids_salt``, if given)."""
    if args.workload in ("random", "prefix"):
        prefix = args.workload == "prefix"  # its lengths are the suffixes'
        lengths = args.suffix_len_range if prefix else args.input_len_range
        prefix_len = args.prefix_len if prefix else 0
        return random_workload(
            args.num_prompts, lengths, args.output_len_range, args.seed, vocab_size, eos_ids, prefix_len, ids_salt
        )
    if not args.dataset_path:
        raise ValueError("the sharegpt workload needs --dataset-path")
    return sharegpt_workload(args.dataset_path, args.num_prompts, args.seed, tokenize, args.sharegpt_output_len)


def _run_pagoda(
    args: argparse.Namespace, requests: list[BenchRequest], connection: dict[str, Any]
) -> tuple[list[RequestRecord], float]:
    from pagoda_bench.backend_pagoda import PagodaBackendConfig, run_pagoda

    config = PagodaBackendConfig(
        target=connection["target"],
        api_key=connection["api_key"],
        tls=connection["tls"],
        temperature=args.temperature,
        max_concurrency=args.max_concurrency,
        max_duration_s=args.max_duration_s,
        request_timeout_s=args.request_timeout_s,
        json_schema=args.json_schema,
        structured_fraction=args.structured_fraction,
    )
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    progress = ProgressBar(len(requests), "pagoda", enabled=not args.no_progress)
    try:
        return run_pagoda(requests, arrivals, config, progress)
    finally:
        progress.close()


def _run_openai(
    args: argparse.Namespace, requests: list[BenchRequest], api_key: str | None
) -> tuple[list[RequestRecord], float]:
    from pagoda_bench.backend_openai import OpenAIBackendConfig, run_openai

    config = OpenAIBackendConfig(
        base_url=args.base_url,
        model_name=args.model_name,
        api_key=api_key,
        temperature=args.temperature,
        max_concurrency=args.max_concurrency,
        max_duration_s=args.max_duration_s,
        request_timeout_s=args.request_timeout_s,
    )
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    progress = ProgressBar(len(requests), "openai", enabled=not args.no_progress)
    try:
        return run_openai(requests, arrivals, config, progress)
    finally:
        progress.close()


def _run_comparison(args: argparse.Namespace, api_key: str | None) -> int:
    """``--server ...``: each server started, measured over OpenAI's API and stopped, round after round."""
    from pagoda_bench.backend_openai import checkpoint_vocab
    from pagoda_bench.compare import (
        Started,
        check_compare_args,
        comparison_json,
        format_comparison,
        parse_servers,
        run_rounds,
    )
    from pagoda_bench.servers import LoadedHf, ServerSpec, loaded, started

    check_compare_args(args)
    specs = parse_servers(args.server, is_loopback)
    vocabulary = checkpoint_vocab(args.model)
    if args.prompt_salt is None:
        args.prompt_salt = secrets.randbelow(1 << 31)  # in the JSON's config: --prompt-salt repeats the run
    print(f"prompt salt {args.prompt_salt} (--prompt-salt to send the same prompts again)", flush=True)

    def workload(round_index: int, k: int, server: str) -> list[BenchRequest]:
        """Run k of round r for one server: lengths from seed --seed + k (the same for every server), ids salted
        with the salt, the round and the server's name: new to the server, even to one that kept its KV cache
        from an earlier start or shares a cache directory with another server compared."""
        seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + k})
        return build_workload(seeded, *vocabulary, f"{args.prompt_salt}:{round_index}:{server}")

    log_dir = Path(args.server_log_dir)

    def start(spec: ServerSpec, label: str) -> AbstractContextManager[Started]:
        if spec.hf_dtype is not None:
            return loaded(_hf_config(_with_dtype(args, spec)), spec)
        return started(spec, log_dir, label, args.server_start_timeout_s)

    def run(server: Started, round_index: int, index: int) -> tuple[list[RequestRecord], float]:
        requests = workload(round_index, index, server.spec.name)
        if isinstance(server, LoadedHf):
            return _run_hf(_with_dtype(args, server.spec), server.hf_model, requests)
        options = argparse.Namespace(**{**vars(args), "base_url": server.spec.base_url, "model_name": server.model})
        return _run_openai(options, requests, api_key)

    results = run_rounds(args, specs, start, run)
    print(format_comparison(results, expect_uncached=args.workload == "random"))
    if args.json_path:
        config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "func"}
        write_json(args.json_path, config, {}, {"servers": comparison_json(results)})
    return 0 if all(result.complete() for result in results) else 1


def _with_dtype(args: argparse.Namespace, spec: Any) -> argparse.Namespace:
    """``args`` with the dtype of an in-process baseline's ``NAME=hf:DTYPE`` (``--dtype`` when it gives none)."""
    return argparse.Namespace(**{**vars(args), "dtype": spec.hf_dtype or args.dtype})


def _check_openai_args(args: argparse.Namespace) -> None:
    """--backend openai needs a loopback --base-url and runs alone."""
    if not args.base_url:
        raise ValueError("--backend openai needs --base-url")
    if not is_loopback(f"[{urlsplit(args.base_url).hostname or ''}]:0"):
        raise ValueError(f"pagoda bench only targets loopback addresses, not {args.base_url}")
    if args.compare_hf or args.json_schema:
        raise ValueError("--compare-hf and --json-schema go with --backend pagoda, not openai")


def _run_hf(args: argparse.Namespace, model: Any, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    from pagoda_bench.backend_hf import run_hf

    config = _hf_config(args)
    progress = ProgressBar(len(requests), "hf", enabled=not args.no_progress)
    try:
        return run_hf(model, requests, config, progress)
    finally:
        progress.close()


def _hf_model(args: argparse.Namespace) -> Any:
    from pagoda_bench.backend_hf import load_model

    return load_model(_hf_config(args))


def _hf_config(args: argparse.Namespace) -> Any:
    from pagoda_bench.backend_hf import HfBackendConfig

    return HfBackendConfig(args.model, args.dtype, args.hf_batch_size, args.max_duration_s, args.hf_num_threads)


def run_bench(args: argparse.Namespace, connection: dict[str, Any]) -> int:
    """Run ``pagoda bench``; returns the exit code."""
    if args.server:
        return _run_comparison(args, connection["api_key"])
    slos = parse_goodput(args.goodput)
    use_openai = args.backend == "openai"
    if use_openai:
        _check_openai_args(args)
    use_pagoda = args.backend == "pagoda" or args.compare_hf
    use_hf = args.backend == "hf" or args.compare_hf
    if use_pagoda and not is_loopback(connection["target"]):
        raise ValueError(f"pagoda bench only targets loopback addresses, not {connection['target']}")
    model = _hf_model(args) if use_hf else None
    vocab_size, eos_ids, tokenize = _vocabulary(use_pagoda, model, connection, args)
    requests = build_workload(args, vocab_size, eos_ids, tokenize)
    runs: dict[str, tuple[dict[str, Any], list[RequestRecord]]] = {}
    if use_openai:
        records, duration_s = _run_openai(args, requests, connection["api_key"])
        runs["openai"] = (compute_metrics(records, duration_s, slos), records)
        print(format_report(f"openai {args.base_url}", runs["openai"][0], args.workload == "random"))
    if use_pagoda:
        records, duration_s = _run_pagoda(args, requests, connection)
        runs["pagoda"] = (compute_metrics(records, duration_s, slos), records)
        print(format_report("pagoda", runs["pagoda"][0], args.workload == "random"))
    if use_hf:
        records, duration_s = _run_hf(args, model, requests)
        runs["hf"] = (compute_metrics(records, duration_s, slos), records)
        print(format_report(f"hf static batching, batch {args.hf_batch_size}, {args.dtype}", runs["hf"][0]))
    extra = {}
    if len(runs) == 2:
        ratio = throughput_ratio(runs["pagoda"][0], runs["hf"][0])
        extra["output_throughput_ratio_pagoda_over_hf"] = ratio
        shown = "n/a (a run completed no request)" if ratio is None else f"{ratio:.2f}x"
        print(f"Output token throughput, pagoda / hf: {shown}")
    if args.json_path:
        config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "func"}
        write_json(args.json_path, config, runs, extra)
    if args.plot_dir:
        for path in write_plots(args.plot_dir, {name: records for name, (_, records) in runs.items()}):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(m["completed"] for m, _ in runs.values()) else 1


def throughput_ratio(pagoda: dict[str, Any], hf: dict[str, Any]) -> float | None:
    """Output token throughput of pagoda over hf; None when either is zero."""
    if not pagoda["output_throughput"] or not hf["output_throughput"]:
        return None
    return pagoda["output_throughput"] / hf["output_throughput"]


def _vocabulary(
    use_pagoda: bool, model: Any, connection: dict[str, Any], args: argparse.Namespace
) -> tuple[int, tuple[int, ...], Callable[[str], list[int]]]:
    """(vocab size, EOS ids, tokenize) from the server, else from the HF model (openai: its checkpoint)."""
    if args.backend == "openai":
        from pagoda_bench.backend_openai import checkpoint_vocab

        return checkpoint_vocab(args.model)
    if use_pagoda:
        from pagoda_client import Client

        client = Client(connection["target"], api_key=connection["api_key"], tls=connection["tls"], timeout=30.0)
        info = client.model_info()
        return info.vocab_size, info.eos_token_ids, lambda text: client.tokenize(text, add_special_tokens=False)
    from transformers import AutoTokenizer

    from pagoda_bench.backend_hf import model_vocab, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    vocab_size, eos_ids = model_vocab(model)
    return vocab_size, eos_ids, lambda text: tokenizer.encode(text, add_special_tokens=False)


plugin = CliPlugin(help="serving benchmark", add_arguments=add_bench_arguments, run=run_command)
