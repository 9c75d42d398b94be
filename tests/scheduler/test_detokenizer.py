"""Incremental detokenization against one-shot decoding with real tokenizers."""

from __future__ import annotations

import pytest
import tokenizers
from support.smollm2 import smollm2_tokenizer_info
from support.tiny_model import train_tokenizer

from scheduler_svc.text.detokenizer import IncrementalDetokenizer
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


def train_tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on ASCII only, so non-ASCII characters split into bytes."""
    return Tokenizer.from_info(train_tiny_tokenizer_json(), None, None, None)


def train_tiny_tokenizer_json() -> str:
    """``tokenizer.json`` of ``train_tiny_tokenizer``."""
    return train_tokenizer(350, ["Hello world, the quick brown fox. def f(x): return 42"] * 10, SPECIALS).to_str()


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tok(request) -> Tokenizer:
    return train_tiny_tokenizer() if request.param == "tiny" else Tokenizer.from_info(*smollm2_tokenizer_info())


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


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tok, text, chunk):
    output_ids = tok.encode(text, add_special_tokens=False)
    prompt_ids = tok.encode("A prompt that ends with a word", add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids, chunk)
    assert "".join(deltas) == tok.decode(output_ids) == text
    # Valid text never shows a replacement character mid-stream.
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_each_delta_is_emitted_as_soon_as_complete(tok, text):
    output_ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
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


def test_special_tokens_skipped_or_kept(tok):
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and tok.is_special(im_end[0])
    ids = tok.encode("héllo 世", add_special_tokens=False) + im_end
    ids += tok.encode("\nbye", add_special_tokens=False) + im_end
    skipped = "".join(stream(IncrementalDetokenizer(tok, ids[:2]), ids))
    assert skipped == tok.decode(ids) == "héllo 世\nbye"
    kept = "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids))
    assert kept == tok.decode(ids, skip_special_tokens=False) == "héllo 世<|im_end|>\nbye<|im_end|>"


def test_prompt_ending_with_special_tokens(tok):
    prompt_ids = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    output_ids = tok.encode("Sure 🎉", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids), output_ids)) == "Sure 🎉"


def test_prompt_ending_mid_character():
    tok = train_tiny_tokenizer()
    char_ids = tok.encode("世", add_special_tokens=False)
    prompt_ids = tok.encode("ab", add_special_tokens=False) + char_ids[:1]
    output_ids = char_ids[1:] + tok.encode("cd", add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids)
    assert "".join(deltas) == tok.decode(output_ids) == "\ufffd\ufffdcd"


def test_incomplete_character_at_finish_is_flushed():
    tok = train_tiny_tokenizer()
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_invalid_bytes_are_not_held_forever():
    tok = train_tiny_tokenizer()
    # A lone UTF-8 continuation byte never completes a character.
    continuation_id = tok.encode("é", add_special_tokens=False)[1]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([continuation_id]) for _ in range(50)]
    assert "".join(deltas) != ""
    assert "".join(deltas) + detok.flush() == tok.decode([continuation_id] * 50)


def test_window_stays_bounded(tok):
    text = " ".join(TEXTS) * 20
    output_ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt", add_special_tokens=False))
    pieces = []
    max_window = 0
    for token_id in output_ids:
        pieces.append(detok.add([token_id]))
        max_window = max(max_window, len(detok._window_ids))
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert max_window <= 10


def test_metaspace_first_word_keeps_its_space_after_a_prompt():
    sp = tokenizers.SentencePieceBPETokenizer()
    sp.train_from_iterator(["Hello world, hello there world"] * 10, vocab_size=60)
    tok = Tokenizer.from_info(sp.to_str(), None, None, None)
    prompt_ids = tok.encode("Hello", add_special_tokens=False)
    output_ids = tok.encode(" world there", add_special_tokens=False)
    assert tok.decode(prompt_ids + output_ids) == "Hello world there"
    # Decoded alone the first word loses its space; after the prompt it has it.
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids), output_ids)) == " world there"
