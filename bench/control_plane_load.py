"""A load process for the control-plane benchmark: closed-loop streams on one scheduler.

Keeps --streams Generate calls in flight (each ends, the next starts), with
random token-id prompts and a fixed max_tokens, through the generated stub (the
lightest client, so that the load costs the machine little). Runs until its
stdin closes or --max-s passes, then prints one JSON line: requests finished,
tokens received, errors by status, and its own CPU seconds.

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

import grpc

from pagoda.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# Token ids below this are the simulated tokenizer's special tokens.
FIRST_WORD_ID = 4


class Load:
    """Counters of one load process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.requests = 0
        self.tokens = 0
        self.errors: collections.Counter[str] = collections.Counter()

    def request(self) -> generation_pb2.GenerateRequest:
        """A fresh prompt of random word ids."""
        length = self.rng.randint(self.args.prompt_len // 2, self.args.prompt_len * 3 // 2)
        prompt = [self.rng.randrange(FIRST_WORD_ID, self.args.vocab_size) for _ in range(length)]
        return generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIdsInput(token_ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0.0),
            stopping=generation_pb2.StoppingCriteria(max_tokens=self.args.max_tokens, ignore_eos=True),
        )

    async def stream_forever(self, stub: generation_pb2_grpc.GenerationStub) -> None:
        """One closed-loop stream: a request, then the next as soon as it ends."""
        while True:
            try:
                async for response in stub.Generate(self.request(), timeout=self.args.max_s):
                    self.tokens += len(response.token_ids)
                self.requests += 1
            except grpc.aio.AioRpcError as exc:
                self.errors[exc.code().name] += 1
                await asyncio.sleep(0.1)  # no tight loop against a failing server


async def stdin_closed() -> None:
    """Returns when stdin reaches end of file (the benchmark closes it to stop the load)."""
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    fd = sys.stdin.fileno()

    def on_readable() -> None:
        if not os.read(fd, 4096):
            loop.remove_reader(fd)
            closed.set()

    loop.add_reader(fd, on_readable)
    await closed.wait()


async def run(args: argparse.Namespace) -> dict:
    load = Load(args)
    async with grpc.aio.insecure_channel(args.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = [asyncio.create_task(load.stream_forever(stub)) for _ in range(args.streams)]
        stop = asyncio.create_task(stdin_closed())
        done, _ = await asyncio.wait([stop, *streams], timeout=args.max_s, return_when=asyncio.FIRST_COMPLETED)
        for task in [stop, *streams]:
            task.cancel()
        await asyncio.gather(stop, *streams, return_exceptions=True)
        for task in done - {stop}:
            task.result()  # a stream only ends by a bug: raise it
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "requests": load.requests,
        "tokens": load.tokens,
        "errors": dict(load.errors),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
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
