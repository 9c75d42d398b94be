"""Multi-LoRA serving, measured side by side: W-mixed with 8 adapters against the base model alone and HF + PEFT.

    .venv/bin/python bench/bench_lora_serve.py [--rounds 3] [--hf-batches 2]

Eight random LoRA adapters of rank 16 on all seven modules of the default model
(SmolLM2-135M-Instruct) are written once into a temporary folder. Two servers
are started in turn (``pagoda serve --dtype bfloat16 --kv-cache-memory 1GiB``,
1 executor): one without adapters, one with the eight registered
(``--lora``, ``--max-loras 8``). Each round draws a fresh W-mixed workload (64
requests, prompts 16-512, outputs 16-256, all at once, greedy, ``ignore_eos``;
seed 100 + round) and runs it

- on the server without adapters, every request on the base model (``base, no adapters``);
- on the server with adapters, every request on the base model (``base, 8 registered``);
- on the server with adapters, request i on adapter i % 8 (``8 adapters``).

A prompt is never served twice from the prefix cache: blocks are keyed by
adapter, each round's prompts are new, and the two base runs are on different
servers. HF + PEFT runs ``--hf-batches`` adapters' requests of the first
round's workload, each adapter's 8 requests as one static batch
(``PeftModel.generate``, bf16, left-padded, greedy, every request to its own
length), as vLLM's and TGI's docs compare.

Prints tokens/s per configuration and round, medians, and the ratios the issue
sets: 8 adapters / base (goal >= 0.85), base with adapters registered / without
(goal >= 1.0), 8 adapters / HF + PEFT (goal >= 5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stop_signals import stop_on_signals  # noqa: E402

from pagoda.launch.launcher import Launcher  # noqa: E402
from pagoda_bench.backend_hf import resolve_model_path  # noqa: E402
from pagoda_bench.backend_pagoda import PagodaBackendConfig, run_pagoda  # noqa: E402
from pagoda_bench.progress import ProgressBar  # noqa: E402
from pagoda_bench.workload import BenchRequest, random_workload  # noqa: E402

NUM_ADAPTERS = 8
RANK = 16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SERVE = dict(dtype="bfloat16", kv_cache_memory="1GiB", startup_timeout_s=600)


def write_adapters(model_path: str, folder: Path) -> list[Path]:
    """NUM_ADAPTERS PEFT adapters of rank RANK with random A and B (PEFT starts B at zero), saved as PEFT does."""
    import peft
    import torch
    import transformers

    paths = []
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
        config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(MODULES))
        adapted = peft.get_peft_model(model, config)
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.01)
        adapted.save_pretrained(folder / f"lora{i}")
        paths.append(folder / f"lora{i}")
    return paths


def workload(round_index: int, vocab: tuple[int, tuple[int, ...]]) -> list[BenchRequest]:
    vocab_size, eos_ids = vocab
    return random_workload(64, (16, 512), (16, 256), 100 + round_index, vocab_size, eos_ids)


def tokens_per_s(target: str, requests: list[BenchRequest], loras: tuple[str, ...]) -> float:
    config = PagodaBackendConfig(target, loras=loras, max_duration_s=900)
    records, duration_s = run_pagoda(requests, [0.0] * len(requests), config, ProgressBar(len(requests), enabled=False))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return sum(r.output_len for r in records) / duration_s


def hf_peft_tokens_per_s(model_path: str, adapters: list[Path], requests: list[BenchRequest], batches: int) -> float:
    """Each of the first ``batches`` adapters' requests (request i on adapter i % 8) as one static batch."""
    import peft
    import torch
    import transformers

    from pagoda_bench.backend_hf import run_batch, warm_up

    base = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.bfloat16)
    model = peft.PeftModel.from_pretrained(base, adapters[0], adapter_name="lora0")
    for i, path in enumerate(adapters[1:batches], start=1):
        model.load_adapter(path, adapter_name=f"lora{i}")
    model.eval()
    warm_up(model, NUM_ADAPTERS)
    tokens, seconds = 0, 0.0
    for i in range(batches):
        model.set_adapter(f"lora{i}")
        batch = [r for r in requests if r.index % NUM_ADAPTERS == i]
        start = time.perf_counter()
        run_batch(model, batch, start, float("inf"))
        seconds += time.perf_counter() - start
        tokens += sum(r.output_len for r in batch)
        print(f"  HF + PEFT lora{i}: {len(batch)} requests, {tokens / seconds:.1f} tokens/s so far", flush=True)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-batches", type=int, default=2, help="adapters whose batch HF + PEFT runs (0: skip)")
    args = parser.parse_args()
    stop_on_signals()
    model_path = resolve_model_path("default")
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    eos = config.eos_token_id
    vocab = (config.vocab_size, tuple(eos) if isinstance(eos, list) else (eos,))
    rates: dict[str, list[float]] = {"base, no adapters": [], "base, 8 registered": [], "8 adapters": []}
    names = tuple(f"lora{i}" for i in range(NUM_ADAPTERS))
    with tempfile.TemporaryDirectory(prefix="pagoda-lora-bench-") as tmp:
        adapters = write_adapters(model_path, Path(tmp))
        lora_args = [arg for name, path in zip(names, adapters) for arg in ("--lora", f"{name}={path}")]
        for round_index in range(args.rounds):
            requests = workload(round_index, vocab)
            with _server([]) as plain:
                rates["base, no adapters"].append(tokens_per_s(plain.target, requests, ()))
            with _server([*lora_args, "--max-loras", str(NUM_ADAPTERS)]) as served:
                runs = [("8 adapters", names), ("base, 8 registered", ())]
                for label, loras in runs if round_index % 2 else runs[::-1]:
                    rates[label].append(tokens_per_s(served.target, requests, loras))
            print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
        hf = hf_peft_tokens_per_s(model_path, adapters, workload(0, vocab), args.hf_batches) if args.hf_batches else 0
    median = {label: statistics.median(values) for label, values in rates.items()}
    print("\nW-mixed tokens/s (64 requests, prompts 16-512, outputs 16-256, bf16), median of", args.rounds, "rounds:")
    for label, value in median.items():
        print(f"  {label:20s} {value:8.1f}   rounds: {', '.join(f'{v:.1f}' for v in rates[label])}")
    ratio = median["8 adapters"] / median["base, 8 registered"]
    print(f"  8 adapters / base (both on the server with adapters): {ratio:.3f}")
    print(
        f"  base with adapters registered / without: {median['base, 8 registered'] / median['base, no adapters']:.3f}"
    )
    if hf:
        print(f"  HF + PEFT (bf16, one static batch per adapter): {hf:.1f} tokens/s")
        print(f"  8 adapters / HF + PEFT: {median['8 adapters'] / hf:.1f}x")


def _server(extra: list[str]) -> Launcher:
    """The server (entered: started), logging into a temporary folder."""
    return Launcher(None, extra_executor_args=extra, log_dir=tempfile.mkdtemp(prefix="pagoda-lora-logs-"), **SERVE)


if __name__ == "__main__":
    main()
