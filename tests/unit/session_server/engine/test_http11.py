"""engine_http.EngineHTTP, the hot-path client for POST /generate, against in-process asyncio HTTP servers that
behave the way an engine (or a broken one) can: keep-alive reuse, chunked bodies, idle connections the engine
closes, cancellation, a connection that dies after the request was written (never resent), malformed HTTP.
The same contract is checked for the httpx alternative (`--engine-client httpx`) where it applies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from session_server.engine.client import EngineClient
from session_server.engine.http11 import EngineHTTP, EngineStream
from session_server.errors import EngineUnavailableError

Handler = Callable[["Origin", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Origin:
    """Counts connections and complete requests; `handler` serves one connection."""

    handler: Handler
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    eof_seen: asyncio.Event = field(default_factory=asyncio.Event)
    received: asyncio.Event = field(default_factory=asyncio.Event)  # set on the first complete request
    url: str = ""

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof_seen.set()
            return None
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        body = await reader.readexactly(length)
        self.requests.append(body)
        self.received.set()
        return body


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + (
        b"".join(b"\r\n" + h for h in extra)
    ) + b"\r\n\r\n" + body


@asynccontextmanager
async def origin(handler: Handler) -> AsyncIterator[Origin]:
    state = Origin(handler)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(state, reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield state


async def echo_keep_alive(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (body := await o.read_request(reader)) is not None:
        writer.write(ok(body))
        await writer.drain()


def run(coro: Awaitable[None]) -> None:
    """Run a scenario; the bound only turns a hang into a failure (every step waits for an event)."""
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def test_keep_alive_connection_is_reused() -> None:
    async def main() -> None:
        async with origin(echo_keep_alive) as o:
            client = EngineHTTP(o.url, connections=4)
            for i in range(5):
                status, body, ctype = await client.post("/generate", b'{"i":%d}' % i, {})
                assert (status, body, ctype) == (200, b'{"i":%d}' % i, "application/json")
            client.close()
            assert o.connections == 1 and len(o.requests) == 5

    run(main())


def test_chunked_response_body_is_joined() -> None:
    async def chunked(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await o.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b'{"text":', b'"hello"', b"}"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    async def main() -> None:
        async with origin(chunked) as o:
            client = EngineHTTP(o.url, connections=2)
            assert await client.post("/generate", b"{}", {}) == (200, b'{"text":"hello"}', "application/json")
            assert await client.post("/generate", b"{}", {}) == (200, b'{"text":"hello"}', "application/json")
            client.close()
            assert o.connections == 1  # chunked framing keeps the connection reusable

    run(main())


def test_a_stream_is_read_in_pieces_one_per_chunk() -> None:
    """EngineStream hands a chunked body over one piece per HTTP chunk, however the socket reads cut the chunks (a
    chunk a read cut is one piece with its rest), and a body of another framing one piece per read."""
    chunks = [b"data: %d%s\n\n" % (i, b"x" * i) for i in range(40)]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def main() -> None:
        for step in (1, 7, 64, len(body)):
            stream = EngineStream()
            stream.data_received(head)
            for at in range(0, len(body), step):
                stream.data_received(body[at:at + step])
            assert [p async for pieces in stream.aiter_pieces() for p in pieces] == chunks
        plain = EngineStream()
        plain.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
        plain.data_received(b"56789")
        assert [p async for pieces in plain.aiter_pieces() for p in pieces] == [b"01234", b"56789"]

    run(main())


def test_a_take_waits_for_enough_whole_pieces_or_its_time() -> None:
    """EngineStream.take (engine/sse.py Reads): whole chunks only (a chunk still arriving stays for the next take),
    once `enough` are there; after `within` seconds whatever is there, maybe nothing; None once the body ended and
    was all taken. Fed by hand, so no wait depends on the machine's speed (the time bounds are only there to fail)."""
    chunks = [b"data: %d\n\n" % i for i in range(4)]
    framed = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]

    async def main() -> None:
        stream = EngineStream()
        stream.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed[0] + framed[1][:5])
        assert await asyncio.wait_for(stream.take(1, 0.0, None), 5) == chunks[:1]  # the cut chunk stays
        assert await stream.take(2, 0.0, 0.0) == []  # its time is up: nothing whole is there
        waiting = asyncio.ensure_future(stream.take(2, 0.0, None))
        stream.data_received(framed[1][5:])
        await asyncio.sleep(0)
        assert not waiting.done()  # one whole piece of the two asked for
        stream.data_received(framed[2] + framed[3] + b"0\r\n\r\n")
        assert await asyncio.wait_for(waiting, 5) == chunks[1:]
        assert await stream.take(1, 0.0, None) is None

    run(main())


class _Reading:
    """A transport that only records whether reading is paused."""

    def __init__(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class _Kernel(_Reading):
    """A transport whose paused socket holds what the engine sends (`send`) until reading resumes; then the loop's
    next poll hands it to the protocol, as a real socket's readiness would. Records when reading resumed."""

    def __init__(self, stream: EngineStream) -> None:
        super().__init__()
        self.stream = stream
        self.held: list[bytes] = []
        self.resumed_at: list[float] = []

    def resume_reading(self) -> None:
        super().resume_reading()
        self.resumed_at.append(asyncio.get_running_loop().time())
        asyncio.get_running_loop().call_soon(self._deliver)

    def send(self, data: bytes) -> None:
        self.held.append(data)
        if not self.paused:
            self._deliver()

    def _deliver(self) -> None:
        held, self.held = self.held, []
        for data in held:
            self.stream.data_received(data)


def test_events_not_expected_before_the_time_wait_in_the_kernel_until_it() -> None:
    """Once the engine's pace is known and the events asked for are not expected before the take's time, reading
    pauses until that time: the events sent meanwhile wake nothing, and are read at the time, in the take's answer
    (reading resumes at the time, not before it, and the take is answered after that read)."""
    chunks = [b"data: %d\n\n" % i for i in range(6)]
    framed = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = EngineStream()
        kernel = _Kernel(stream)
        stream.transport = kernel  # type: ignore[assignment]
        kernel.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(framed[:3]))
        assert await stream.take(3, 0.0, None) == chunks[:3]
        stream._first_at, stream._last_at = loop.time() - 2.0, loop.time()  # an event per second so far
        due = loop.time() + 0.05
        waiting = asyncio.ensure_future(stream.take(3, 0.0, due - loop.time()))
        await asyncio.sleep(0)
        assert kernel.paused  # the next three are expected in 3 s: nothing is read before the time
        kernel.send(framed[3] + framed[4])
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and stream._arrivals == 3
        assert await asyncio.wait_for(waiting, 5) == chunks[3:5]
        assert len(kernel.resumed_at) == 1 and kernel.resumed_at[0] >= due - 1e-6

    run(main())


def test_a_take_reads_on_until_the_pace_is_known_then_pauses() -> None:
    """A take that waits for more events than have come reads every event while the engine's pace is unknown; once
    three events give it, the take plans its wait again and reading pauses until the rest are expected (not one
    wake-up per event for the rest of the take). Fed by hand, the pace set on the stream's clock."""
    framed = [b"%x\r\n%s\r\n" % (len(c), c) for c in (b"data: %d\n\n" % i for i in range(3))]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = EngineStream()
        transport = _Reading()
        stream.transport = transport  # type: ignore[assignment]
        stream.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed[0])
        stream._first_at = loop.time() - 2.0  # the first event two seconds ago
        waiting = asyncio.ensure_future(stream.take(10, 0.0, None))
        await asyncio.sleep(0)
        assert not transport.paused  # the pace is unknown: every event is read
        stream.data_received(framed[1])
        await asyncio.sleep(0)
        assert not transport.paused and not waiting.done()
        stream.data_received(framed[2])  # an event a second: the next seven are 7 s away
        for _ in range(5):
            await asyncio.sleep(0)
        assert transport.paused and not waiting.done()
        waiting.cancel()

    run(main())


def test_an_event_waits_in_the_kernel_at_most_a_share_of_the_replys_time_so_far() -> None:
    """Any event may end the reply, so the pause before the next read is bounded twice: by _MAX_PAUSE, and by a
    quarter of the time since the reply's first event -- a short reply's end is late by a fraction of its own time
    at most. The pace set by hand on the stream's clock: three events so far, the next five due later than either
    bound."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stream = EngineStream()
        stream._chunked, stream._arrivals = True, 3
        for streamed in (0.1, 10.0):  # the reply's first event that long ago, the last one just now
            now = loop.time()
            stream._first_at, stream._last_at = now - streamed, now
            at = stream._expected(5)
            assert at is not None and at - loop.time() <= min(0.2, streamed / 4) + 1e-6
            assert at - now >= min(0.2, streamed / 4) - 0.05  # it does pause (the events are seconds away)

    run(main())


def test_connection_close_response_is_not_reused() -> None:
    async def closing(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (body := await o.read_request(reader)) is not None:
            writer.write(ok(body, b"Connection: close"))
            await writer.drain()

    async def main() -> None:
        async with origin(closing) as o:
            client = EngineHTTP(o.url, connections=2)
            for _ in range(3):
                assert (await client.post("/generate", b"{}", {}))[0] == 200
            client.close()
            assert o.connections == 3

    run(main())


def test_a_connection_that_answered_a_server_error_is_not_reused() -> None:
    """SGLang 0.5.23 answers an unhandled exception with a 500 that does not say `Connection: close`, then closes the
    socket: reused before that EOF arrives, the connection would fail the next request. Here the origin keeps it open
    (the worst case: no EOF ever tells), so only the status can keep the client off it."""
    async def error_then_echo(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await o.read_request(reader)) is not None:
            if body == b"crash":
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                             b"Content-Length: 21\r\n\r\nInternal Server Error")
            else:
                writer.write(ok(body))
            await writer.drain()

    async def main() -> None:
        async with origin(error_then_echo) as o:
            client = EngineHTTP(o.url, connections=2)
            assert (await client.post("/generate", b"{}", {}))[0] == 200
            assert (await client.post("/generate", b"crash", {}))[0] == 500
            assert (await client.post("/generate", b"{}", {}))[0] == 200
            client.close()
            assert o.connections == 2  # the first served 200 and the 500; the third request went on a new one

    run(main())


def test_idle_connection_closed_by_the_engine_is_replaced_before_writing() -> None:
    """The engine's keep-alive timeout closes an idle socket: the next request goes on a fresh connection and the
    engine sees it exactly once."""

    async def one_per_connection(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (body := await o.read_request(reader)) is not None:
            writer.write(ok(body))  # keep-alive allowed, then the engine closes the idle socket anyway
            await writer.drain()

    async def main() -> None:
        async with origin(one_per_connection) as o:
            client = EngineHTTP(o.url, connections=2)
            assert (await client.post("/generate", b'{"n":1}', {}))[0] == 200
            await asyncio.sleep(0.05)  # the FIN reaches the idle connection in the pool
            assert (await client.post("/generate", b'{"n":2}', {}))[0] == 200
            client.close()
            assert o.requests == [b'{"n":1}', b'{"n":2}'] and o.connections == 2

    run(main())


def test_connection_idle_past_the_limit_is_not_reused() -> None:
    """The engine's keep-alive timer may close a connection just as a request is written on it (a 502 that cannot be
    told from a dead engine): a connection idle longer than the pool's limit, set below the engine's, is let go."""

    async def main() -> None:
        async with origin(echo_keep_alive) as o:
            # A limit of 1 s: two requests in a row are far within it even on a loaded machine
            client = EngineHTTP(o.url, connections=2, idle_limit=1.0)
            assert (await client.post("/generate", b'{"n":1}', {}))[0] == 200
            assert (await client.post("/generate", b'{"n":2}', {}))[0] == 200  # within the limit: reused
            assert o.connections == 1
            # Idle past the limit: the pool reads the loop's clock, moved on 1.5 s here instead of sleeping them.
            loop = asyncio.get_running_loop()
            now = loop.time
            loop.time = lambda: now() + 1.5  # type: ignore[method-assign]
            assert (await client.post("/generate", b'{"n":3}', {}))[0] == 200
            await o.eof_seen.wait()  # the stale connection was closed, not kept
            client.close()
            assert o.requests == [b'{"n":1}', b'{"n":2}', b'{"n":3}'] and o.connections == 2

    run(main())


def test_request_is_never_resent_once_written() -> None:
    """The engine read the request and died before answering: a 502 for this turn, not a second generation."""

    async def read_then_drop(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if o.connections == 1:
            while (body := await o.read_request(reader)) is not None:  # first connection: serve, then drop
                if body == b'{"n":2}':
                    return
                writer.write(ok(body))
                await writer.drain()
        else:
            await echo_keep_alive(o, reader, writer)

    async def main() -> None:
        async with origin(read_then_drop) as o:
            client = EngineHTTP(o.url, connections=2)
            assert (await client.post("/generate", b'{"n":1}', {}))[0] == 200
            with pytest.raises(EngineUnavailableError, match="closed the connection"):
                await client.post("/generate", b'{"n":2}', {})  # written on the reused connection, then lost
            await asyncio.sleep(0.05)
            assert o.requests == [b'{"n":1}', b'{"n":2}'] and o.connections == 1  # never resent
            assert (await client.post("/generate", b'{"n":3}', {}))[0] == 200  # the pool recovers
            client.close()

    run(main())


def test_cancellation_closes_the_connection() -> None:
    """A cancelled request (client gone, timeout, abort) must close its socket so the engine aborts too."""

    async def never_answers(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await o.read_request(reader)
        await o.read_request(reader)  # returns None at EOF and records it

    async def main() -> None:
        async with origin(never_answers) as o:
            client = EngineHTTP(o.url, connections=2)
            task = asyncio.ensure_future(client.post("/generate", b"{}", {}))
            await o.received.wait()  # bounded by run()'s own limit
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await o.eof_seen.wait()
            client.close()

    run(main())


def test_malformed_http_is_engine_unavailable() -> None:
    async def garbage(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await o.read_request(reader)
        writer.write(b"HTTP/9 nonsense\r\n\x00\x01\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with origin(garbage) as o:
            client = EngineHTTP(o.url, connections=1)
            with pytest.raises(EngineUnavailableError, match="malformed HTTP"):
                await client.post("/generate", b"{}", {})
            client.close()

    run(main())


def test_connect_refused_is_engine_unavailable() -> None:
    async def main() -> None:
        async with origin(echo_keep_alive) as o:
            url = o.url
        client = EngineHTTP(url, connections=1)  # the origin is gone: nothing listens there any more
        with pytest.raises(EngineUnavailableError, match="cannot connect"):
            await client.post("/generate", b"{}", {})

    run(main())


@pytest.mark.parametrize("hot_path", ["httptools", "httpx"])
def test_engine_client_hot_paths_share_the_contract(hot_path: str) -> None:
    """Both `--engine-client` choices: keep-alive reuse, the routing header, no resend after a write."""
    seen_headers: list[bytes] = []

    async def recording(o: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            seen_headers.append(head)
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            body = await reader.readexactly(length)
            o.requests.append(body)
            if body == b'{"drop":true}':
                return
            writer.write(ok(body))
            await writer.drain()

    async def main() -> None:
        async with origin(recording) as o:
            client = EngineClient(o.url, timeout=10, connections=4, hot_path=hot_path)
            for _ in range(3):
                reply = await client.generate(b"{}", "session-1")
                assert reply.ok and reply.body == b"{}"
            assert o.connections == 1
            assert all(b"x-smg-routing-key: session-1" in h.lower() for h in seen_headers)
            with pytest.raises(EngineUnavailableError):
                await client.generate(b'{"drop":true}', "session-1")
            await asyncio.sleep(0.05)
            assert o.requests.count(b'{"drop":true}') == 1
            await client.aclose()

    run(main())
