"""A light HTTP/1.1 client for server-sent events, on raw asyncio streams.

The control-plane load keeps hundreds of streams open from one process, and
what it measures is the scheduler's CPU: an HTTP library's per-event cost
would make the load the bottleneck. This reads just what the scheduler's
OpenAI API sends (a status line, headers, a chunked body of `data:` events)
over one keep-alive connection per stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# One event's data (its `data:` lines joined by newlines) -> nothing; raising stops the read.
OnEvent = Callable[[bytes], None]


class HttpError(Exception):
    """A reply other than 200 OK: `status` is its HTTP status code."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class EventParser:
    """Splits a byte stream into server-sent events and hands each event's data to `on_event`."""

    def __init__(self, on_event: OnEvent) -> None:
        self.on_event = on_event
        self._pending = b""

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream (an event may span several calls)."""
        self._pending += data.replace(b"\r\n", b"\n")
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                self.on_event(b"\n".join(lines))


class HttpConnection:
    """One keep-alive connection to `host:port`, opened on first use; POSTs JSON, reads events back."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post_events(self, path: str, body: bytes, on_event: OnEvent) -> bool:
        """POST `body` (JSON) to `path`, `on_event` for each event of the reply; True if the connection stays open.

        Raises:
            HttpError: the reply was not 200 (its body is read and dropped).
            OSError, asyncio.IncompleteReadError, ValueError: the connection broke or spoke something else.
            A caller that gets any exception (its own from `on_event` too) must `close()` the connection.
        """
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self._writer.write(head.encode() + body)
        status, headers = await read_head(self._reader)
        if status != 200:
            chunks: list[bytes] = []
            await read_body(self._reader, headers, chunks.append)
            raise HttpError(status, b"".join(chunks))
        reusable = await read_body(self._reader, headers, EventParser(on_event).feed)
        return reusable and headers.get("connection", "").lower() != "close"

    def close(self) -> None:
        """Drop the connection (the next POST opens a new one)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and headers (names lowercased) of a reply."""
    status_line = await reader.readuntil(b"\r\n")
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], sink: Callable[[bytes], None]) -> bool:
    """Hand the reply's body to `sink` as it arrives; False when its end is the connection's (no reuse)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            sink((await reader.readexactly(size + 2))[:-2])  # the chunk and its CRLF
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any, up to the empty line
            pass
        return True
    if "content-length" in headers:
        sink(await reader.readexactly(int(headers["content-length"])))
        return True
    sink(await reader.read())  # up to EOF
    return False
