"""Incremental detokenization against one-shot decoding with real tokenizers.

Byte-level tokenizers (a tiny one, SmolLM2's) run through both detokenizers: the
byte-level one IncrementalDetokenizer picks for them, and the window one that any
other decoder gets, so both are held to the same texts.
"""

from __future__ import annotations

import functools
import json
import random

import pytest
import tokenizers
from support.smollm2 import smollm2_tokenizer_info
from support.tiny_model import train_tokenizer
from tokenizers import decoders, normalizers

from scheduler_svc.text.detokenizer import (
    _MAX_HELD_TOKENS,
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    WindowDetokenizer,
)
from scheduler_svc.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "héllo wörld, ça va? naïve café crème brûlée",
    "世界你好，这是一个测试。日本語のテキストも。",
    "🎉🚀👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "def add(x, y):\n    return x + y    # trailing   spaces\n\n\tindented\t",
    "Numbers 12345 3.14159 -42 1e10 and 1,000,000.",
    "mixed: a世b🎉c é  \n  end",
    "   ",
    "\u00a0non-breaking\u2009thin space\u200bzero width",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT = "A prompt that ends with a word"


def train_tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on ASCII only, so non-ASCII characters split into bytes."""
    return Tokenizer.from_info(train_tiny_tokenizer_json(), None, None, None)


def train_tiny_tokenizer_json() -> str:
    """``tokenizer.json`` of ``train_tiny_tokenizer``."""
    return train_tokenizer(350, ["Hello world, the quick brown fox. def f(x): return 42"] * 10, SPECIALS).to_str()


@functools.cache
def train_byte_fallback_tokenizer() -> Tokenizer:
    """SentencePiece-style BPE as Llama 2 and Mistral ship it: spaces as ▁ with one prepended,
    ``<0xXX>`` tokens for the bytes of characters outside the vocabulary, and a decoder that
    strips the text's leading space."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    backend.train_from_iterator(["Hello world, the quick brown fox. def f(x): return 42"] * 10, trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_info(json.dumps(spec), None, None, None)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tok(request) -> Tokenizer:
    return train_tiny_tokenizer() if request.param == "tiny" else Tokenizer.from_info(*smollm2_tokenizer_info())


@pytest.fixture(params=[IncrementalDetokenizer, WindowDetokenizer], ids=["byte-level", "window"])
def detokenizer(request) -> type[IncrementalDetokenizer]:
    return request.param


class CountingBackend:
    """A real tokenizers.Tokenizer that counts its decode calls."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self.num_decodes = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        self.num_decodes += 1
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    """Deltas of feeding token_ids in chunks, then flush()."""
    deltas = [detok.add(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    return deltas + [detok.flush()]


def test_tiny_tokenizer_splits_characters_over_tokens():
    # Otherwise the multi-byte tests below would test nothing.
    tok = train_tiny_tokenizer()
    ids = tok.encode("世🎉é", add_special_tokens=False)
    assert len(ids) == 3 + 4 + 2
    assert all(tok.decode([i]) == "\ufffd" for i in ids)


def test_byte_fallback_tokenizer_splits_characters_into_bytes():
    tok = train_byte_fallback_tokenizer()
    ids = tok.encode("a世", add_special_tokens=False)
    assert [tok.backend.id_to_token(i) for i in ids][-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]
    assert tok.decode(ids[-3:-1]) == "\ufffd\ufffd"


def test_the_decoder_picks_the_detokenizer(tok):
    assert type(IncrementalDetokenizer(tok, [])) is ByteLevelDetokenizer
    assert type(IncrementalDetokenizer(train_byte_fallback_tokenizer(), [])) is WindowDetokenizer
    assert type(WindowDetokenizer(tok, [])) is WindowDetokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tok, detokenizer, text, chunk):
    output_ids = tok.encode(text, add_special_tokens=False)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    deltas = stream(detokenizer(tok, prompt_ids), output_ids, chunk)
    assert "".join(deltas) == tok.decode(output_ids) == text
    # Valid text never shows a replacement character mid-stream.
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_each_delta_is_emitted_as_soon_as_complete(tok, detokenizer, text):
    output_ids = tok.encode(text, add_special_tokens=False)
    detok = detokenizer(tok, [])
    emitted = ""
    for n in range(1, len(output_ids) + 1):
        emitted += detok.add(output_ids[n - 1 : n])
        expected = tok.decode(output_ids[:n])
        if expected.endswith("\ufffd"):
            # An incomplete character (and what shares its tokens) waits.
            assert expected.startswith(emitted) and "\ufffd" not in emitted
        else:
            assert emitted == expected
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tok, detokenizer):
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and tok.is_special(im_end[0])
    ids = tok.encode("héllo 世", add_special_tokens=False) + im_end
    ids += tok.encode("\nbye", add_special_tokens=False) + im_end
    skipped = "".join(stream(detokenizer(tok, ids[:2]), ids))
    assert skipped == tok.decode(ids) == "héllo 世\nbye"
    kept = "".join(stream(detokenizer(tok, [], skip_special_tokens=False), ids))
    assert kept == tok.decode(ids, skip_special_tokens=False) == "héllo 世<|im_end|>\nbye<|im_end|>"


def test_prompt_ending_with_special_tokens(tok, detokenizer):
    prompt_ids = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    output_ids = tok.encode("Sure 🎉", add_special_tokens=False)
    assert "".join(stream(detokenizer(tok, prompt_ids), output_ids)) == "Sure 🎉"


def test_prompt_ending_mid_character(detokenizer):
    tok = train_tiny_tokenizer()
    char_ids = tok.encode("世", add_special_tokens=False)
    prompt_ids = tok.encode("ab", add_special_tokens=False) + char_ids[:1]
    output_ids = char_ids[1:] + tok.encode("cd", add_special_tokens=False)
    deltas = stream(detokenizer(tok, prompt_ids), output_ids)
    assert "".join(deltas) == tok.decode(output_ids) == "\ufffd\ufffdcd"


def test_incomplete_character_at_finish_is_flushed(detokenizer):
    tok = train_tiny_tokenizer()
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]
    detok = detokenizer(tok, [])
    assert detok.add(ids) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


@pytest.mark.parametrize("tokenizer", ["tiny", "byte fallback"])
def test_invalid_bytes_are_not_held_forever(detokenizer, tokenizer):
    if tokenizer == "tiny":
        tok = train_tiny_tokenizer()
        # A lone UTF-8 continuation byte never completes a character.
        continuation_id = tok.encode("é", add_special_tokens=False)[1]
    else:
        tok = train_byte_fallback_tokenizer()
        continuation_id = tok.backend.token_to_id("<0xA9>")
    detok = detokenizer(tok, [])
    deltas = [detok.add([continuation_id]) for _ in range(50)]
    assert len("".join(deltas)) >= 50 - _MAX_HELD_TOKENS
    assert "".join(deltas) + detok.flush() == tok.decode([continuation_id] * 50)


def test_deltas_depend_on_the_tokens_alone(tok, detokenizer):
    """Random ids (specials, stray bytes, ids outside the vocabulary): the text emitted after
    each add() is what one-at-a-time adds emit by then, as a resume's replay needs; and for
    byte-level tokenizers all of it is decode() of the ids."""
    rng = random.Random(0)
    vocab_size = tok.vocab_size
    for _ in range(60):
        skip = rng.random() < 0.5
        ids = [rng.randrange(vocab_size + 8) if rng.random() < 0.7 else rng.randrange(300) for _ in range(40)]
        one_by_one = detokenizer(tok, [], skip)
        emitted = [""]
        for token_id in ids:
            emitted.append(emitted[-1] + one_by_one.add([token_id]))
        chunked = detokenizer(tok, [], skip)
        text, n = "", 0
        while n < len(ids):
            size = rng.randint(1, 6)
            text += chunked.add(ids[n : n + size])
            n = min(n + size, len(ids))
            assert text == emitted[n]
        text += chunked.flush()
        assert text == emitted[-1] + one_by_one.flush()
        if detokenizer is IncrementalDetokenizer:
            assert text == tok.decode(ids, skip_special_tokens=skip)


def test_byte_level_detokenizer_never_decodes(tok):
    counting = CountingBackend(tok.backend)
    counted = Tokenizer(counting)
    text_ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(counted, text_ids[:5]), text_ids)) == " ".join(TEXTS)
    assert counting.num_decodes == 0


def test_window_decodes_about_once_per_token_and_stays_short(tok):
    counting = CountingBackend(tok.backend)
    counted = Tokenizer(counting)
    text = " ".join(TEXTS) * 20
    output_ids = tok.encode(text, add_special_tokens=False)
    detok = WindowDetokenizer(counted, tok.encode("prompt", add_special_tokens=False))
    pieces = []
    max_window = 0
    for token_id in output_ids:
        pieces.append(detok.add([token_id]))
        max_window = max(max_window, len(detok._window_ids))
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert max_window <= 10
    assert counting.num_decodes <= 1.4 * len(output_ids)


def test_metaspace_first_word_keeps_its_space_after_a_prompt():
    sp = tokenizers.SentencePieceBPETokenizer()
    sp.train_from_iterator(["Hello world, hello there world"] * 10, vocab_size=60)
    tok = Tokenizer.from_info(sp.to_str(), None, None, None)
    prompt_ids = tok.encode("Hello", add_special_tokens=False)
    output_ids = tok.encode(" world there", add_special_tokens=False)
    assert tok.decode(prompt_ids + output_ids) == "Hello world there"
    # Decoded alone the first word loses its space; after the prompt it has it.
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids), output_ids)) == " world there"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_byte_fallback_text_reads_as_after_the_prompt(text, chunk):
    tok = train_byte_fallback_tokenizer()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    output_ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids, chunk)
    after_prompt = tok.decode(prompt_ids + output_ids)[len(tok.decode(prompt_ids)) :]
    assert "".join(deltas) == after_prompt == " " + text
    assert not any("\ufffd" in d for d in deltas)
