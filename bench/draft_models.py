"""Draft models for a target checkpoint, built here (nothing downloaded): random weights, or its first layers.

Usage:
    python bench/draft_models.py OUT_DIR [--model DIR] [--random [--layers 2] [--hidden 256] [--seed 0]]
    python bench/draft_models.py OUT_DIR [--model DIR] --truncate N

Both have the target's vocabulary and a copy of its tokenizer files, as
``--draft-model`` requires:
- ``--random``: a Llama of ``--layers`` layers and ``--hidden`` width (head_dim
  64, two kv heads, tied embeddings) with random weights from a seed: for the
  mechanics of the draft model only (its proposals are random, so nearly all
  are rejected);
- ``--truncate N``: the target's own first N layers with its embeddings, final
  norm and head (the model "exits early"): a smaller draft whose proposals are
  often the model's, with no training.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def build_random_draft(target: Path, out: Path, *, layers: int = 2, hidden: int = 256, seed: int = 0) -> Path:
    """Writes a random-weight draft checkpoint of ``target``'s vocabulary into ``out``; returns ``out``."""
    import torch
    import transformers

    config = json.loads((target / "config.json").read_text())
    draft_config = transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        intermediate_size=3 * hidden,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        rope_theta=config.get("rope_theta", 10000.0),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(draft_config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return _copy_tokenizer(target, out)


def build_truncated_draft(target: Path, out: Path, num_layers: int) -> Path:
    """Writes ``target`` cut to its first ``num_layers`` layers into ``out``; returns ``out``."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise ValueError(f"--truncate must be in [1, {config['num_hidden_layers'] - 1}], got {num_layers}")
    tensors = {}
    for path in sorted(target.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                tensors[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    return _copy_tokenizer(target, out)


def _copy_tokenizer(target: Path, out: Path) -> Path:
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copyfile(target / name, out / name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="default", help="the target: a checkpoint folder or 'default'")
    parser.add_argument("--truncate", type=int, default=0, help="keep the target's first N layers")
    parser.add_argument("--layers", type=int, default=2, help="random: layers")
    parser.add_argument("--hidden", type=int, default=256, help="random: width")
    parser.add_argument("--seed", type=int, default=0, help="random: weights' seed")
    args = parser.parse_args()
    from executor_svc.loading.model_cache import resolve_model

    target = Path(resolve_model(args.model))
    if args.truncate:
        print(build_truncated_draft(target, args.out, args.truncate))
    else:
        print(build_random_draft(target, args.out, layers=args.layers, hidden=args.hidden, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
