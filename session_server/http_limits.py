"""uvicorn's httptools protocol with a limit on the size of a request's head (request line + headers).

httptools (llhttp) has no such limit and uvicorn sets none: one request with a 64 MiB header was accepted, grew the
process by 121 MiB and stalled /health for 3 s while it was parsed. h11 has `h11_max_incomplete_event_size`, but h11
costs far more CPU per request than httptools on the hot path. So we count the bytes fed to the parser while a
request's head is incomplete; past the limit the client gets 431 (RFC 6585) and the connection is closed, before the
application ever sees the request. The count is per connection and per request (it restarts at each message), and
the parser never buffers more than the limit plus one read.
"""

from __future__ import annotations

from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY = (b'{"error":{"message":"request line and headers exceed the limit of %d bytes",'
         b'"type":"request_headers_too_large","code":431}}')


class _HeadTooLarge(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0  # bytes of the current request's head fed while it was incomplete
        self._head_parsed = 0  # exact size of what the parser has handed over: URL, header names and values

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = self._head_parsed = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > self.max_header_bytes:
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        """uvicorn's own data_received, plus the two head limits: the exact one from the parser's callbacks, and
        a running count while the head is incomplete (httptools buffers a header until it ends, so the exact
        count alone would let a 64 MiB header be buffered first)."""
        self._unset_keepalive_if_required()
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
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse()

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


def limited_httptools(max_header_bytes: int) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this limit."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"max_header_bytes": max_header_bytes})
