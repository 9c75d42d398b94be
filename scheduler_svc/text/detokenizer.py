"""Incremental detokenization: token ids in, text deltas out, one per request.

Decoding one token alone is wrong in two ways: a multi-byte UTF-8 character may
be split over several byte-level tokens (alone each decodes to U+FFFD), and some
decoders change a token's text by what precedes it (the leading space of a
Metaspace/SentencePiece word). So, as vLLM and TGI do, we decode a short window
of tokens twice: the tokens already read (`prefix_text`) and the same plus the
new ones; the delta is what the second adds to the first. While the decoded text
ends in U+FFFD the character is incomplete and we hold the tokens back. After
each emission the window restarts at the tokens just read, so the cost per token
does not grow with the output length.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, so its first token reads in context.
_NUM_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes; tokens still incomplete after this many
# are invalid bytes, emitted as U+FFFD rather than held forever.
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    The concatenation of all deltas and flush() equals
    tokenizer.decode(output ids) for byte-level tokenizers; for decoders that
    strip the first word's leading space it keeps that space when a prompt
    precedes, as the text would read after the prompt.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context_ids = self._context_ids(prompt_token_ids)
        prefix_text = self._decode(context_ids)
        if _REPLACEMENT_CHAR in prefix_text:
            # A prompt ending mid-character would make the deltas misaligned.
            context_ids, prefix_text = [], ""
        # Token ids whose text is not yet fully emitted, after read context.
        self._window_ids: list[int] = context_ids
        # window_ids[:num_read] decode to prefix_text, already emitted (or prompt).
        self._num_read = len(context_ids)
        self._prefix_text = prefix_text

    def _context_ids(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context: list[int] = []
        for token_id in reversed(prompt_token_ids[-4 * _NUM_CONTEXT_TOKENS :]):
            if len(context) == _NUM_CONTEXT_TOKENS:
                break
            if not self._is_skipped(token_id):
                context.append(token_id)
        context.reverse()
        return context

    def _is_skipped(self, token_id: int) -> bool:
        return self._skip_special_tokens and self._tokenizer.is_special(token_id)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the text that is now complete."""
        deltas = []
        for token_id in token_ids:
            if self._is_skipped(token_id):
                # Skipped tokens decode to nothing; keeping them out of the
                # window keeps it short.
                continue
            self._window_ids.append(token_id)
            deltas.append(self._read())
        return "".join(deltas)

    def _read(self) -> str:
        text = self._decode(self._window_ids)
        num_unread = len(self._window_ids) - self._num_read
        complete = len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR)
        if not complete and num_unread < _MAX_HELD_TOKENS:
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._window_ids = self._window_ids[self._num_read :]
        self._num_read = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        return delta

    def flush(self) -> str:
        """At finish: the text still held back (U+FFFD for incomplete bytes)."""
        if len(self._window_ids) == self._num_read:
            return ""
        return self._emit(self._decode(self._window_ids))
