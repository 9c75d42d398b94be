"""A tiny but complete model folder for end-to-end tests: random Llama weights
(transformers, safetensors), a byte-level BPE tokenizer trained in well under a
second, a chat template and generation config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch at every step.",
    "Pagoda serves language models with a scheduler and executors over gRPC.",
    "Héllo wörld, ünïcode: 日本語のテキスト, emoji 🙂🚀 and numbers 1234567890.",
    "def add(a, b):\n    return a + b\n",
] * 20


def train_tokenizer(vocab_size: int, corpus: list[str] = CORPUS, special_tokens: list[str] = SPECIAL_TOKENS):
    """A byte-level BPE tokenizer trained on ``corpus``; the first ids are the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def build_tiny_model(
    folder: Path,
    *,
    vocab_size: int = 384,
    seed: int = 0,
    num_layers: int = 2,
    max_position_embeddings: int = 1024,
    tokenizer_from: Path | None = None,
) -> Path:
    """Write the whole model folder; returns it. ``tokenizer_from``: copy that folder's tokenizer files
    (a draft model of that model) instead of training one."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    if tokenizer_from is None:
        return write_tokenizer_files(folder, vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


def write_tokenizer_files(folder: Path, vocab_size: int) -> Path:
    """What serving a checkpoint folder needs besides the weights: a trained tokenizer of ``vocab_size``
    tokens, its config with the chat template, and a generation config (EOS 0, BOS 1); returns the folder."""
    train_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|endoftext|>",
                "bos_token": "<|im_start|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    return folder


def hf_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """The oracle: transformers greedy generate in fp32 on the same weights."""
    import torch

    model = _load(folder)
    input_ids = torch.tensor([prompt_ids])
    eos = model.config.eos_token_id
    model.generation_config.eos_token_id = None if ignore_eos else eos
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


_MODELS: dict[str, object] = {}


def _load(folder: Path):
    import torch
    import transformers

    key = str(folder)
    if key not in _MODELS:
        _MODELS[key] = transformers.AutoModelForCausalLM.from_pretrained(
            folder, torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _MODELS[key]
