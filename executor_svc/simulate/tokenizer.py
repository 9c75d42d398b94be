"""The simulated executor's tokenizer: a word-level vocabulary built in memory.

Deterministic for a given size: four special tokens (ids 0-3), punctuation, a
few dozen fixed words (chat roles and some non-ASCII ones, so text deltas cross
multi-byte characters), then two-syllable words generated in a fixed order.
Text is lowercased and split on whitespace and punctuation; unknown words
become `<unk>`. Two forms of the same vocabulary, ids and words alike:

- word-level: the WordPiece decoder joins words with spaces and removes the
  space before punctuation, so generated text reads like words and sentences.
  Its decoder is not byte-level, so the scheduler detokenizes it as it does
  SentencePiece models (Llama 2, Mistral, Gemma): a window of tokens decoded per
  token.
- byte-level: each word is a GPT-2 ByteLevel token with its leading space
  ("Ġword"), split by the ByteLevel pre-tokenizer and decoded by the ByteLevel
  decoder, as the byte-level BPE of SmolLM2, Llama 3 and Qwen are; the
  scheduler detokenizes it by token bytes.
"""

from __future__ import annotations

import itertools

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from executor_svc.loading.tokenizer_files import TokenizerFiles

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, UNK_TOKEN)
PUNCTUATION = (".", ",", "!", "?", ";", ":")
FIXED_WORDS = (
    *("system", "user", "assistant", "the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on"),
    *("with", "as", "at", "by", "from", "this", "be", "are", "not", "hello", "world", "cat", "dog", "river"),
    *("stone", "light", "water", "tree", "house", "road", "sky", "café", "naïve", "über", "jalapeño", "日本"),
    *("東京", "ñandú"),
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# Two-syllable words available after the fixed ones.
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(PUNCTUATION) + len(FIXED_WORDS)
MAX_VOCAB_SIZE = MIN_VOCAB_SIZE + len(_SYLLABLES) ** 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary(vocab_size: int) -> list[str]:
    """The first `vocab_size` tokens, in id order.

    Raises:
        ValueError: vocab_size outside [MIN_VOCAB_SIZE, MAX_VOCAB_SIZE].
    """
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab size {vocab_size} outside [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]")
    generated = ("".join(pair) for pair in itertools.product(_SYLLABLES, repeat=2))
    words = [*SPECIAL_TOKENS, *PUNCTUATION, *FIXED_WORDS, *generated]
    return words[:vocab_size]


TOKENIZER_KINDS = ("word-level", "byte-level")


def _byte_level_token(word: str) -> str:
    """`word` as the ByteLevel pre-tokenizer splits it from text: a leading space for words, bytes as GPT-2's
    alphabet."""
    pieces = _SPLIT_BYTES.pre_tokenize_str(word if word in PUNCTUATION else " " + word)
    if len(pieces) != 1:
        raise AssertionError(f"{word!r} is not one ByteLevel pre-token: {pieces}")
    return pieces[0][0]


_SPLIT_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False)


def build_tokenizer(vocab_size: int, kind: str = "word-level") -> tokenizers.Tokenizer:
    """The `tokenizers` tokenizer over `vocabulary(vocab_size)`, in one of `TOKENIZER_KINDS`.

    Raises:
        ValueError: an unknown kind.
    """
    words = vocabulary(vocab_size)
    if kind == "word-level":
        vocab = {token: token_id for token_id, token in enumerate(words)}
        tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.decoder = decoders.WordPiece(cleanup=True)
    elif kind == "byte-level":
        vocab = {
            token if token in SPECIAL_TOKENS else _byte_level_token(token): token_id
            for token_id, token in enumerate(words)
        }
        tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        raise ValueError(f"unknown simulated tokenizer {kind!r}: one of {', '.join(TOKENIZER_KINDS)}")
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def simulated_tokenizer_files(vocab_size: int, kind: str = "word-level") -> TokenizerFiles:
    """What Describe sends for the simulated model: the tokenizer JSON, a ChatML template, EOS ids."""
    return TokenizerFiles(
        tokenizer_json=build_tokenizer(vocab_size, kind).to_str(),
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token=IM_END,
        eos_token_ids=(SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END)),
    )
