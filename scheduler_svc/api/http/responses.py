"""Engine outputs → OpenAI response bodies and stream chunks.

One formatter per request: `chunks(out)` gives the stream chunks of one
RequestOutput as JSON text, `response(outputs)` the whole non-streamed body. Token strings
for logprobs come from the tokenizer, one token decoded alone.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pagoda.step import FinishReason, LogprobEntry
from scheduler_svc.api.http.errors import server_error, unavailable
from scheduler_svc.api.http.tools import ToolSpec, ToolStream, parse_calls
from scheduler_svc.request import RequestOutput, Usage
from scheduler_svc.text.tokenizer import Tokenizer

# A JSON object of a response body.
Json = dict[str, Any]


def check_output(out: RequestOutput) -> None:
    """Raise the client's error for a request that ended without an answer."""
    if out.finish_reason is FinishReason.ERROR:
        raise server_error(f"request {out.request_id} failed in the executor: {out.error}")
    if out.finish_reason is FinishReason.ABORT:
        raise unavailable(f"request {out.request_id} was aborted: {out.error or 'server shutting down'}")


def merged_usage(usages: list[Usage]) -> Usage:
    """The usage of a request's choices: the prompt once (as its first choice saw it), every completion."""
    first = usages[0]
    completion_tokens = sum(u.completion_tokens for u in usages)
    return Usage(first.prompt_tokens, completion_tokens, first.cached_tokens, first.cached_tokens_offloaded)


def usage_body(usage: Usage) -> Json:
    """OpenAI's usage object (cached prompt tokens in prompt_tokens_details)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cached_tokens_offloaded": usage.cached_tokens_offloaded,
        },
    }


class Formatter:
    """What both endpoints share: id, model, timestamps, token strings; one formatter per choice."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        tokenizer: Tokenizer,
        logprobs: int | None,
        index: int = 0,
        tools: ToolSpec | None = None,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.index = index
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._tools = tools
        # Chat with tools: holds back the calls of a streamed output.
        self._tool_stream = ToolStream(tools) if tools is not None and tools.parse else None
        self.usage: Usage | None = None
        # The JSON text of a running chunk around its text: (head, tail), rendered once per request.
        self._text_template: tuple[str, str] | None = None

    def token_str(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, object_name: str, choices: list[Json]) -> Json:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def usage_chunk(self, usage: Usage | None = None) -> Json:
        """The last chunk when stream_options.include_usage: no choices, only usage (this choice's by default)."""
        usage = usage or self.usage
        assert usage is not None, "usage_chunk before the final output"
        return {**self._envelope(self.chunk_object_name, []), "usage": usage_body(usage)}

    def response(self, outputs: list[RequestOutput]) -> Json:
        """The whole non-streamed body of a one-choice request."""
        choice = self.choice(outputs)
        assert self.usage is not None, "a response before the final output"
        return self.body([choice], self.usage)

    def choice(self, outputs: list[RequestOutput]) -> Json:
        """This formatter's choice in a non-streamed body, from all of its outputs."""
        for out in outputs:
            self._note(out)
        fields, finish = self._answer(outputs)
        return self._choice(outputs[-1], fields, finish)

    def body(self, choices: list[Json], usage: Usage) -> Json:
        """The whole non-streamed body: the choices and the usage."""
        return {**self._envelope(self.object_name, choices), "usage": usage_body(usage)}

    def chunks(self, out: RequestOutput) -> list[str]:
        """The stream chunks of ``out``, as JSON text; none for an output that carries nothing to show."""
        raise NotImplementedError

    def _chunk(self, out: RequestOutput, fields: Json, finish: str | None = None) -> list[str]:
        """The stream chunk of ``out`` whose choice carries ``fields``."""
        return [
            json.dumps(self._envelope(self.chunk_object_name, [self._choice(out, fields, finish)]), ensure_ascii=False)
        ]

    def _text_chunk(self, text: str) -> list[str]:
        """The chunk of a running output that carries only ``text`` (no logprobs, no finish): the same JSON as
        `_chunk`'s, with the request's constant part rendered once. Most chunks of a stream are these, and
        encoding each whole envelope was ~5% of the scheduler's CPU at 256 SSE streams."""
        if self._text_template is None:
            marker = json.dumps("\0")
            parts = self._chunk(RequestOutput("", "", ()), self._text_fields("\0"))[0].split(marker)
            # An id or model name that holds the marker too: every chunk rendered whole.
            self._text_template = (parts[0], parts[1]) if len(parts) == 2 else ("", "")
        head, tail = self._text_template
        if not head:
            return self._chunk(RequestOutput("", text, ()), self._text_fields(text))
        return [head + json.dumps(text, ensure_ascii=False) + tail]

    def _text_fields(self, text: str) -> Json:
        """The choice's fields of a chunk with only ``text``."""
        raise NotImplementedError

    def _choice(self, out: RequestOutput, fields: Json, finish: str | None) -> Json:
        """This choice with ``fields``, ended by ``out``'s finish reason (or ``finish``; null while it runs)."""
        reason = finish or (out.finish_reason.value if out.finish_reason is not None else None)
        return {"index": self.index, **fields, "finish_reason": reason, "stop_reason": out.stop_reason}

    def _note(self, out: RequestOutput) -> None:
        check_output(out)
        if out.usage is not None:
            self.usage = out.usage

    def _answer(self, outputs: list[RequestOutput]) -> tuple[Json, str | None]:
        """The choice's text (or message) and logprobs over all outputs, and a finish reason that overrides."""
        raise NotImplementedError


class CompletionFormatter(Formatter):
    """/v1/completions: `text_completion` objects; logprobs in the legacy layout."""

    object_name = chunk_object_name = "text_completion"

    # Characters of text before the next token (legacy logprobs' text_offset).
    _text_offset = 0

    def chunks(self, out: RequestOutput) -> list[str]:
        self._note(out)
        if self._logprobs is None and not out.finished:
            return self._text_chunk(out.text) if out.text else []
        if not (out.text or out.finished or (self._logprobs is not None and out.token_ids)):
            return []
        return self._chunk(out, {"text": out.text, "logprobs": self._logprobs_body(out)})

    def _text_fields(self, text: str) -> Json:
        return {"text": text, "logprobs": None}

    def _answer(self, outputs: list[RequestOutput]) -> tuple[Json, str | None]:
        logprobs = None
        if self._logprobs is not None:
            logprobs = _merge_legacy([self._logprobs_body(out) for out in outputs])
        return {"text": "".join(o.text for o in outputs), "logprobs": logprobs}, None

    def _logprobs_body(self, out: RequestOutput) -> Json | None:
        if self._logprobs is None:
            return None
        body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(out.token_ids, out.logprobs):
            token = self.token_str(token_id)
            body["tokens"].append(token)
            body["token_logprobs"].append(entry.sampled.logprob)
            top = {self.token_str(t.token_id): t.logprob for t in entry.top}
            top.setdefault(token, entry.sampled.logprob)
            body["top_logprobs"].append(top)
            body["text_offset"].append(self._text_offset)
            self._text_offset += len(token)
        return body


def _merge_legacy(bodies: list[Json | None]) -> Json:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for body in bodies:
        for key in merged:
            merged[key].extend(body[key] if body else [])
    return merged


class ChatFormatter(Formatter):
    """/v1/chat/completions: an assistant message, or deltas (role first, finish_reason last)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def role_chunk(self) -> Json:
        """The first chunk of a stream: the role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object_name, [choice])

    def chunks(self, out: RequestOutput) -> list[str]:
        self._note(out)
        if self._logprobs is None and self._tool_stream is None and not out.finished:
            return self._text_chunk(out.text) if out.text else []
        content = self._logprobs_content(out)
        text, calls = out.text, list[Json]()
        if self._tool_stream is not None:
            text = self._tool_stream.feed(out.text)
            if out.finished:
                rest, calls = self._tool_stream.finish()
                text += rest
        if not (text or out.finished or content):
            return []
        delta: Json = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        logprobs = None if content is None else {"content": content, "refusal": None}
        return self._chunk(out, {"delta": delta, "logprobs": logprobs}, "tool_calls" if calls else None)

    def _answer(self, outputs: list[RequestOutput]) -> tuple[Json, str | None]:
        logprobs = None
        if self._logprobs is not None:
            logprobs = {"content": [e for o in outputs for e in self._logprobs_content(o) or ()], "refusal": None}
        text = "".join(o.text for o in outputs)
        content, calls = parse_calls(text, self._tools) if self._tools is not None else (text, [])
        message: Json = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "logprobs": logprobs}, "tool_calls" if calls else None

    def _text_fields(self, text: str) -> Json:
        return {"delta": {"content": text}, "logprobs": None}

    def _logprobs_content(self, out: RequestOutput) -> list[Json] | None:
        if self._logprobs is None:
            return None
        return [self._token_logprob(token_id, entry) for token_id, entry in zip(out.token_ids, out.logprobs)]

    def _token_logprob(self, token_id: int, entry: LogprobEntry) -> Json:
        return {
            **self._token(token_id, entry.sampled.logprob),
            "top_logprobs": [self._token(t.token_id, t.logprob) for t in entry.top],
        }

    def _token(self, token_id: int, logprob: float) -> Json:
        token = self.token_str(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
