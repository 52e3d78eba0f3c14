"""A minimal keep-alive HTTP/1.1 client for the engine: the hot POST /generate, and the control calls on a pool of
their own.

Why not httpx here: profiling the server at zero engine latency showed about half of its CPU per turn inside
httpx/httpcore -- request/URL/header model objects, and a connection pool that polls every idle socket for
readability on every request, so the cost grows with the number of concurrent sessions. The engine is one known
origin speaking plain HTTP/1.1 with Content-Length or chunked bodies, so a pool of asyncio protocols with the
httptools parser (the same parser uvicorn uses) does the job in a few microseconds per request. Control calls
(abort, engine sessions, ready, models) left httpx as well, for robustness rather than microseconds: under a burst of
hundreds of control calls (a GRPO step's opens and closes) httpcore's pool let its waiters time out while its own
connections were still connecting, and a connection whose connect was cancelled by a deadline stayed in the pool as
CONNECTING for good, so after 32 such cancellations every control call waited out its whole deadline (issue 43:
each DELETE took the 1 s control timeout long after the engine was idle, and 150 engine sessions were never closed).
Here a cancelled connect or request closes its connection and frees its slot, whatever the phase.

Semantics the chat handler relies on: a cancelled request closes its connection (the engine sees the client go
away and aborts), transport failures raise EngineUnavailableError (502), a request is never resent once written,
and a connection is reused only after a complete response that allows keep-alive. `--engine-client httpx` swaps this
pool for httpx (same semantics) so `make bench-compare` can re-measure why this module exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

from session_server.errors import EngineUnavailableError


class _Parsed(asyncio.Protocol):
    """A connection whose bytes go to an httptools response parser; a malformed response fails it and closes it."""

    transport: asyncio.Transport | None
    _parser: httptools.HttpResponseParser

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineUnavailableError(f"engine sent malformed HTTP: {exc}"))
            self.close()

    def _fail(self, exc: Exception) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Connection(_Parsed):
    __slots__ = (
        "_body", "_content_type", "_parser", "_waiter", "closed", "idle_since", "keep_alive", "status", "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._content_type = b"application/json"
        self.status = 0
        self.keep_alive = False
        self.idle_since = 0.0  # loop time it went back to the pool

    # -- asyncio.Protocol -------------------------------------------------------------------------------
    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(EngineUnavailableError("engine closed the connection before the response was complete"))

    # -- httptools callbacks ----------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- client side ------------------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    async def roundtrip(self, request: bytes) -> tuple[int, bytes, str]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._body = []
        self._content_type = b"application/json"
        self.keep_alive = False
        self.transport.write(request)
        await self._waiter
        self._waiter = None
        return self.status, b"".join(self._body), self._content_type.decode("latin-1")

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class EngineStream(_Parsed):
    """One streamed response (`stream: true`), on a connection of its own that is closed afterwards.

    Why not httpx here: with one engine event per token, httpx hands over every HTTP chunk separately through
    several Python layers (~10 us each); here the parser's callback appends the chunk's bytes and the reader takes
    everything that arrived since its last read as one piece. While the reader is away the socket is not read, so
    what the engine sends meanwhile waits in the kernel and arrives in one read when the reader is back: a reader
    that reads less often pays per read, not per event, and the unread body is bounded by the socket's buffer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        # The parser's per-chunk callbacks are C calls (at one event per token a Python callback per chunk is a
        # good part of what a stream costs): a chunk's bytes and a None at its end go to `_fed`, sorted out once
        # per socket read (data_received).
        self._fed: list[bytes | None] = []
        self.on_body = self._fed.append
        self.on_chunk_complete = functools.partial(self._fed.append, None)
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._wake = asyncio.Event()
        self._taker: asyncio.Future[None] | None = None  # take() waiting, for `_enough` whole pieces
        self._enough = 1
        self._replan = False  # take() reads on until the engine's pace is known, then plans its wait again
        self._held = 0  # bytes received and not yet taken (reading pauses past HIGH_WATER)
        self._arrivals = 0  # whole pieces received (each an engine event, in SGLang's framing) ...
        self._first_at = self._last_at = 0.0  # ... the loop time the first and the last of them came
        self._chunks: list[bytes] = []
        self._chunked = False  # Transfer-Encoding: chunked
        self._open = False  # the last of _chunks is an HTTP chunk not yet complete (a socket read ended inside it)
        self._paused = False
        self._done = False
        self._error: Exception | None = None
        self.status_code = 0
        self.headers: dict[str, str] = {}

    # -- asyncio.Protocol -------------------------------------------------------------------------------
    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done:
            self._fail(EngineUnavailableError("engine stream broke: the connection closed before the end"))

    # -- httptools callbacks ----------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status_code = self._parser.get_status_code()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if not self._head.done():
            self._head.set_result(None)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        fed = self._fed
        if not fed:
            return
        pieces: list[bytes] = list(filter(None, fed))  # C: the chunks' bytes, without the ends and empty bodies
        if self._open and fed[0] is not None and self._chunks and pieces:
            self._chunks[-1] += pieces.pop(0)  # the rest of a chunk a socket read cut: one piece with its start
        self._open = self._chunked and fed[-1] is not None
        fed.clear()
        if pieces:
            self._chunks += pieces
            self._wake.set()
            self._held += len(data)
            self._last_at = self._loop.time()
            if not self._arrivals:
                self._first_at = self._last_at
            self._arrivals += len(pieces) - self._open
            if self._taker is not None:
                if len(self._chunks) - self._open >= self._enough or (self._replan and self._arrivals >= _PACE_EVENTS):
                    self._replan = False
                    self._wake_taker()  # enough; or the pace is known now: the take plans its wait again
            elif self._held > HIGH_WATER:  # the reader is away (sending to the agent): let the kernel hold the rest
                self._pause(True)

    def on_message_complete(self) -> None:
        self._done = True
        self._wake.set()
        self._wake_taker()

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake.set()
        self._wake_taker()

    def _wake_taker(self) -> None:
        if self._taker is not None:
            _wake(self._taker)

    # -- reader side ------------------------------------------------------------------------------------
    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each piece is everything received since the previous one."""
        async for pieces in self.aiter_pieces():
            yield b"".join(pieces)

    async def aiter_pieces(self) -> AsyncIterator[list[bytes]]:
        """The body as it arrives, unjoined: everything received since the previous read, one piece per HTTP chunk of
        a chunked body (SGLang writes one per stream event; a chunk still arriving when the reader takes the pieces
        is the last piece, and its rest comes first in the next read), one per socket read of any other body."""
        while True:
            if self._chunks:
                pieces, self._chunks = self._chunks, []
                self._pause(True)  # while the reader is away, what the engine sends waits in the socket
                yield pieces
                continue
            if self._done:
                return
            if self._error is not None:
                raise self._error
            self._pause(False)
            self._wake.clear()
            await self._wake.wait()

    async def take(self, enough: int, after: float, within: float | None) -> list[bytes] | None:
        """The whole pieces received since the last take (a chunk still arriving stays for the next), once `enough`
        are there and `after` seconds have passed, or after `within` seconds whatever is there (maybe nothing);
        None once the body has ended and all of it was taken (engine/sse.py Reads).

        The socket is read all along (each read a parser feed and a count, no wake-up of the reader): only the
        `enough`-th piece, the time bound or the body's end wakes it. Once the engine's pace is known, reading pauses
        until the `enough`-th piece is expected, or until the time bound when that comes first: the events wait in
        the kernel and are read in one read, and the reader is woken once, after it. Past HIGH_WATER bytes unread by
        the reader, reading pauses too (what the engine sends then waits in the kernel)."""
        loop = self._loop
        now = loop.time()
        not_before = now + after
        due = None if within is None else now + within
        timer: asyncio.TimerHandle | None = None
        try:
            while True:
                whole = len(self._chunks) - (self._open and not self._done)
                if self._error is not None:
                    if whole:
                        break
                    raise self._error
                if self._done:
                    if not self._chunks:
                        return None
                    break
                now = loop.time()
                if (due is not None and now >= due) or (whole >= enough and now >= not_before):
                    break
                wake = due if whole < enough else (not_before if due is None else min(due, not_before))
                if timer is not None:
                    timer.cancel()
                taker = self._taker = loop.create_future()
                self._enough = enough if whole < enough else 1 << 62  # enough already: only the time wakes it
                resume = self._expected(enough - whole) if whole < enough else None
                if whole >= enough:
                    self._pause(True)  # only the time wakes it: what comes meanwhile waits in the kernel
                elif resume is not None and (read_at := resume if due is None else min(resume, due)) > now + _MIN_PAUSE:
                    # the events wait in the kernel until they are expected all to be there (at most _MAX_PAUSE) or
                    # the time, and the stream is woken once, after the one read then (not by the read and again
                    # by the time); if not enough came by then, it plans its wait again
                    self._pause(True)
                    timer = loop.call_at(read_at, self._read_then_wake, taker)
                    await taker
                    continue
                else:
                    self._pause(False)
                    self._replan = resume is None and whole < enough and self._chunked
                timer = loop.call_at(wake, self._wake_taker) if wake is not None else None
                await taker
        finally:
            self._taker = None
            self._replan = False
            if timer is not None:
                timer.cancel()
        if whole == len(self._chunks):
            pieces, self._chunks = self._chunks, []
        else:
            pieces = self._chunks[:whole]
            del self._chunks[:whole]
        self._held = 0
        return pieces

    def _expected(self, more: int) -> float | None:
        """When `more` engine events will have come, by the pace of those so far (SGLang's events come at a steady
        pace: a decode step's time times the stream interval), a little after; None while the pace is unknown.
        Reading pauses until then: the events wait in the kernel and wake the process once, not once each."""
        if not self._chunked or self._arrivals < _PACE_EVENTS:
            return None
        spacing = (self._last_at - self._first_at) / (self._arrivals - 1)
        # a margin of half an event's time (at most 10 ms): an engine's pace jitters, and an event a little late
        # would cost a wake-up of its own
        at = self._first_at + (self._arrivals - 1 + more) * spacing + max(_MIN_PAUSE, min(spacing / 2, 0.01))
        # any event may be the reply's last: it waits at most _MAX_PAUSE, and at most _LATE_SHARE of the time the
        # reply has streamed so far, so a short reply's end is never late by more than a fraction of its own time
        now = self._loop.time()
        return min(at, now + min(_MAX_PAUSE, (now - self._first_at) * _LATE_SHARE))

    def _read_then_wake(self, taker: asyncio.Future[None]) -> None:
        """The time is up while reading is paused: read what the kernel holds, then wake `taker`. Two hops of the
        loop, so that its next poll for I/O (which reads the socket) runs first, in asyncio's loop and in uvloop's
        alike; the wake-up is the one the time costs, the read needs none of its own."""
        self._pause(False)
        self._loop.call_soon(self._loop.call_soon, _wake, taker)

    def _pause(self, paused: bool) -> None:
        transport = self.transport
        if paused == self._paused or transport is None or transport.is_closing():
            return
        self._paused = paused
        if paused:
            transport.pause_reading()
        else:
            transport.resume_reading()

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _wake(taker: asyncio.Future[None]) -> None:
    if not taker.done():
        taker.set_result(None)


HIGH_WATER = 4 * 2**20  # bytes of a stream received and not yet taken before reading pauses
_PACE_EVENTS = 3  # events whose times give the engine's pace
_MAX_PAUSE = 0.2  # seconds an engine event may wait in the kernel at most (it may end the reply)
_LATE_SHARE = 0.25  # ... and at most this share of the time since the reply's first event
_MIN_PAUSE = 0.001  # seconds: reading pauses for an expected event only when it is at least this far off

# How long a connection may sit idle and still be reused. SGLang's uvicorn closes a keep-alive connection idle for
# SGLANG_TIMEOUT_KEEP_ALIVE (5 s by default); one it closes while our request is on the wire cannot be told from an
# engine that died mid-request (502, never resent), so the pool lets idle connections go well before the engine does.
IDLE_LIMIT = 2.0


class EngineHTTP:
    """HTTP/1.1 client for one origin with a bounded keep-alive pool (a request waits for a free slot)."""

    def __init__(self, base_url: str, *, connections: int, connect_timeout: float = 10.0,
                 idle_limit: float = IDLE_LIMIT) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError("the engine hot path speaks plain http:// only")
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.encode("latin-1")
        self._idle: deque[_Connection] = deque()
        self._slots = asyncio.Semaphore(connections)
        self._connect_timeout = connect_timeout
        self._idle_limit = idle_limit
        self._closed = False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(_Connection, self._host, self._port)
        except (OSError, TimeoutError) as exc:
            raise EngineUnavailableError(f"cannot connect to the engine: {type(exc).__name__}: {exc}") from exc
        return conn

    def _head(self, path: str, length: int, headers: dict[str, str], method: str = "POST") -> bytes:
        lines = [
            f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"),
            b"Host: " + self._host_header + b"\r\n",
            b"Content-Type: application/json\r\n",
            b"Content-Length: " + str(length).encode() + b"\r\n",
        ]
        lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        lines.append(b"\r\n")
        return b"".join(lines)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
        """Send one request and return (status, body, content type).

        Never sent twice: once any byte of a request is written the engine may have started generating, and a
        POST /generate is not idempotent, so a connection that fails after the write is a 502 for this turn (the
        agent retries the turn; nothing was committed). Idle connections the engine closed are recognised before
        the write instead: the loop delivers their EOF to the protocol while they sit in the pool, and one idle for
        longer than the engine may keep it (IDLE_LIMIT) is not reused.
        """
        return await self.request("POST", path, body, headers)

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
        """`post` for any method (the control calls' GETs); the same guarantees."""
        if self._closed:
            raise EngineUnavailableError("engine client is closed")
        request = self._head(path, len(body), headers, method) + body
        async with self._slots:
            conn = self._take_idle() or await self._connect()
            return await self._roundtrip(conn, request)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[EngineStream]:
        """POST on a fresh connection and yield the response once its head is read; leaving the block closes the
        connection (the engine sees the client go away). Transport failures are EngineUnavailableError."""
        if self._closed:
            raise EngineUnavailableError("engine client is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, stream = await loop.create_connection(EngineStream, self._host, self._port)
        except (OSError, TimeoutError) as exc:
            raise EngineUnavailableError(f"cannot connect to the engine: {type(exc).__name__}: {exc}") from exc
        try:
            assert stream.transport is not None
            stream.transport.write(self._head(path, len(body), headers) + body)
            await stream._head
            yield stream
        finally:
            stream.close()

    def _take_idle(self) -> _Connection | None:
        """The most recently used idle connection that is still open and has not idled past the limit (the engine's
        keep-alive timer may be about to close it); older ones are closed on the way."""
        oldest_usable = asyncio.get_running_loop().time() - self._idle_limit
        while self._idle:
            conn = self._idle.pop()
            if conn.idle_since < oldest_usable:
                conn.close()
                while self._idle:  # older still (the deque is in the order they went idle)
                    self._idle.pop().close()
                return None
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    async def _roundtrip(self, conn: _Connection, request: bytes) -> tuple[int, bytes, str]:
        try:
            result = await conn.roundtrip(request)
        except BaseException:
            conn.close()  # cancelled or failed mid-request: the engine must see the client go away
            raise
        # After a 5xx the engine may close the connection without saying so (SGLang's uvicorn does after an unhandled
        # exception's 500): reused at once, before its EOF arrives, it would fail the next turn. A fresh one is cheap.
        if conn.keep_alive and result[0] < 500 and not conn.closed and not self._closed:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            conn.close()
        return result

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
