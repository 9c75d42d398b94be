"""How the draft model should pick its drafts for sampled requests: with the request's random stream, or greedily.

Usage:
    python bench/bench_draft_sampling.py [--draft truncate:10|self|DIR] [--temperatures 0.7,1.0]
        [--num-requests 4] [--max-tokens 96] [--k 4]

In this process (no server): SmolLM2-135M-Instruct bf16 as the model, and a
draft model (``truncate:N``: its own first N layers, bench/draft_models.py;
``self``: itself; or a folder). The chat requests of ``spec_workload.py``,
each with its own seed, decode ``--max-tokens`` tokens with K draft-model
tokens per step, once with each way of drafting:
- ``coupled`` (what the executor does): the draft model samples with the
  request's parameters and (seed, position) Gumbel noise, the noise the model's
  own sample at that position uses;
- ``greedy``: the draft model's argmax.
Prints, per temperature, the acceptance (accepted / drafted) and tokens per
step of each. The tokens returned are the same either way (checked): the
verification rule makes them plain decoding's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from draft_models import build_truncated_draft
from spec_workload import grounded_requests

from executor_svc.loading.model_cache import resolve_model
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import SamplingParams


def prompt_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    """The chat template applied to ``messages`` and tokenized, as the scheduler does."""
    from executor_svc.loading.tokenizer_files import read_tokenizer_files
    from scheduler_svc.text.tokenizer import Tokenizer

    files = read_tokenizer_files(model_dir)
    tokenizer = Tokenizer.from_info(files.tokenizer_json, files.chat_template, files.bos_token, files.eos_token)
    return tokenizer.apply_chat_template(messages)


def decode(runner: ModelRunner, prompt: list[int], sampling: SamplingParams, k: int, max_tokens: int):
    """(tokens, drafted, accepted, steps) of one request decoded with k draft-model tokens per step."""
    block_size = runner.block_size
    blocks = list(range(-(-(len(prompt) + max_tokens + k + 1) // block_size)))
    num_blocks = -(-len(prompt) // block_size)
    new = t.NewSequence(1, "r", tuple(prompt), len(prompt), sampling, tuple(blocks[:num_blocks]), 0, len(prompt))
    tokens = list(runner.execute(t.StepPlan(0, new_seqs=(new,))).outputs[0].token_ids)
    drafted = accepted = steps = 0
    while len(tokens) < max_tokens:
        state = runner._seqs[1]
        needed = -(-(len(state.token_ids) + k) // block_size)
        entry = t.ScheduledSequence(1, 1, tuple(blocks[len(state.block_table) : needed]), (), k)
        out = runner.execute(t.StepPlan(steps + 1, scheduled_seqs=(entry,)))
        assert not out.errors, out.errors
        got = out.outputs[0].token_ids
        tokens += got
        drafted, accepted, steps = drafted + k, accepted + len(got) - 1, steps + 1
    runner.reset()
    return tokens[:max_tokens], drafted, accepted, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="truncate:10")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    model_dir = Path(resolve_model("default"))
    with tempfile.TemporaryDirectory() as tmp:
        if args.draft.startswith("truncate:"):
            draft = build_truncated_draft(model_dir, Path(tmp) / "draft", int(args.draft.split(":")[1]))
        else:
            draft = model_dir if args.draft == "self" else Path(args.draft)
        runner = ModelRunner(str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=2**28, draft_model_path=str(draft))
        runner.warmup()
        assert runner.draft is not None
        prompts = [prompt_ids(model_dir, messages) for messages in grounded_requests(args.num_requests)]
        print(f"draft {args.draft}, K {args.k}, {len(prompts)} requests of {args.max_tokens} tokens")
        for temperature in (float(x) for x in args.temperatures.split(",")):
            tokens_by_way = {}
            for coupled in (True, False):
                runner.draft.coupled = coupled
                totals = [0, 0, 0]
                outputs = []
                for i, prompt in enumerate(prompts):
                    sampling = SamplingParams(temperature=temperature, seed=1000 + i)
                    tokens, *counts = decode(runner, prompt, sampling, args.k, args.max_tokens)
                    outputs.append(tokens)
                    totals = [a + b for a, b in zip(totals, counts)]
                drafted, accepted, steps = totals
                way = "coupled" if coupled else "greedy"
                tokens_by_way[way] = outputs
                print(
                    f"  temperature {temperature}, {way:>7} drafts: acceptance {accepted / drafted:.2f}, "
                    f"{1 + accepted / steps:.2f} tokens per step"
                )
            same = sum(a == b for a, b in zip(tokens_by_way["coupled"], tokens_by_way["greedy"]))
            print(f"  temperature {temperature}: {same} of {len(prompts)} requests gave the same tokens both ways")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
