"""The engine's side of a streamed /generate, composed: the body's pieces into whole events (frames.py), the events
into what they add and the final body (reader.py), what they add into the agent's chunks (chunker.py).

Why the loop asks the reads for enough events (`Reads.take`) rather than taking each as it comes: at a real engine's
pace every event is a socket read of its own, and waking the stream for each one (the read, the decode, the chunk
rules) costs more than the event's tokens cost in a plain reply. The chunker knows how many events fill the next
chunk and by when what is held must go out; the lean client (http11.EngineStream) keeps reading the socket and wakes
the stream only then, so a streamed reply costs a wake-up per chunk, not per event. `coalesce` spaces the reads
further (a minimum time between two), so events that arrive faster than that are read as one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from session_server.engine.chunker import Chunker, Progress
from session_server.engine.frames import Frames
from session_server.engine.reader import EngineError, Final, StreamReader
from trajectory.errors import UpstreamError

__all__ = ["EngineError", "Final", "Progress", "Reads", "engine_events", "reads_of"]


@runtime_checkable
class Reads(Protocol):
    """A streamed body as it arrives, taken in batches of pieces (for a chunked body, one per HTTP chunk)."""

    async def take(self, enough: int, after: float, within: float | None) -> list[bytes] | None:
        """The pieces received since the last take, once `enough` whole ones are there and `after` seconds have
        passed, or after `within` seconds whatever is there (maybe nothing); None once the body has ended and all
        of it was taken."""
        ...


async def engine_events(reads: Reads | AsyncIterator[list[bytes]], incremental: bool, logprobs: bool = False,
                        coalesce: float = 0.0, chunker: Chunker | None = None, vocab_size: int = 2**31,
                        event_tokens: int = 1) -> AsyncIterator[Progress | Final]:
    """What an engine stream adds, as Progress for the agent's chunks, then the Final. `logprobs`: the new tokens'
    logprob entries are wanted (validated against `vocab_size`). `coalesce`: seconds to leave between reads.
    `event_tokens`: the tokens per event asked of the engine (how many events fill a chunk). An `{"error": ...}`
    event raises EngineError; a stream that is not SGLang's (bad JSON, bad entries, no final event) raises
    UpstreamError (502)."""
    loop = asyncio.get_running_loop()
    source: Reads = reads if isinstance(reads, Reads) else reads_of(reads)
    chunker = chunker or Chunker(clock=loop.time)
    clock = chunker.clock
    frames = Frames()
    reader = StreamReader(incremental, logprobs, vocab_size)
    next_read = 0.0
    try:
        while True:
            now = clock()
            due = chunker.due()
            within = None if due is None else due - now
            if within is not None and within <= 0:
                enough, within = 1, None  # late already: the next event goes on as soon as it comes
            else:
                enough = chunker.events_wanted(max(event_tokens, reader.event_tokens))
            pieces = await source.take(enough, max(0.0, next_read - now), within)
            if pieces is None:
                payloads, ended = frames.close(), True
            else:
                next_read = clock() + coalesce
                payloads = frames.feed(pieces)
                ended = frames.done
            added, final = reader.read(payloads)
            if added is not None:
                chunker.hold(added)
            if (progress := chunker.take(final is not None or ended)) is not None:
                yield progress
            if final is not None:
                yield final
                return
            if ended:
                raise UpstreamError("engine stream ended without a final event", rule="stream_incomplete")

    finally:
        if isinstance(source, _IteratorReads):
            source.close()

class _IteratorReads:
    """Reads of a client that hands the body over as an async iterator (httpx's bytes, or lists of pieces): each
    take is one read (raced against `due`), whatever `enough` asks."""

    def __init__(self, reads: AsyncIterator[list[bytes]]) -> None:
        self._reads = reads
        self._next: asyncio.Future[list[bytes]] | None = None  # a read raced against a due time, still running

    async def take(self, enough: int, after: float, within: float | None) -> list[bytes] | None:
        loop = asyncio.get_running_loop()
        due = None if within is None else loop.time() + within
        if (delay := min(after, after if within is None else within)) > 0:
            await asyncio.sleep(delay)
        if self._next is None:
            if due is None:
                try:
                    return await anext(self._reads)
                except StopAsyncIteration:
                    return None
            self._next = asyncio.ensure_future(anext(self._reads))
        if due is not None:
            done, _ = await asyncio.wait((self._next,), timeout=max(0.0, due - loop.time()))
            if not done:
                return []
        read, self._next = self._next, None
        try:
            return await read
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()


def reads_of(reads: AsyncIterator[bytes] | AsyncIterator[list[bytes]]) -> Reads:
    """The reads of a client that hands the body over as an async iterator: of joined chunks (httpx) or of lists
    of pieces."""
    return _IteratorReads(_as_lists(reads))


async def _as_lists(reads: AsyncIterator[bytes] | AsyncIterator[list[bytes]]) -> AsyncIterator[list[bytes]]:
    async for read in reads:
        yield [read] if isinstance(read, bytes) else read

