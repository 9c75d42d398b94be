"""Prompt-lookup drafts: what followed the latest earlier occurrence of a sequence's last n tokens.

Input-grounded generation (questions about a document, code edits, summaries)
copies spans of its prompt and of its own output. When the last n tokens
occurred before, the tokens that followed them then are a cheap guess of what
comes next; the executor verifies the guess in one forward pass.

The index maps every n-gram of the sequence to the position just after its
latest occurrence, one dict per n, extended incrementally as tokens arrive,
so a proposal costs a few dict lookups however long the sequence is. Pure
Python, no numpy.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """The n-gram index of one sequence, longest n tried first."""

    __slots__ = ("_ns", "_indexes", "_num_indexed")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self._ns = tuple(range(max_n, min_n - 1, -1))
        # One dict per n (same order as _ns): n-gram -> the index of the token after its latest occurrence.
        self._indexes: tuple[dict[tuple[int, ...], int], ...] = tuple({} for _ in self._ns)
        # Positions e < _num_indexed have the n-grams ending at e - 1 indexed.
        self._num_indexed = 1

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to max_tokens tokens that followed the longest matching suffix earlier; () when none did.

        ``token_ids`` only ever grows between calls (prompt, then outputs).
        """
        num_tokens = len(token_ids)
        if max_tokens <= 0 or num_tokens < 2:
            return ()
        self._extend(token_ids, num_tokens)
        for n, index in zip(self._ns, self._indexes):
            if num_tokens > n:
                after = index.get(tuple(token_ids[num_tokens - n :]))
                if after is not None:
                    return tuple(token_ids[after : after + max_tokens])
        return ()

    def _extend(self, token_ids: Sequence[int], num_tokens: int) -> None:
        """Indexes the n-grams followed by a known token, up to the newest one (latest occurrence wins)."""
        for end in range(self._num_indexed, num_tokens):
            for n, index in zip(self._ns, self._indexes):
                if end >= n:
                    index[tuple(token_ids[end - n : end])] = end
        self._num_indexed = max(self._num_indexed, num_tokens)
