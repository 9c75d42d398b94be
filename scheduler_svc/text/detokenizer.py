"""Incremental detokenization: token ids in, text deltas out, one per request.

Decoding one token alone is wrong in two ways: a multi-byte UTF-8 character may
be split over several byte-level tokens (alone each decodes to U+FFFD), and some
decoders change a token's text by what precedes it (the leading space of a
Metaspace/SentencePiece word). The tokenizer's decoder picks one of two ways:

- ByteLevelDetokenizer, for byte-level BPE (GPT-2's ByteLevel decoder: SmolLM2,
  Llama 3, Qwen). There a token stands for bytes, and decoding is UTF-8 over the
  concatenated bytes with U+FFFD for invalid ones: no context beyond the bytes.
  Each token's bytes are looked up once per tokenizer and the stream goes
  through the C UTF-8 codec, which holds back only an incomplete character and
  replaces invalid bytes as soon as they are known to be invalid. No call into
  the tokenizer per token, and a batch of tokens is one codec call.
- WindowDetokenizer, for any other decoder. As vLLM and TGI do, it decodes a
  short window of tokens: those already read, whose text is emitted, plus the
  new ones; the delta is what the new ones add. While the text ends in U+FFFD
  the character is incomplete and the tokens are held back. The decoded window
  is the next prefix, so a token costs one decode, plus one whenever the window
  restarts at the tokens just read (once a few precede them, to keep it short).

tokenizers' DecodeStream (0.21 on, prompt prefill 0.22 on) is the window
algorithm in Rust, one call per token, but it holds invalid bytes forever
(decoding an ever longer window), has no flush, returns nothing for a batch whose
last token ends mid-character, and emits a prompt context that ends
mid-character; fixing those from outside would mean mirroring its state here.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence

import tokenizers.decoders

from scheduler_svc.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, so its first token reads in context.
_NUM_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes; tokens the window still holds after this
# many are invalid bytes, emitted as U+FFFD rather than held forever.
_MAX_HELD_TOKENS = 8
# The window restarts at the tokens just read once this many precede them
# (about 1.3 decodes a token, of a few tokens each).
_MAX_READ_TOKENS = 3


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()


class _TokenBytes(dict[int, bytes]):
    """Token id -> the bytes the ByteLevel decoder makes of the token, filled on first sight of an id.

    Skipped special tokens and ids outside the vocabulary are empty, as decode leaves them out.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        super().__init__()
        self._backend = tokenizer.backend
        self._skipped_ids = tokenizer.special_ids if skip_special_tokens else frozenset()

    def __missing__(self, token_id: int) -> bytes:
        token = None if token_id in self._skipped_ids else self._backend.id_to_token(token_id)
        if token is None:
            data = b""
        elif all(char in _BYTE_OF_CHAR for char in token):
            data = bytes(_BYTE_OF_CHAR[char] for char in token)
        else:
            # What the ByteLevel decoder does with a token outside its alphabet (an added token).
            data = token.encode()
        self[token_id] = data
        return data


# One table per tokenizer and skip_special_tokens, shared by its requests.
_TOKEN_BYTES: weakref.WeakKeyDictionary[Tokenizer, dict[bool, _TokenBytes]] = weakref.WeakKeyDictionary()


def _token_bytes(tokenizer: Tokenizer, skip_special_tokens: bool) -> _TokenBytes:
    tables = _TOKEN_BYTES.setdefault(tokenizer, {})
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = _TokenBytes(tokenizer, skip_special_tokens)
    return tables[skip_special_tokens]


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    Constructing it builds the detokenizer the tokenizer's decoder needs. The
    concatenation of all deltas and flush() equals tokenizer.decode(output ids)
    for byte-level tokenizers; for decoders that strip the first word's leading
    space it keeps that space when a prompt precedes, as the text would read
    after the prompt. The deltas depend on the token sequence alone, not on how
    it was split over add() calls (a resumed request replays its tokens at once).
    """

    def __new__(
        cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        if cls is IncrementalDetokenizer:
            byte_level = isinstance(tokenizer.backend.decoder, tokenizers.decoders.ByteLevel)
            cls = ByteLevelDetokenizer if byte_level else WindowDetokenizer
        return super().__new__(cls)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the text that is now complete."""
        raise NotImplementedError

    def flush(self) -> str:
        """At finish: the text still held back (U+FFFD for incomplete bytes)."""
        raise NotImplementedError


class ByteLevelDetokenizer(IncrementalDetokenizer):
    """For the ByteLevel decoder: token bytes through the incremental UTF-8 codec."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        # Byte-level text needs no prompt context; a prompt ending mid-character
        # does not complete the output's first character (as decode(output ids)).
        self._token_bytes = _token_bytes(tokenizer, skip_special_tokens)
        # The bytes of an incomplete character (at most 3).
        self._held = b""

    def add(self, token_ids: Sequence[int]) -> str:
        token_bytes = self._token_bytes
        data = token_bytes[token_ids[0]] if len(token_ids) == 1 else b"".join(map(token_bytes.__getitem__, token_ids))
        if self._held:
            data = self._held + data
        text, num_decoded = codecs.utf_8_decode(data, "replace", False)
        self._held = data[num_decoded:]
        return text

    def flush(self) -> str:
        text = codecs.utf_8_decode(self._held, "replace", True)[0]
        self._held = b""
        return text


class WindowDetokenizer(IncrementalDetokenizer):
    """For any decoder: decodes a window of the last tokens, about once per token."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        # Skipped tokens decode to nothing; keeping them out of the window keeps it short.
        self._skipped_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        context_ids = self._context_ids(prompt_token_ids)
        prefix_text = self._decode(context_ids)
        if _REPLACEMENT_CHAR in prefix_text:
            # A prompt ending mid-character would make the deltas misaligned.
            context_ids, prefix_text = [], ""
        # Token ids whose text is not yet fully emitted, after read context.
        self._window_ids: list[int] = context_ids
        # window_ids[:num_read] decode to prefix_len characters, already emitted (or prompt).
        self._num_read = len(context_ids)
        self._prefix_len = len(prefix_text)

    def _context_ids(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context: list[int] = []
        for token_id in reversed(prompt_token_ids[-4 * _NUM_CONTEXT_TOKENS :]):
            if len(context) == _NUM_CONTEXT_TOKENS:
                break
            if token_id not in self._skipped_ids:
                context.append(token_id)
        context.reverse()
        return context

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        # One token at a time, so that what is emitted (and the window) depends on the
        # token sequence alone, not on how it was split over add() calls.
        if len(token_ids) == 1 and token_ids[0] not in self._skipped_ids:
            return self._read(token_ids[0])
        return "".join([self._read(token_id) for token_id in token_ids if token_id not in self._skipped_ids])

    def _read(self, token_id: int) -> str:
        # The per-token path: one decode, inline.
        window_ids = self._window_ids
        window_ids.append(token_id)
        text = self._backend.decode(window_ids, skip_special_tokens=self._skip_special_tokens)
        complete = len(text) > self._prefix_len and text[-1] != _REPLACEMENT_CHAR
        if complete or len(window_ids) - self._num_read >= _MAX_HELD_TOKENS:
            return self._emit(text)
        return ""

    def _emit(self, text: str) -> str:
        """The delta of text, the decoded window; its tokens are read then."""
        delta = text[self._prefix_len :]
        if self._num_read >= _MAX_READ_TOKENS:
            del self._window_ids[: self._num_read]
            text = self._decode(self._window_ids)
        self._prefix_len = len(text)
        self._num_read = len(self._window_ids)
        return delta

    def flush(self) -> str:
        if len(self._window_ids) == self._num_read:
            return ""
        return self._emit(self._decode(self._window_ids))
