"""Per-request state on the way out: detokenize, check stop strings, stream.

A RequestState turns the scheduler's token-level SeqUpdates into text deltas
for the client, and tells the engine when a stop string ends the request.

A resumed request starts with the delivered tokens as its outputs. The
detokenizer and the stop checker are functions of the token sequence alone
(not of how tokens were grouped into responses), so `replay` runs them over the
delivered tokens and drops their text, which the client has: they are then in
the state the original server left them in, held-back text included, and the
stream goes on without a repeated or a missing character.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagoda.step import FinishReason
from scheduler_svc.core.scheduler import SeqUpdate
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.request import RequestOutput, RequestTimings, Usage
from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.output_buffer import Chunk, OutputBuffer
from scheduler_svc.text.stop_checker import StopChecker
from scheduler_svc.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from scheduler_svc.fleet.executor_handle import ExecutorHandle


class RequestState:
    """Everything the engine tracks for one in-flight request."""

    def __init__(
        self, seq: SchedulerSequence, tokenizer: Tokenizer, skip_special_tokens: bool, arrival_ns: int
    ) -> None:
        self.seq = seq
        self.arrival_ns = arrival_ns
        self.first_token_ns: int | None = None
        self.first_scheduled_ns: int | None = None
        # What the stream has not taken yet (merged: one response per wake-up of the stream).
        self.pending = OutputBuffer()
        # The executor holding the sequence (None while it waits for one).
        self.executor: ExecutorHandle | None = None
        self.finished = False
        # The reason of the final response, once sent.
        self.finish_reason: FinishReason | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, skip_special_tokens)
        self._stop_checker = StopChecker(seq.stopping.stop, seq.stopping.include_stop_str_in_output)
        self._sent_prompt = False
        # Output tokens the stream has taken: the next response's output_index.
        self._num_sent_tokens = 0
        # Output tokens pushed to the stream (taken or pending), delivered ones of a resume included.
        self.num_queued_tokens = 0
        # When the last output token was pushed (the inter-token latency's start).
        self.last_token_ns: int | None = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def take_output(self) -> RequestOutput | None:
        """Everything pending as one response, or None."""
        chunk = self.pending.take()
        return None if chunk is None else self._output(chunk)

    async def next_output(self) -> RequestOutput:
        """The next response, waiting for one (asyncio.TimeoutError after `pending.expire()`)."""
        return self._output(await self.pending.next())

    def on_update(self, update: SeqUpdate, hold: bool = False) -> str | None:
        """Stream the new tokens; returns the stop string that ended the request, if any.

        `hold`: the engine will release them within a step (output_buffer.py); never the first
        response, nor the last.
        """
        now = time.monotonic_ns()
        if self.first_token_ns is None and update.new_token_ids:
            self.first_token_ns = now
        if len(update.new_token_ids) > 1 and self._stop_checker.has_stops:
            emitted, matched, update = self._read_by_token(update)
        else:
            emitted, matched = self._stop_checker.process(self._detokenizer.add(update.new_token_ids))
        if matched is not None:
            self._finish(emitted, update, FinishReason.STOP, matched)
            return matched
        if update.finished and self.seq.finish_reason is FinishReason.ERROR:
            self.fail(FinishReason.ERROR, self.seq.error_message or "executor error")
        elif update.finished:
            tail = self._stop_checker.process(self._detokenizer.flush())[0] + self._stop_checker.flush()
            self._finish(emitted + tail, update, self.seq.finish_reason, self.seq.stop_reason)
        else:
            self._put(emitted, update, hold and self._sent_prompt)
        return None

    def _read_by_token(self, update: SeqUpdate) -> tuple[str, str | None, SeqUpdate]:
        """Several tokens (accepted drafts) read one at a time, as plain decoding would have read them.

        A stop string ends the request at the token that completes it: the tokens after it are
        dropped from the update and from the sequence's outputs, as if never generated.
        """
        texts = []
        for i, token_id in enumerate(update.new_token_ids):
            emitted, matched = self._stop_checker.process(self._detokenizer.add((token_id,)))
            texts.append(emitted)
            if matched is not None:
                self.seq.drop_last_outputs(len(update.new_token_ids) - i - 1)
                cut = update._replace(new_token_ids=update.new_token_ids[: i + 1], logprobs=update.logprobs[: i + 1])
                return "".join(texts), matched, cut
        return "".join(texts), None, update

    def replay(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> bool:
        """A resume: runs the delivered tokens (the outputs the sequence starts with) through
        the detokenizer and the stop checker, dropping their text.

        Returns:
            True when the delivered tokens already end the request (a stop string, the
            last one EOS or a stop token id, max_tokens, the context): the final response,
            without text or tokens, is queued then.
        """
        delivered = self.seq.output_token_ids
        self._num_sent_tokens = self.num_queued_tokens = len(delivered)
        if not delivered:
            return False
        _, matched = self._stop_checker.process(self._detokenizer.add(delivered))
        nothing = SeqUpdate(self.seq, (), (), True)
        if matched is not None:
            self._finish("", nothing, FinishReason.STOP, matched)
        elif self.seq.check_stop(delivered[-1], eos_token_ids, max_model_len):
            self._finish("", nothing, self.seq.finish_reason, self.seq.stop_reason)
        return self.finished

    def fail(self, reason: FinishReason, message: str = "") -> None:
        """End the stream without further tokens (abort, executor error)."""
        if not self.finished:
            self.finished = True
            self.pending.end(reason, None, message)

    def _put(self, text: str, update: SeqUpdate, hold: bool = False) -> None:
        self.num_queued_tokens += len(update.new_token_ids)
        self.pending.push(text, update.new_token_ids, update.logprobs, hold)

    def _finish(self, text: str, update: SeqUpdate, reason: FinishReason | None, stop_reason: str | int | None) -> None:
        self.finished = True
        self._put(text, update)
        self.pending.end(reason or FinishReason.STOP, stop_reason)

    def _output(self, chunk: Chunk) -> RequestOutput:
        first = not self._sent_prompt
        self._sent_prompt = True
        output_index = self._num_sent_tokens
        self._num_sent_tokens += len(chunk.token_ids)
        reason, stop_reason, error = chunk.end or (None, None, "")
        usage: Usage | None = None
        timings: RequestTimings | None = None
        if reason is not None:
            self.finish_reason = reason
            usage = self._usage()
            timings = self._timings()
        return RequestOutput(
            self.request_id,
            chunk.text,
            chunk.token_ids,
            chunk.logprobs,
            reason,
            stop_reason,
            usage,
            timings,
            tuple(self.seq.prompt_token_ids) if first else (),
            error,
            output_index,
            self.seq.sampling.seed if first else None,
            tuple(self.seq.prompt_logprobs) if first else (),
        )

    def _usage(self) -> Usage:
        """The whole request's counts: a resumed request's outputs include the delivered tokens."""
        seq = self.seq
        # A resume may hit cached blocks of delivered tokens too; only the prompt's count here.
        cached = min(seq.num_cached_tokens, seq.num_prompt_tokens)
        return Usage(seq.num_prompt_tokens, len(seq.output_token_ids), cached, min(seq.num_offloaded_tokens, cached))

    def _timings(self) -> RequestTimings:
        now = time.monotonic_ns()
        scheduled = self.first_scheduled_ns or now
        first = self.first_token_ns or now
        return RequestTimings(scheduled - self.arrival_ns, first - self.arrival_ns, now - self.arrival_ns)
