"""The ``pagoda`` command: generate, chat, models, status, serve, and the plug-ins' commands (``pagoda bench``).

Plug-ins are found through their entry points (``pagoda_client.cli_plugins``); this
module imports none of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from pagoda.tracing import setup_tracing, shutdown_tracing
from pagoda_client.cli_flags import add_param_flags, connection_of, connection_parser, generation_kwargs, list_of
from pagoda_client.cli_plugins import load_plugins
from pagoda_client.client import Client
from pagoda_client.errors import PagodaError
from pagoda_client.results import ExecutorStatus, GenerationResult, ServerStatus

__all__ = ["build_parser", "connection_of", "generation_kwargs", "main"]


def _sampling_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_param_flags(parser.add_argument_group("sampling and stopping"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return parser


# The commands built in; a plug-in cannot take their names.
BUILT_IN = ("generate", "chat", "models", "status", "serve")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``pagoda``; ``serve`` and the plug-ins bring their own flags.

    Args:
        command: the subcommand about to run, or None (every command with every flag). ``serve``'s service flags
            come from the services' configs and are added only for ``serve``, and the plug-ins are loaded only for
            a command that is not built in (``pagoda --help``, ``pagoda bench``), so the client's commands import
            no service module and no plug-in.
    """
    from pagoda.launch.serve import add_serve_arguments

    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM serving: client, launcher, plug-ins")
    commands = parser.add_subparsers(dest="command", required=True)
    connection, sampling = connection_parser(), _sampling_parser()
    generate = commands.add_parser("generate", parents=[connection, sampling], help="complete a prompt")
    generate.add_argument("prompt", nargs="?", help="prompt text (or --token-ids)")
    generate.add_argument("--token-ids", type=list_of(int), help="prompt as comma-separated token ids")
    generate.set_defaults(func=cmd_generate)
    chat = commands.add_parser(
        "chat", parents=[connection, sampling], help="chat with the model (interactive when no message is given)"
    )
    chat.add_argument("message", nargs="?")
    chat.add_argument("--system", help="system message")
    chat.set_defaults(func=cmd_chat)
    models = commands.add_parser("models", parents=[connection], help="what model the server serves")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=cmd_models)
    status = commands.add_parser("status", parents=[connection], help="queues, KV usage, executors")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    serve = commands.add_parser("serve", help="start a scheduler and N executors locally")
    add_serve_arguments(serve, service_flags=command in (None, "serve"))
    if command not in BUILT_IN:
        _add_plugins(commands, connection)
    return parser


def _add_plugins(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser
) -> None:
    """A subcommand per installed plug-in, with its flags (after the connection's, if it takes them)."""
    for name, plugin in load_plugins(BUILT_IN).items():
        sub = commands.add_parser(name, parents=[connection] if plugin.connection else [], help=plugin.help)
        plugin.add_arguments(sub)
        sub.set_defaults(func=plugin.run)


def _client(args: argparse.Namespace) -> Client:
    connection = connection_of(args)
    return Client(connection["target"], api_key=connection["api_key"], tls=connection["tls"], timeout=args.timeout)


def stream_to(client: Client, out: TextIO, as_json: bool, **options: Any) -> GenerationResult:
    """Run one generation (``options`` as in ``Client.stream``), streaming text to ``out`` (or one JSON object)."""
    with client.stream(**options) as deltas:
        for delta in deltas:
            if not as_json:
                out.write(delta.text)
                out.flush()
    result = deltas.result
    if as_json:
        keys = ("text", "token_ids", "finish_reason", "usage", "stop_reason", "request_id", "timings")
        document = {k: v for k, v in result.to_dict().items() if k in keys}
        out.write(json.dumps(document) + "\n")
    else:
        out.write("\n")
    return result


def cmd_generate(args: argparse.Namespace) -> int:
    """``pagoda generate``."""
    if (args.prompt is None) == (args.token_ids is None):
        raise ValueError("give a prompt or --token-ids (not both)")
    with _client(args) as client:
        stream_to(
            client, sys.stdout, args.json, prompt=args.prompt, token_ids=args.token_ids, **generation_kwargs(args)
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """``pagoda chat``: one-shot with a message, else a REPL keeping history."""
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    with _client(args) as client:
        if args.message is not None:
            history.append({"role": "user", "content": args.message})
            stream_to(client, sys.stdout, args.json, messages=history, **generation_kwargs(args))
            return 0
        return chat_repl(client, history, args)


def chat_repl(client: Client, history: list[dict[str, str]], args: argparse.Namespace) -> int:
    """Read user lines until EOF or /exit; each reply joins the history."""
    print("pagoda chat: type a message, /exit to quit, Ctrl-C to stop a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            result = stream_to(client, sys.stdout, False, messages=history, **generation_kwargs(args))
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": result.text})


def cmd_models(args: argparse.Namespace) -> int:
    """``pagoda models``."""
    with _client(args) as client:
        info = client.model_info()
    if args.json:
        print(json.dumps(dataclasses.asdict(info)))
        return 0
    for key, value in info.__dict__.items():
        if key != "loras":
            print(f"{key:<20}{value}")
    for a in info.loras:  # what --lora may name
        print(f"{'lora':<20}{a.name}  rank {a.rank}  {','.join(a.target_modules)}  {a.path}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``pagoda status``."""
    with _client(args) as client:
        status = client.status()
    print(json.dumps(status_document(status)) if args.json else format_status(status))
    return 0


def status_document(status: ServerStatus) -> dict[str, Any]:
    """``pagoda status --json``: every field, executors (with their kernels) as objects."""
    return dataclasses.asdict(status)


def format_status(status: ServerStatus) -> str:
    """``pagoda status``: totals, one row per executor (and who holds it), and each executor's KV cache dtype,
    kernels and (an executor group) ranks under it."""
    lines = [
        f"scheduler {status.scheduler_id}  live schedulers {', '.join(status.schedulers)}",
        f"running {status.num_running}  waiting {status.num_waiting}  kv usage {status.kv_cache_usage:.1%}  "
        f"requests {status.num_requests_total}  preemptions {status.num_preemptions_total}  "
        f"prefix hits {status.prefix_cache_hits_total}/{status.prefix_cache_queries_total} tokens  "
        f"offload hits {status.offload_hit_tokens_total} tokens  swaps {status.num_swaps_total}",
        f"{'executor':<22}{'state':<14}{'running':>8}{'waiting':>8}{'free/total blocks':>20}{'kv':>8}  holder",
    ]
    for e in status.executors:
        blocks = f"{e.num_free_kv_blocks}/{e.num_kv_blocks}"
        lines.append(
            f"{e.address:<22}{e.state:<14}{e.num_running:>8}{e.num_waiting:>8}{blocks:>20}{e.kv_cache_usage:>8.1%}"
            f"  {e.lease_holder or '-'}"
        )
        if e.kv_cache_dtype:
            lines.append(f"  kv cache dtype: {e.kv_cache_dtype}")
        if e.quantization:
            lines.append(f"  quantization: {e.quantization}")
        if e.batch_invariant:
            lines.append("  batch-invariant: yes")
        if e.loras:
            lines.append(f"  loras: {', '.join(e.loras)}")
        if e.kernels:
            lines.append("  kernels: " + "  ".join(f"{part}={path}" for part, path in e.kernels.items()))
        if e.kv_offload:
            lines.append(f"  kv offload: {e.kv_offload}, {e.num_tier_blocks} blocks")
        lines += _group_lines(e)
    return "\n".join(lines)


def _group_lines(e: ExecutorStatus) -> list[str]:
    """An executor group's shape and how recently its ranks all met, then one line per rank; none for a plain
    executor."""
    if not e.group_ranks:
        return []
    lines = [
        f"  group: tensor {e.tensor_parallel_size} x pipeline {e.pipeline_parallel_size}  "
        f"last contact {e.group_last_contact_s:.1f} s ago"
    ]
    for r in e.group_ranks:
        lines.append(
            f"  rank {r.rank}  {r.host}  pid {r.pid}  {r.shard}  rss {_size(r.rss_bytes)}  "
            f"kv {_size(r.kv_cache_bytes)}  {r.health}"
        )
    return lines


def _size(num_bytes: int) -> str:
    """A byte count in MiB, or GiB from 1 GiB, to three digits: 281 MiB, 4.0 MiB, 13.2 GiB."""
    value, unit = (num_bytes / 2**30, "GiB") if num_bytes >= 2**30 else (num_bytes / 2**20, "MiB")
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pagoda``; returns (and exits with) the exit code."""
    from pagoda.launch.serve import cmd_serve, split_passthrough

    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = split_passthrough(argv)
    parser = build_parser(own[0] if own else "")
    args, unknown = parser.parse_known_args(own)
    if unknown and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "serve":
            return cmd_serve(args, unknown + passthrough)
        if args.command in ("generate", "chat"):
            setup_tracing("pagoda-client", args.otlp_endpoint)
        run: Callable[[argparse.Namespace], int] = args.func  # a built-in command's, or a plug-in's
        return run(args)
    except PagodaError as error:
        print(f"error: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())
