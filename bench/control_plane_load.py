"""A load process for the control-plane benchmark: closed-loop streams on one scheduler.

Keeps --streams requests in flight (each ends, the next starts), with random
token-id prompts, greedy sampling and a fixed max_tokens, through one kind of
client (--client; control_plane_clients.py): the generated stub (the lightest,
so that the load costs the machine little), the project's asyncio client
library, or OpenAI-compatible SSE over the scheduler's HTTP API (--target is
then its HTTP address).

Its stdin steers it: a line "mark" opens the measurement window, a line "end"
closes it, end of file stops the load. In the window it records, for every
response that carries tokens but its request's first (that gap is the time to
first token), the gap since the request's previous such response and the
tokens it carried. When stdin closes or --max-s passes, it prints one JSON
line: requests finished, tokens received, errors by status, its own CPU
seconds, and the window's length, tokens and gaps (control_plane_gaps.py).

    python bench/control_plane_load.py --target 127.0.0.1:50051 --streams 64 --max-s 60 < /dev/null
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import sys
import time

from control_plane_clients import CLIENTS, LoadClient, RequestFailed
from control_plane_gaps import GapHistogram

# Token ids below this are the simulated tokenizer's special tokens.
FIRST_WORD_ID = 4


class Load:
    """Counters of one load process; those of the measurement window kept apart."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.requests = 0
        self.stopping = False
        self.tokens = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.in_window = False
        self.window_start_s: float | None = None
        self.window_end_s: float | None = None
        self.window_tokens = 0
        self.gaps = GapHistogram()

    def prompt(self) -> list[int]:
        """A fresh prompt of random word ids."""
        length = self.rng.randint(self.args.prompt_len // 2, self.args.prompt_len * 3 // 2)
        return [self.rng.randrange(FIRST_WORD_ID, self.args.vocab_size) for _ in range(length)]

    def received(self, previous_s: float | None, num_tokens: int) -> float:
        """Count a response of `num_tokens` tokens (its request's previous one came at `previous_s`); its time."""
        now_s = time.perf_counter()
        self.tokens += num_tokens
        if self.in_window:
            self.window_tokens += num_tokens
            if previous_s is not None:
                self.gaps.add(now_s - previous_s, num_tokens)
        return now_s

    def control(self, line: str) -> None:
        """Follow one line of stdin: "mark" opens the window, "end" closes it."""
        if line == "mark" and self.window_start_s is None:
            self.window_start_s, self.in_window = time.perf_counter(), True
        elif line == "end" and self.in_window:
            self.window_end_s, self.in_window = time.perf_counter(), False

    async def stream_forever(self, client: LoadClient) -> None:
        """One closed-loop stream: a request, then the next as soon as it ends, until the load stops.

        The flag, not only the cancellation, ends it: Python 3.11's `asyncio.wait_for` (inside the SSE
        client) can swallow a cancellation that meets its request's end, and the loop would go on."""
        while not self.stopping:
            try:
                await client.generate(self.prompt(), self.received)
                self.requests += 1
            except RequestFailed as exc:
                self.errors[exc.status] += 1
                await asyncio.sleep(0.1)  # no tight loop against a failing server

    def report(self) -> dict:
        """The JSON line this process ends with."""
        self.control("end")
        start, end = self.window_start_s, self.window_end_s
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "errors": dict(self.errors),
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "window": {
                "s": end - start if start is not None and end is not None else 0.0,
                "tokens": self.window_tokens,
                "gaps": self.gaps.to_json(),
            },
        }


async def follow_stdin(load: Load) -> None:
    """Hands each line of stdin to `load.control`; returns at end of file (the benchmark's signal to stop)."""
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    fd = sys.stdin.fileno()
    pending = b""

    def on_readable() -> None:
        nonlocal pending
        data = os.read(fd, 4096)
        if not data:
            loop.remove_reader(fd)
            closed.set()
            return
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            load.control(line.decode().strip())

    loop.add_reader(fd, on_readable)
    await closed.wait()


async def run(args: argparse.Namespace) -> dict:
    load = Load(args)
    client = CLIENTS[args.client](args.target, args.max_tokens, args.max_s)
    try:
        streams = [asyncio.create_task(load.stream_forever(client)) for _ in range(args.streams)]
        stop = asyncio.create_task(follow_stdin(load))
        done, _ = await asyncio.wait([stop, *streams], timeout=args.max_s, return_when=asyncio.FIRST_COMPLETED)
        report = load.report()  # before cancelling: the streams cut short are not the window's
        load.stopping = True
        for task in [stop, *streams]:
            task.cancel()
        await asyncio.gather(stop, *streams, return_exceptions=True)
        for task in done - {stop}:
            task.result()  # a stream only ends by a bug: raise it
    finally:
        await client.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the scheduler's gRPC address (its HTTP one for sse)")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="stub")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--prompt-len", type=int, default=64, help="mean prompt tokens (uniform in [n/2, 3n/2])")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-s", type=float, default=600.0, help="stop after this long even if stdin stays open")
    args = parser.parse_args()
    print("ready", flush=True)
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
