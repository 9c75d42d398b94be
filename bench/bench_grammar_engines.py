"""Grammar engines side by side on SmolLM2's tokenizer (49,152 tokens): schema compilation and per-step masks.

Usage:
    python bench/bench_grammar_engines.py [--batches 1,64] [--schemas 5] [--engines llguidance,xgrammar,pagoda]

For each engine, in one run:
- compile: time from a schema to its first mask (a matcher built and its
  first mask filled), cold (a schema the engine has not seen: a property name
  changes each time) and cached (the same schema again);
- mask: one decode step's masks at batch B: B matchers of the schema, each
  fed the tokens of one valid instance, timing the fill of all B masks per
  step (xgrammar: one fill per matcher; llguidance: its batch fill on its
  thread pool; pagoda: ``ConstraintEngine.masks``, what the executor runs per
  step on its thread beside the forward: consume the last token, fill, expand
  to a logit bias), and ``apply``, what the sampler adds on the critical path
  (the bias added to B rows of logits).
Medians over the steps of the instance; the table prints ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from executor_svc.loading.model_cache import prepare_default_model
from executor_svc.loading.tokenizer_files import load_tokenizer_files

VOCAB_SIZE = 49152


def schema(variant: int) -> dict:
    """A nested schema with arrays, enums, ranges and required fields; ``variant`` renames one property."""
    item = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "price": {"type": "number", "minimum": 0},
        },
        "required": ["sku", "quantity", "price"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            f"order_id_{variant}": {"type": "integer"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "tier": {"enum": ["gold", "silver", "bronze"]}},
                "required": ["name", "tier"],
            },
            "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 10},
            "notes": {"type": "string", "maxLength": 200},
        },
        "required": [f"order_id_{variant}", "customer", "items"],
        "additionalProperties": False,
    }


def instance(variant: int) -> str:
    """A compact JSON text that matches ``schema(variant)``."""
    items = [{"sku": f"ABC-{1000 + i}", "quantity": i + 1, "price": 9.5 + i} for i in range(3)]
    value = {
        f"order_id_{variant}": 12345,
        "customer": {"name": "Ada Lovelace", "tier": "gold"},
        "items": items,
        "notes": "leave at the door, please",
    }
    return json.dumps(value, separators=(",", ":"))


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench_llguidance(tokenizer_json: str, token_ids: list[int], batches: list[int], schemas: int) -> dict:
    import llguidance
    import torch

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB_SIZE)
    executor = llguidance.LLExecutor()
    options = {"whitespace_flexible": False}

    def ready(variant: int) -> llguidance.LLMatcher:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema(variant)), defaults=options)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()
        return matcher

    cold = [_timed(lambda v=v: ready(1000 + v)) for v in range(schemas)]
    template = ready(0)
    cached = [_timed(lambda: template.deep_copy().compute_bitmask()) for _ in range(schemas)]
    masks = {}
    for batch in batches:
        matchers = [template.deep_copy() for _ in range(batch)]
        bitmask = torch.zeros(batch, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
        pairs = [(m, i) for i, m in enumerate(matchers)]

        def fill(pairs=pairs, bitmask=bitmask, batch=batch) -> None:
            executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, batch)

        masks[batch] = _steps(fill, matchers, token_ids, lambda m, t: m.consume_token(t))
    return {"cold": median_ms(cold), "cached": median_ms(cached), "masks": masks}


def bench_xgrammar(tokenizer_json: str, token_ids: list[int], batches: list[int], schemas: int) -> dict:
    import tokenizers
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE)
    compiler = xgr.GrammarCompiler(info)

    def ready(variant: int):
        compiled = compiler.compile_json_schema(json.dumps(schema(variant)), any_whitespace=False)
        matcher = xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, VOCAB_SIZE), 0)
        return compiled

    cold = [_timed(lambda v=v: ready(1000 + v)) for v in range(schemas)]
    compiled = ready(0)
    cached = [_timed(lambda: ready(0)) for _ in range(schemas)]
    masks = {}
    for batch in batches:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, VOCAB_SIZE)

        def fill(matchers=matchers, bitmask=bitmask) -> None:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)

        masks[batch] = _steps(fill, matchers, token_ids, lambda m, t: m.accept_token(t))
    return {"cold": median_ms(cold), "cached": median_ms(cached), "masks": masks}


def bench_pagoda(tokenizer_json: str, token_ids: list[int], batches: list[int], schemas: int) -> dict:
    """The executor's own per-step path (ConstraintEngine.masks), on states that grow by one token a step."""
    import torch

    from executor_svc.sampling.constraints import ConstraintEngine
    from executor_svc.sampling.ops import apply_bias
    from executor_svc.serving.sequence_table import SequenceState
    from pagoda.constraint import Constraint
    from pagoda.params import SamplingParams

    engine = ConstraintEngine(tokenizer_json, VOCAB_SIZE, (2,))

    def ready(variant: int) -> None:
        state = SequenceState(
            0, "", [1], 1, SamplingParams(), [], 0, Constraint("json_schema", json.dumps(schema(variant)))
        )
        engine.masks([(0, state)])

    cold = [_timed(lambda v=v: ready(1000 + v)) for v in range(schemas)]
    ready(0)
    cached = [_timed(lambda: ready(0)) for _ in range(schemas)]
    # The sampler's add runs on the model thread's warm OpenMP team in the executor; here a cold team of 2
    # threads on a busy 2-core machine costs ~10 ms to wake whatever the size: time it on one thread.
    torch.set_num_threads(1)
    masks, applies = {}, {}
    constraint = Constraint("json_schema", json.dumps(schema(0)))
    for batch in batches:
        states = [SequenceState(i, "", [1], 1, SamplingParams(), [], 0, constraint) for i in range(batch)]
        entries = list(enumerate(states))
        samples, apply_samples = [], []
        logits = torch.randn(batch, VOCAB_SIZE)  # [B, V]
        for token_id in token_ids:
            start = time.perf_counter()
            step = engine.masks(entries)
            samples.append(time.perf_counter() - start)
            apply_samples.append(_timed(lambda step=step, logits=logits: apply_bias(logits, step.rows, step.bias)))
            logits.normal_()
            for state in states:
                state.token_ids.append(token_id)
        masks[batch], applies[batch] = median_ms(samples), median_ms(apply_samples)
    return {"cold": median_ms(cold), "cached": median_ms(cached), "masks": masks, "apply": applies}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _steps(fill: Callable[[], None], matchers: list, token_ids: list[int], consume: Callable) -> float:
    """Median ms of ``fill`` over the steps of one instance, every matcher consuming the next token after each."""
    samples = []
    for token_id in token_ids:
        samples.append(_timed(fill))
        for matcher in matchers:
            consume(matcher, token_id)
    return median_ms(samples)


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "pagoda": bench_pagoda}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--schemas", type=int, default=5, help="cold compilations timed (distinct schemas)")
    parser.add_argument("--engines", default="llguidance,xgrammar,pagoda")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer_json = load_tokenizer_files(prepare_default_model()).tokenizer_json
    import tokenizers

    token_ids = tokenizers.Tokenizer.from_str(tokenizer_json).encode(instance(0), add_special_tokens=False).ids
    print(f"SmolLM2 tokenizer ({VOCAB_SIZE} tokens); instance of {len(token_ids)} tokens; batches {batches}")
    header = f"{'engine':<12}{'cold ms':>10}{'cached ms':>11}" + "".join(f"{f'mask@{b} ms':>13}" for b in batches)
    header += "".join(f"{f'apply@{b} ms':>14}" for b in batches)
    print(header)
    for name in args.engines.split(","):
        try:
            row = ENGINES[name](tokenizer_json, token_ids, batches, args.schemas)
        except ImportError as exc:  # xgrammar is not a dependency: pip install xgrammar to compare
            print(f"{name:<12}skipped: {exc}")
            continue
        masks = "".join(f"{row['masks'][b]:>13.3f}" for b in batches)
        applies = "".join(f"{row['apply'][b]:>14.3f}" if "apply" in row else f"{'-':>14}" for b in batches)
        print(f"{name:<12}{row['cold']:>10.2f}{row['cached']:>11.3f}{masks}{applies}", flush=True)


if __name__ == "__main__":
    main()
