"""Single-request latency: Pagoda (through both gRPC services) next to Hugging
Face `generate`, same weights, same prompt, same dtype, in one run.

Prints time to first token and decode tokens/s for each, and their ratios.

    .venv/bin/python bench/bench_single_request.py [--model DIR] [--dtype float32|bfloat16] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def measure_pagoda(target: str, max_tokens: int, runs: int) -> tuple[float, float]:
    """Median TTFT (s) and decode tokens/s over `runs` streamed requests."""
    from pagoda_client import Client

    ttfts, rates = [], []
    with Client(target, timeout=600) as client:
        client.chat(PROMPT, max_tokens=4, temperature=0)  # warm-up
        for _ in range(runs):
            start = time.perf_counter()
            first = None
            count = 0
            for delta in client.stream(messages=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                if delta.token_ids and first is None:
                    first = time.perf_counter()
                count += len(delta.token_ids)
            end = time.perf_counter()
            ttfts.append(first - start)
            rates.append((count - 1) / (end - first))
    return statistics.median(ttfts), statistics.median(rates)


def measure_hf(model_dir: str, dtype: str, max_tokens: int, runs: int) -> tuple[float, float]:
    """Median TTFT (s, a 1-token generate) and decode tokens/s of HF generate."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start

    timed(4)  # warm-up
    ttfts, rates = [], []
    for _ in range(runs):
        ttft = timed(1)
        total = timed(max_tokens)
        ttfts.append(ttft)
        rates.append((max_tokens - 1) / (total - ttft))
    return statistics.median(ttfts), statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from executor_svc.loading.model_cache import resolve_model
    from pagoda.launch.launcher import Launcher

    model_dir = resolve_model(args.model or "default")
    with Launcher(model_dir, dtype=args.dtype, kv_cache_memory="256MiB") as system:
        p_ttft, p_rate = measure_pagoda(system.target, args.max_tokens, args.runs)
    h_ttft, h_rate = measure_hf(model_dir, args.dtype, args.max_tokens, args.runs)
    print(f"model {model_dir} dtype {args.dtype} max_tokens {args.max_tokens} runs {args.runs} (medians)")
    print(f"{'':8s} {'TTFT ms':>10s} {'decode tok/s':>14s}")
    print(f"{'pagoda':8s} {p_ttft * 1e3:10.1f} {p_rate:14.1f}")
    print(f"{'hf':8s} {h_ttft * 1e3:10.1f} {h_rate:14.1f}")
    print(f"ratio pagoda/hf: TTFT {p_ttft / h_ttft:.2f}x, decode {p_rate / h_rate:.2f}x")


if __name__ == "__main__":
    main()
