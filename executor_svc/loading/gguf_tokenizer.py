"""Rebuild a Hugging Face `tokenizers` tokenizer from GGUF metadata.

Two GGUF tokenizer models are supported:

- ``gpt2``: byte-level BPE (tokens + merges). ``tokenizer.ggml.pre`` names the
  pre-tokenizer the original model used (GPT-2's regex, Llama 3's, Qwen2's,
  SmolLM's digit split).
- ``llama``: SentencePiece-style BPE with scores and byte fallback (Llama 2,
  Mistral). Merges are recovered from the scores: a merge ranks by the score
  of the token it produces.

GGUF token types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex applied before byte-level mapping.
_SPLIT_REGEXES: dict[str, str] = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# Pre-tokenizers that are GPT-2's ByteLevel regex, optionally after splitting digits (llama.cpp
# gives OLMo's and OLMoE's GPT-2's regex too).
_BYTE_LEVEL_PRES = {"default": False, "gpt2": False, "olmo": False, "smollm": True}


class GgufTokenizerError(ValueError):
    """GGUF tokenizer metadata this module cannot rebuild."""


@dataclasses.dataclass(frozen=True)
class GgufTokenizer:
    """A tokenizer rebuilt from GGUF metadata, plus its special tokens."""

    tokenizer_json: str
    bos_token_id: int | None
    eos_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]


def build_tokenizer(metadata: dict[str, Any]) -> GgufTokenizer:
    """Builds the tokenizer described by `tokenizer.ggml.*` metadata.

    Raises:
        GgufTokenizerError: unknown tokenizer model or pre-tokenizer.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GgufTokenizerError("GGUF has no tokenizer.ggml.tokens")
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens, token_types)
    else:
        raise GgufTokenizerError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    _add_special_tokens(tokenizer, tokens, token_types)
    bos_id = _opt_int(metadata.get("tokenizer.ggml.bos_token_id"))
    eos_id = _opt_int(metadata.get("tokenizer.ggml.eos_token_id"))
    # SentencePiece models (Llama 2) start with BOS unless the file says otherwise.
    if metadata.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    # End of generation: eos, then end-of-turn / end-of-message ids (Llama 3) when given.
    stop_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = [int(metadata[f"tokenizer.ggml.{k}"]) for k in stop_keys if f"tokenizer.ggml.{k}" in metadata]
    return GgufTokenizer(
        tokenizer_json=tokenizer.to_str(),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    """GPT-2 style byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre` names."""
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre in _BYTE_LEVEL_PRES:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        steps = [pre_tokenizers.Digits(individual_digits=True)] if _BYTE_LEVEL_PRES[pre] else []
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    elif pre in _SPLIT_REGEXES:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
    else:
        raise GgufTokenizerError(
            f"unsupported GGUF pre-tokenizer {pre!r} "
            f"(supported: {', '.join(sorted([*_BYTE_LEVEL_PRES, *_SPLIT_REGEXES]))})"
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], token_types: list[int]) -> Tokenizer:
    """SentencePiece-style BPE (Llama 2): `▁` for spaces, byte fallback, merges from scores.

    Spaces become `▁` and one `▁` starts the text (`add_space_prefix`), as
    Hugging Face's LlamaTokenizer does (Metaspace, prepend scheme "first").
    """
    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = _opt_int(metadata.get("tokenizer.ggml.unknown_token_id"))
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(token_types) if t == TOKEN_TYPE_UNKNOWN), None)
    listed = metadata.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in listed] if listed else sentencepiece_merges(tokens, scores)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # "first": one `▁` before the text's first piece, none after special tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recovers BPE merges from a SentencePiece vocabulary.

    Every split of a token into two pieces that are both in the vocabulary is a
    merge; merges rank by the produced token's score (higher first), then by the
    pieces' ids, as SentencePiece's BPE applies them.
    """
    ids = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens."""
    special, plain = [], []
    for token, token_type in zip(tokens, token_types):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
