"""The tokenizer rebuilt from GGUF metadata encodes exactly like transformers'
GGUF tokenizer import (the oracle), on the shipped SmolLM2 GGUF and on small
synthetic files for the other pre-tokenizers and the SentencePiece model."""

from __future__ import annotations

import pathlib

import gguf
import pytest
from tokenizers import Tokenizer

from executor_svc.loading import gguf_tokenizer
from executor_svc.loading.gguf_loader import read_metadata
from executor_svc.loading.model_cache import DEFAULT_GGUF_FILE, default_gguf_path

TEXTS = [
    "Hello world",
    "",
    "  leading spaces\n\n\ttabs and trailing   ",
    "1234567890 3.14159 1e-5 +42 -7,000,000",
    "def f(x):\n    return x**2  # comment\r\n\r\n",
    "Ünïcödé naïve café — 日本語のテキスト 🙂👍🏽 Ελληνικά",
    "don't I'LL we've THEY'RE it's",
    "a" * 40 + " " + "ab" * 20,
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "{\"key\": [1, 2, 3], 'x': None}",
]


def transformers_tokenizer(folder: pathlib.Path, file_name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=file_name)


def ours_from_file(path: pathlib.Path) -> tuple[Tokenizer, gguf_tokenizer.GgufTokenizer]:
    built = gguf_tokenizer.build_tokenizer(read_metadata(path))
    return Tokenizer.from_str(built.tokenizer_json), built


@pytest.fixture(scope="module")
def smollm2_metadata() -> dict:
    return read_metadata(default_gguf_path())


@pytest.fixture(scope="module")
def smollm2(smollm2_metadata: dict) -> tuple:
    built = gguf_tokenizer.build_tokenizer(smollm2_metadata)
    path = default_gguf_path()
    return Tokenizer.from_str(built.tokenizer_json), built, transformers_tokenizer(path.parent, DEFAULT_GGUF_FILE)


def test_smollm2_encodings_match_transformers(smollm2: tuple) -> None:
    ours, _, reference = smollm2
    chat = reference.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    for text in [*TEXTS, chat]:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_smollm2_special_tokens(smollm2: tuple) -> None:
    ours, built, _ = smollm2
    assert (built.bos_token, built.eos_token, built.eos_token_ids) == ("<|im_start|>", "<|im_end|>", (2,))
    assert ours.encode("<|im_start|>").ids == [1]
    assert ours.get_vocab_size() == 49152
    # SmolLM2 splits digits one by one before byte-level BPE (its tokenizer.json does too).
    pieces = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str("year 2024")]
    assert pieces == ["year", "Ġ", "2", "0", "2", "4"]


def small_bpe_subset(metadata: dict, num_tokens: int) -> tuple[list[str], list[int], list[str]]:
    """The first `num_tokens` tokens of a byte-level vocabulary and the merges closed over them."""
    tokens = list(metadata["tokenizer.ggml.tokens"][:num_tokens])
    known = set(tokens)
    merges = [
        m
        for m in metadata["tokenizer.ggml.merges"]
        if m.replace(" ", "") in known and all(part in known for part in m.split(" "))
    ]
    return tokens, list(metadata["tokenizer.ggml.token_type"][:num_tokens]), merges


def write_tokenizer_gguf(path: pathlib.Path, model: str, tokens, token_types, **extra) -> pathlib.Path:
    """A GGUF with only tokenizer metadata (what both tokenizer builders read)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if "pre" in extra:
        writer.add_tokenizer_pre(extra["pre"])
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    writer.add_bos_token_id(extra.get("bos", 1))
    writer.add_eos_token_id(2)
    if "add_bos" in extra:
        writer.add_add_bos_token(extra["add_bos"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def smollm2_subset(smollm2_metadata: dict) -> tuple[list[str], list[int], list[str]]:
    return small_bpe_subset(smollm2_metadata, 4000)


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path: pathlib.Path, smollm2_subset, pre: str) -> None:
    tokens, token_types, merges = smollm2_subset
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", tokens, token_types, pre=pre, merges=merges, add_bos=True)
    ours, _ = ours_from_file(path)
    reference = transformers_tokenizer(tmp_path, "t.gguf")
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids[0] == 1  # add_bos_token
        assert ids == reference.encode(text), (pre, text)


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("gpt2", ["Ġabc", "12345", "Ġ'", "S"]),
        ("llama-bpe", ["Ġabc", "123", "45", "Ġ'", "S"]),
        ("qwen2", ["Ġabc", "1", "2", "3", "4", "5", "Ġ'", "S"]),
    ],
)
def test_pre_tokenizer_splits(tmp_path: pathlib.Path, smollm2_subset, pre: str, expected: list[str]) -> None:
    tokens, token_types, merges = smollm2_subset
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", tokens, token_types, pre=pre, merges=merges)
    ours, _ = ours_from_file(path)
    assert [p for p, _ in ours.pre_tokenizer.pre_tokenize_str(" abc12345 'S")] == expected


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """A tiny Llama-2 style vocabulary: unk, bos, eos, 256 byte tokens, then pieces by score."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    token_types = [2, 3, 3] + [6] * 256
    pieces = [
        "▁",
        *"abcdefghijklmnopqrstuvwxyzHTW.,!?'",
        "▁t",
        "he",
        "▁the",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "▁world",
        "in",
        "▁in",
        "er",
        "▁H",
        "▁Hello",
        "at",
        "▁th",
        "▁that",
        "ing",
        "▁a",
    ]
    tokens += pieces
    token_types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, token_types, scores


SPM_TEXTS = [
    "Hello world",
    "the theater hello  world",
    " leading space and trailing ",
    "that thing, in the world!",
    "unknown é ü 日本 🙂 bytes",
    "<s>inline special</s> after",
    "line\nbreak",
    "",
]


def test_sentencepiece_matches_transformers(tmp_path: pathlib.Path) -> None:
    tokens, token_types, scores = sentencepiece_vocab()
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, token_types, scores=scores, add_bos=True)
    ours, built = ours_from_file(path)
    reference = transformers_tokenizer(tmp_path, "spm.gguf")
    for text in SPM_TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert (built.bos_token, built.eos_token) == ("<s>", "</s>")
    # Byte fallback: "é" is not a piece, so it becomes its two UTF-8 bytes.
    assert ours.encode("é").ids == [1, tokens.index("▁"), tokens.index("<0xC3>"), tokens.index("<0xA9>")]
    assert ours.decode(ours.encode("héllo wörld").ids) == "héllo wörld"


def test_sentencepiece_merges_rank_by_score() -> None:
    merges = gguf_tokenizer.sentencepiece_merges(["a", "b", "c", "bc", "ab", "abc"], [0, 0, 0, -1.0, -2.0, -3.0])
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_unknown_pre_tokenizer_is_named(tmp_path: pathlib.Path, smollm2_subset) -> None:
    tokens, token_types, merges = smollm2_subset
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", tokens, token_types, pre="made-up", merges=merges)
    with pytest.raises(gguf_tokenizer.GgufTokenizerError, match="unsupported GGUF pre-tokenizer 'made-up'"):
        ours_from_file(path)
