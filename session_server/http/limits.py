"""uvicorn's httptools protocol with a limit on the size of a request's head (request line + headers), and replies
written in one piece.

httptools (llhttp) has no such limit and uvicorn sets none: one request with a 64 MiB header was accepted, grew the
process by 121 MiB and stalled /health for 3 s while it was parsed. h11 has `h11_max_incomplete_event_size`, but h11
costs far more CPU per request than httptools on the hot path. So we count the bytes fed to the parser while a
request's head is incomplete; past the limit the client gets 431 (RFC 6585) and the connection is closed, before the
application ever sees the request. The count is per connection and per request (it restarts at each message; the read
in which a head begins is not counted, since pipelined requests before it share that read), and the parser never
buffers more than the limit plus one read. Pipelined requests are answered in order, with uvicorn's flow control
(reading pauses while a request waits for the one before it): 2000 on one keep-alive connection are all answered.

One piece: uvicorn writes a response's status line and headers as soon as the app sends `http.response.start`, and
the body with the next message, so every reply costs two write syscalls and two TCP segments (with TCP_NODELAY), and
wakes the client twice. Writes made in one pass of the event loop are gathered and written together once the
handler yields (`_CoalescingTransport`): same bytes, same order, one syscall per reply.

The client going away: uvicorn tells only whoever awaits `receive()`; this protocol sees `connection_lost` itself
and offers a request the hook http/disconnect.py hands out (a callback per watcher, no task).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from session_server.http.disconnect import EXTENSION, WATCH, Unsubscribe

_BODY = (b'{"error":{"message":"request line and headers exceed the limit of %d bytes",'
         b'"type":"request_headers_too_large","code":431}}')


class _HeadTooLarge(Exception):
    pass


_GATHER_BELOW = 256 * 1024  # larger pending writes go out as they are (no copy to join them)


class _CoalescingTransport:
    """A transport whose writes are held until the end of the current loop pass and then written as one.

    Everything else is the real transport's. `close()` writes what is held first (as a transport's own close sends
    its buffer); `abort()` drops it, like the real one drops its buffer."""

    __slots__ = ("_loop", "_pending", "_scheduled", "_size", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._size = 0
        self._scheduled = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        self._size += len(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        size, self._size = self._size, 0
        if not pending or self._transport.is_closing():
            return
        if len(pending) == 1:
            self._transport.write(pending[0])
        elif size <= _GATHER_BELOW:
            self._transport.write(b"".join(pending))
        else:
            self._transport.writelines(pending)

    def get_write_buffer_size(self) -> int:
        return self._size + self._transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending, self._size = [], 0
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0  # bytes of reads fed whole while the current request's head was incomplete
        self._head_began = False  # the current request's head began in the read being fed
        self._read_size = 0  # bytes of the read being fed
        self._lost = False
        self._watchers: set[Callable[[], None]] = set()  # called once the connection is lost
        # The hook every request's scope carries (ASGI: an extension's value is a dict), made once per connection.
        self._extension: dict[object, object] = {WATCH: self.watch_disconnect}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._lost = True
        watchers, self._watchers = self._watchers, set()
        for callback in watchers:
            self.loop.call_soon(callback)

    def watch_disconnect(self, callback: Callable[[], None]) -> Unsubscribe:
        """Run `callback` (soon, on the loop) once the client is gone; the result stops watching. Reading resumes,
        as in uvicorn's `receive()`, so that a connection paused by flow control still sees its EOF."""
        if self._lost:
            self.loop.call_soon(callback)
            return _nothing
        self.flow.resume_reading()
        self._watchers.add(callback)
        return partial(self._watchers.discard, callback)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {EXTENSION: self._extension}
        self._in_head = True
        self._head_bytes = 0
        self._head_began = True

    def on_headers_complete(self) -> None:
        """The exact size of the head (URL, names and values, 4 bytes of separators each), once it is complete:
        one sum per request (in C: lengths mapped over the flattened pairs) rather than a count in every header
        callback. A head that began and ended in the read being fed is no longer than that read: when the read is
        within the limit, so is the head, and nothing is summed (most requests)."""
        self._in_head = False
        if not (self._head_began and self._read_size <= self.max_header_bytes) and (
            len(self.url) + 4 * len(self.headers) + sum(map(len, chain.from_iterable(self.headers)))
            > self.max_header_bytes
        ):
            raise _HeadTooLarge
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        """uvicorn's own data_received, plus the two head limits: the exact one once the head is complete, and a
        running count while it is not (httptools buffers a header until it ends, so the exact count alone would let
        a 64 MiB header be buffered first)."""
        self._unset_keepalive_if_required()
        self._read_size = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse()
                return
            self._invalid()
            return
        except httptools.HttpParserError:
            self._invalid()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and not self.transport.is_closing():
            # The read in which the head began may hold whole pipelined requests before it: it is not counted (at
            # most one read of head bytes goes uncounted), every later read the head spans is, in full.
            if not self._head_began:
                self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse()
        self._head_began = False

    def _invalid(self) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    def _refuse(self) -> None:
        body = _BODY % self.max_header_bytes
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self._in_head = False
        self.transport.close()


def _nothing() -> None:
    pass


def limited_httptools(max_header_bytes: int) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this limit."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"max_header_bytes": max_header_bytes})
