"""Soak test: steady mixed load for a bounded time, then a health report.

Worker threads send, until the time is up, a mix of normal requests, requests
the client cancels (closes the stream after a few deltas, or before any) and
malformed requests (raw bytes the server must refuse with INVALID_ARGUMENT).
At the end it reports requests served, outcomes by status, each process's
resident memory (VmRSS) at start and end, and the KV blocks free once idle,
which must equal the pool. Exit status 1 when the pool is not whole, a process
died, or an outcome was unexpected.

    .venv/bin/python bench/soak.py --tiny --duration-s 120          # tiny random model
    .venv/bin/python bench/soak.py --model default --duration-s 3600 --concurrency 16
    .venv/bin/python bench/soak.py --target 127.0.0.1:50051 --pid 1234 --pid 1240
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from pagoda.launch.launcher import Launcher
from pagoda.v1 import generation_pb2 as g
from pagoda_client import Client, PagodaError

KINDS = ("normal", "cancelled", "malformed")
GENERATE = "/pagoda.v1.Generation/Generate"


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` from /proc/PID/status, in MiB (None: gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def malformed_requests(vocab_size: int) -> list[bytes]:
    """Wire payloads every server must refuse with INVALID_ARGUMENT."""

    def base(**sampling) -> g.GenerateRequest:
        msg = g.GenerateRequest(token_ids=g.TokenIdsInput(token_ids=[5, 6, 7]))
        msg.stopping.max_tokens = 4
        for name, value in sampling.items():
            setattr(msg.sampling, name, value)
        return msg

    bad_vocab = g.GenerateRequest(token_ids=g.TokenIdsInput(token_ids=[1, vocab_size]))
    many_stops = base()
    many_stops.stopping.stop.extend(f"s{i}" for i in range(1000))
    return [
        b"\x12\x04ok\xff\xfe",  # text field that is not UTF-8
        base().SerializeToString()[:-1],  # truncated
        base(temperature=math.nan).SerializeToString(),
        base(top_p=0.0).SerializeToString(),
        base(logprobs=10_000).SerializeToString(),
        bad_vocab.SerializeToString(),
        many_stops.SerializeToString(),
        g.GenerateRequest().SerializeToString(),  # no input
    ]


@dataclasses.dataclass
class Tally:
    """Outcomes, thread-safe."""

    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: int = 0
    unexpected: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, kind: str, status: str, num_tokens: int = 0, expected: bool = True) -> None:
        with self.lock:
            self.outcomes[(kind, status)] += 1
            self.tokens += num_tokens
            if not expected and len(self.unexpected) < 20:
                self.unexpected.append(f"{kind}: {status}")


class LoadWorker(threading.Thread):
    """Sends requests until `deadline`, tallying each outcome."""

    def __init__(
        self, index: int, client: Client, channel: grpc.Channel, args, vocab_size: int, deadline: float, tally: Tally
    ) -> None:
        super().__init__(name=f"soak-{index}", daemon=True)
        self.rng = random.Random(args.seed * 1000 + index)
        self.client, self.args, self.vocab_size = client, args, vocab_size
        self.deadline, self.tally = deadline, tally
        self.raw = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        self.malformed = malformed_requests(vocab_size)

    def run(self) -> None:
        weights = [self.args.normal, self.args.cancelled, self.args.malformed]
        while time.monotonic() < self.deadline:
            kind = self.rng.choices(KINDS, weights)[0]
            getattr(self, f"_{kind}")()

    def _params(self) -> dict:
        prompt = [self.rng.randrange(3, self.vocab_size) for _ in range(self.rng.randint(4, self.args.max_prompt))]
        sampling = (
            {"temperature": 0} if self.rng.random() < 0.5 else {"temperature": 0.8, "seed": self.rng.getrandbits(32)}
        )
        return dict(
            token_ids=prompt,
            max_tokens=self.rng.randint(1, self.args.max_tokens),
            ignore_eos=self.rng.random() < 0.5,
            **sampling,
        )

    def _normal(self) -> None:
        try:
            result = self.client.generate(**self._params())
            self.tally.add("normal", "OK", len(result.token_ids))
        except PagodaError as error:
            self.tally.add("normal", error.code.name, expected=False)

    def _cancelled(self) -> None:
        """Half close the stream after 1-3 tokens; half cancel the call within 50 ms of sending."""
        params = self._params() | {"max_tokens": self.args.max_tokens, "ignore_eos": True}
        if self.rng.random() < 0.5:
            self._cancel_at_once(params)
            return
        keep, received = self.rng.randint(1, 3), 0
        try:
            with self.client.stream(**params) as stream:
                for delta in stream:
                    received += len(delta.token_ids)
                    if received >= keep:
                        break
            self.tally.add("cancelled", "CANCELLED" if received < params["max_tokens"] else "OK", received)
        except PagodaError as error:
            self.tally.add("cancelled", error.code.name, expected=False)

    def _cancel_at_once(self, params: dict) -> None:
        request = g.GenerateRequest(token_ids=g.TokenIdsInput(token_ids=params["token_ids"]))
        request.stopping.max_tokens, request.stopping.ignore_eos = params["max_tokens"], True
        call = self.raw(request.SerializeToString(), timeout=self.args.request_timeout_s)
        time.sleep(self.rng.uniform(0, 0.05))
        call.cancel()
        try:
            received = sum(1 for _ in call)
            self.tally.add("cancelled", "OK", expected=received > 0)
        except grpc.RpcError as error:
            self.tally.add("cancelled", error.code().name, expected=error.code() == grpc.StatusCode.CANCELLED)

    def _malformed(self) -> None:
        payload = self.rng.choice(self.malformed)
        try:
            list(self.raw(payload, timeout=30))
            self.tally.add("malformed", "OK", expected=False)
        except grpc.RpcError as error:
            self.tally.add("malformed", error.code().name, expected=error.code() == grpc.StatusCode.INVALID_ARGUMENT)


def wait_idle(client: Client, timeout_s: float = 60) -> object:
    """The server status once nothing runs or waits (or after `timeout_s`)."""
    end = time.monotonic() + timeout_s
    status = client.status()
    while (status.num_running or status.num_waiting) and time.monotonic() < end:
        time.sleep(0.2)
        status = client.status()
    return status


def memory(pids: dict[str, int]) -> dict[str, float | None]:
    return {name: rss_mib(pid) for name, pid in pids.items()}


def run_load(target: str, args, pids: dict[str, int]) -> dict:
    """The soak itself; returns the report."""
    with (
        Client(target, timeout=args.request_timeout_s, max_retries=0) as client,
        grpc.insecure_channel(target) as channel,
    ):
        vocab_size = client.model_info().vocab_size
        client.generate(token_ids=[5, 6, 7], max_tokens=4, temperature=0)  # warm-up
        rss_start = memory(pids)
        tally, start = Tally(), time.monotonic()
        workers = [
            LoadWorker(i, client, channel, args, vocab_size, start + args.duration_s, tally)
            for i in range(args.concurrency)
        ]
        for worker in workers:
            worker.start()
        _progress(workers, tally, start, pids, args.progress_s)
        elapsed = time.monotonic() - start
        status = wait_idle(client)
        rss_end = memory(pids)
    return _report(args, tally, elapsed, status, rss_start, rss_end)


def _progress(workers: list[LoadWorker], tally: Tally, start: float, pids: dict[str, int], every_s: float) -> None:
    next_report = start + every_s
    while any(w.is_alive() for w in workers):
        time.sleep(0.5)
        if time.monotonic() >= next_report:
            next_report += every_s
            with tally.lock:
                served = sum(n for (kind, status), n in tally.outcomes.items() if status == "OK")
            rss = ", ".join(f"{k} {v:.0f}" for k, v in memory(pids).items() if v is not None)
            print(f"[{time.monotonic() - start:6.0f}s] served {served}  RSS MiB: {rss}", file=sys.stderr, flush=True)


def _report(args, tally: Tally, elapsed: float, status, rss_start: dict, rss_end: dict) -> dict:
    outcomes = {f"{kind}/{code}": n for (kind, code), n in sorted(tally.outcomes.items())}
    executors = [
        {
            "address": e.address,
            "state": e.state,
            "num_kv_blocks": e.num_kv_blocks,
            "num_free_kv_blocks": e.num_free_kv_blocks,
        }
        for e in status.executors
    ]
    pool_whole = bool(executors) and all(e["num_free_kv_blocks"] == e["num_kv_blocks"] for e in executors)
    return {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "requests_total": sum(tally.outcomes.values()),
        "requests_served": sum(n for (kind, code), n in tally.outcomes.items() if code == "OK"),
        "tokens_generated": tally.tokens,
        "outcomes": outcomes,
        "unexpected": tally.unexpected,
        "rss_mib": {name: {"start": _round(rss_start[name]), "end": _round(rss_end[name])} for name in rss_start},
        "executors": executors,
        "num_running_at_end": status.num_running,
        "num_waiting_at_end": status.num_waiting,
        "kv_pool_whole": pool_whole,
        "num_preemptions_total": status.num_preemptions_total,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _print(report: dict) -> None:
    print(
        f"soak: {report['duration_s']}s, {report['concurrency']} workers, {report['requests_total']} requests, "
        f"{report['requests_served']} served, {report['tokens_generated']} tokens generated"
    )
    for name, n in report["outcomes"].items():
        print(f"  {name:32s} {n}")
    for name, rss in report["rss_mib"].items():
        print(f"  RSS {name:14s} start {rss['start']} MiB  end {rss['end']} MiB")
    for e in report["executors"]:
        print(f"  KV {e['address']}: {e['num_free_kv_blocks']} of {e['num_kv_blocks']} blocks free ({e['state']})")
    print(
        f"  preemptions: {report['num_preemptions_total']}; KV pool whole: {report['kv_pool_whole']}; "
        f"unexpected outcomes: {report['unexpected'] or 'none'}"
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=180.0, help="how long to keep the load (default 3 min)")
    parser.add_argument("--concurrency", type=int, default=8, help="worker threads")
    parser.add_argument("--normal", type=float, default=0.7, help="weight of normal requests")
    parser.add_argument("--cancelled", type=float, default=0.2, help="weight of client-cancelled requests")
    parser.add_argument("--malformed", type=float, default=0.1, help="weight of malformed requests")
    parser.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a request")
    parser.add_argument("--max-prompt", type=int, default=96, help="longest random prompt (token ids)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--progress-s", type=float, default=30.0, help="progress line period")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", help="an already running scheduler (else one is launched)")
    parser.add_argument("--pid", type=int, action="append", default=[], help="with --target: processes to watch")
    parser.add_argument("--model", default="default", help="model for the launched system")
    parser.add_argument("--tiny", action="store_true", help="launch on a tiny random model (tests/support)")
    parser.add_argument("--executors", type=int, default=1)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="executor KV budget, e.g. 1MiB")
    parser.add_argument("--json-out", help="also write the report as JSON here")
    return parser.parse_args(argv)


def _tiny_model(folder: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.tiny_model import build_tiny_model

    return str(build_tiny_model(folder / "tiny-llama"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.target:
        report = run_load(args.target, args, {f"pid-{pid}": pid for pid in args.pid})
    else:
        with tempfile.TemporaryDirectory(prefix="pagoda-soak-") as tmp:
            model = _tiny_model(Path(tmp)) if args.tiny else args.model
            dtype = args.dtype or ("float32" if args.tiny else None)
            with Launcher(
                model,
                num_executors=args.executors,
                dtype=dtype,
                kv_cache_memory=args.kv_cache_memory,
                log_dir=Path(tmp) / "logs",
            ) as system:
                pids = {"scheduler": system.scheduler_pid}
                pids |= {f"executor-{i}": pid for i, pid in enumerate(system.executor_pids)}
                report = run_load(system.target, args, pids)
                report["processes_alive"] = system.dead_child() is None
    _print(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    healthy = report["kv_pool_whole"] and not report["unexpected"] and report.get("processes_alive", True)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
