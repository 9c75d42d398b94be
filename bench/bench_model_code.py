"""A family's decode step with this tree's model code and with another git ref's, side by side.

Usage:
    python bench/bench_model_code.py [--ref main] [--module executor_svc/models/llama.py]
        [--model DIR_OR_GGUF] [--batches 1,8,48] [--context 400] [--dtype bfloat16] [--steps 5] [--rounds 3]

Both models are built from the same checkpoint into one runner (same KV
cache, same attention backend, same C++ kernels: the installed build) and
take turns, step for step, so a refactor of the model code (its Python, the
ops it calls) can be shown to cost nothing. The ref's module must define
``LlamaModel(config, tensors, dtype, device, max_len, ops)`` (the builder
protocol); its imports resolve against this tree.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import types

from bench_executor import AttentionTimer, decode_step

from executor_svc.loading.weights import load_checkpoint, validate_tensors
from executor_svc.runner.model_runner import ModelRunner


def load_ref_module(ref: str, path: str) -> types.ModuleType:
    """The module at ``path`` as of git ``ref``, imported under the name ``<stem>_at_ref``."""
    source = subprocess.run(["git", "show", f"{ref}:{path}"], capture_output=True, text=True, check=True, timeout=60)
    name = path.rsplit("/", 1)[-1].removesuffix(".py") + "_at_ref"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while they are built
    exec(compile(source.stdout, f"{ref}:{path}", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="main")
    parser.add_argument("--module", default="executor_svc/models/llama.py")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8,48")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from executor_svc.loading.model_cache import prepare_default_model

        args.model = str(prepare_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(args.model, dtype=args.dtype, device="cpu", kv_cache_memory_bytes=1 << 30, max_model_len=2048)
    runner.backend = AttentionTimer(runner.backend, runner.device)
    tensors = validate_tensors(runner.config, load_checkpoint(args.model).tensors)
    ref = load_ref_module(args.ref, args.module).LlamaModel(
        runner.config, tensors, runner.dtype, runner.device, runner.max_model_len, runner.model.ops
    )
    models = {"this tree": runner.model, args.ref: ref}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, model in models.items():
                runner.model = model
                times.setdefault((name, batch), []).append(decode_step(runner, batch, args.context, args.steps)[0])
    print(f"{args.model}: decode step ms, context {args.context}, {args.dtype}, median of {args.rounds} rounds")
    print(f"{'batch':>6} {'this tree':>10} {args.ref:>10} {'ratio':>7}")
    for batch in batches:
        ours, theirs = (statistics.median(times[(name, batch)]) * 1e3 for name in models)
        print(f"{batch:>6} {ours:>10.1f} {theirs:>10.1f} {ours / theirs:>7.3f}")


if __name__ == "__main__":
    main()
