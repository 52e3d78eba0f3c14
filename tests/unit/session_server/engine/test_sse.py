"""engine/sse.py, the stream loop (frames -> reader -> chunker): an engine stream read in any split into reads gives
the same text and the same final body as the stream read whole, in both of SGLang's streaming modes, SGLang's own
framing and odd framings alike; the agent's chunks keep their rules over real reads; errors and truncated streams
are reported. The parts alone: test_frames.py, test_reader.py, test_chunker.py."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.engine import pacing, sse
from session_server.engine.chunker import Chunker
from session_server.engine.frames import Frames
from session_server.engine.sse import EngineError, Final, Progress, engine_events
from support.examples import examples
from trajectory.errors import UpstreamError

_pieces = st.lists(st.tuples(st.lists(st.sampled_from([*'ab \n"\\é{}[],:', "data: ", "\n\ndata: "]),
                                      max_size=6).map("".join),
                             st.lists(st.integers(0, 99), min_size=1, max_size=3)),
                   min_size=1, max_size=12)


def _meta(ids: list[int], done: int, final: bool) -> dict[str, Any]:
    return {"id": "r", "finish_reason": {"type": "stop"} if final else None, "completion_tokens": done,
            "output_token_logprobs": [[-0.5, i, None] for i in ids], "output_token_logprobs_length": len(ids),
            "cached_tokens": 0}


def _stream(pieces: list[tuple[str, list[int]]], incremental: bool, framing: str = "sglang") -> tuple[bytes, dict]:
    """SGLang's SSE for a reply made of `pieces` (text, ids), and the /generate body it amounts to."""
    events, text, ids = [], "", []
    for n, (piece, piece_ids) in enumerate(pieces):
        text, ids = text + piece, ids + piece_ids
        final = n == len(pieces) - 1
        if incremental:
            events.append({"text": piece, "output_ids": piece_ids, "meta_info": _meta(piece_ids, len(ids), final)})
        else:
            events.append({"text": text, "output_ids": ids, "meta_info": _meta(ids, len(ids), final)})
    whole = {"text": text, "output_ids": ids, "meta_info": _meta(ids, len(ids), True)}
    sep = {"sglang": "\n\n", "crlf": "\r\n\r\n", "comments": "\n: keep-alive\n\n"}[framing]
    body = "".join(f"data: {json.dumps(e, separators=(',', ':'), ensure_ascii=False)}{sep}" for e in events)
    return (body + f"data: [DONE]{sep}").encode(), whole


def _chunk_ends(raw: bytes, framing: str) -> list[int]:
    """Where the body's HTTP chunks end when each event is one chunk, as SGLang (uvicorn) writes them."""
    sep = {"sglang": b"\n\n", "crlf": b"\r\n\r\n", "comments": b"\n: keep-alive\n\n"}[framing]
    ends, at = [], raw.find(sep)
    while at >= 0:
        ends.append(at + len(sep))
        at = raw.find(sep, at + len(sep))
    return ends


async def _read(raw: bytes, cuts: list[int], incremental: bool, logprobs: bool = True,
                piece_ends: list[int] | None = None) -> tuple[str, list[Any], Any]:
    """The stream read in reads that end at `cuts`, each read in pieces that end at `piece_ends` too (the HTTP
    parser's pieces: its chunks, cut by the reads); None: each read is one piece, through sse.reads_of."""
    bounds = [0, *sorted(c % (len(raw) + 1) for c in cuts), len(raw)]

    async def chunks() -> AsyncIterator[bytes]:
        for a, b in itertools.pairwise(bounds):
            if b > a:
                yield raw[a:b]

    async def pieces() -> AsyncIterator[list[bytes]]:
        ends = sorted({e % (len(raw) + 1) for e in piece_ends or ()})
        for a, b in itertools.pairwise(bounds):
            if b > a:
                edges = [a, *(e for e in ends if a < e < b), b]
                yield [raw[x:y] for x, y in itertools.pairwise(edges)]

    reads = sse.reads_of(chunks()) if piece_ends is None else pieces()
    text, logprobs, final = "", [], None
    async for event in engine_events(reads, incremental, logprobs=logprobs):
        if isinstance(event, Progress):
            text += event.text
            logprobs += event.tokens.ids.tolist() if event.tokens is not None else []
        else:
            assert isinstance(event, Final)
            final = json.loads(event.raw)
    return text, logprobs, final


@settings(max_examples=examples(200), deadline=None)
@given(pieces=_pieces, cuts=st.lists(st.integers(0, 10_000), max_size=8), incremental=st.booleans(),
       framing=st.sampled_from(["sglang", "crlf", "comments"]), wanted=st.booleans(),
       layout=st.sampled_from(["reads", "chunks", "pieces"]), piece_ends=st.lists(st.integers(0, 10_000), max_size=8))
def test_any_split_reads_the_same_reply(pieces: list[tuple[str, list[int]]], cuts: list[int], incremental: bool,
                                        framing: str, wanted: bool, layout: str, piece_ends: list[int]) -> None:
    """However the body is cut into reads, and each read into pieces (one per read, the HTTP chunks SGLang writes
    one per event, or anywhere: a proxy's own chunks), the same reply comes out."""
    raw, whole = _stream(pieces, incremental, framing)
    ends = {"reads": None, "chunks": _chunk_ends(raw, framing), "pieces": piece_ends}[layout]
    text, logprobs, final = asyncio.run(_read(raw, cuts, incremental, logprobs=wanted, piece_ends=ends))
    assert final is not None
    assert final["text"] == whole["text"]
    assert final["output_ids"] == whole["output_ids"]
    assert final["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert whole["text"].startswith(text)  # what was streamed is a prefix of the reply (the final event adds the rest)
    assert logprobs == whole["output_ids"][: len(logprobs)]
    assert wanted or not logprobs


def test_an_event_is_read_in_the_read_that_completes_it() -> None:
    """A read whose last piece holds a whole event and the start of the next (a proxy's chunks) hands that event on
    with the others, not one read later."""
    raw, _ = _stream([("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])], incremental=True)
    ends = _chunk_ends(raw, "sglang")
    chunks = [raw[a:b] for a, b in itertools.pairwise([0, *ends])]

    async def reads() -> AsyncIterator[list[bytes]]:
        yield [chunks[0], chunks[1] + chunks[2][:9]]
        yield [chunks[2][9:], *chunks[3:]]

    async def texts() -> list[str]:
        return [e.text async for e in engine_events(reads(), True) if isinstance(e, Progress)]

    assert asyncio.run(texts()) == ["ab", "c"]


def test_an_error_event_raises_with_its_bytes() -> None:
    raw = b'data: {"text":"a","output_ids":[1],"meta_info":{"finish_reason":null}}\n\n' \
          b'data: {"error":{"message":"boom","code":400}}\n\ndata: [DONE]\n\n'
    for incremental in (False, True):
        with pytest.raises(EngineError) as caught:
            asyncio.run(_read(raw, [], incremental))
        assert caught.value.error == {"message": "boom", "code": 400}


@pytest.mark.parametrize("raw", [b'data: {"text":"a","output_ids":[1],"meta_info":{"finish_reason":null}}\n\n'
                                 b"data: [DONE]\n\n", b'data: {"text":"a","output_ids":[1]', b""])
def test_a_stream_without_its_final_event_is_a_502(raw: bytes) -> None:
    for incremental, ends in itertools.product((False, True), (None, _chunk_ends(raw, "sglang"))):
        with pytest.raises(UpstreamError, match="without a final event"):
            asyncio.run(_read(raw, [7], incremental, piece_ends=ends))


def test_sglangs_delta_stream_is_read_without_the_bytes_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as SGLang writes it (one chunk per event, `[DONE]` last, reads cut anywhere), a delta stream never goes
    the bytes path (a search through every read)."""
    raw, whole = _stream([("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])], incremental=True)

    def refused(*_: object) -> None:
        raise AssertionError("the bytes path")

    monkeypatch.setattr(Frames, "_search", refused)
    for cuts in ([], [len(raw) - 3], [30, 200, len(raw) - 20]):
        text, _, final = asyncio.run(_read(raw, cuts, True, piece_ends=_chunk_ends(raw, "sglang")))
        assert final is not None and final["output_ids"] == whole["output_ids"] and text == "abc"


def test_an_event_that_is_not_json_is_a_502() -> None:
    raw = b'data: {"text":"a",\n\ndata: [DONE]\n\n'
    for incremental in (False, True):
        with pytest.raises(UpstreamError, match="not valid JSON"):
            asyncio.run(_read(raw, [], incremental))


async def _progresses(raw: bytes, cuts: list[int], chunk_tokens: int, logprobs: bool,
                      piece_ends: list[int] | None) -> tuple[list[Progress], Final | None]:
    """Every Progress of a delta stream read in reads that end at `cuts`, no time rule (the chunks by tokens only)."""
    bounds = [0, *sorted(c % (len(raw) + 1) for c in cuts), len(raw)]
    ends = sorted({e % (len(raw) + 1) for e in piece_ends or ()})

    async def reads() -> AsyncIterator[list[bytes]]:
        for a, b in itertools.pairwise(bounds):
            if b > a:
                edges = [a, *(e for e in ends if a < e < b), b]
                yield [raw[x:y] for x, y in itertools.pairwise(edges)]

    out: list[Progress] = []
    final = None
    async for event in engine_events(reads(), True, logprobs=logprobs, chunker=Chunker(chunk_tokens, 1e9)):
        if isinstance(event, Progress):
            out.append(event)
        else:
            final = event
    return out, final


@settings(max_examples=examples(200), deadline=None)
@given(pieces=_pieces, cuts=st.lists(st.integers(0, 10_000), max_size=8), chunk_tokens=st.integers(3, 8),
       logprobs=st.booleans(), one_per_token=st.booleans(), chunked=st.booleans())
def test_the_agent_gets_text_at_least_every_chunk_of_tokens(
        pieces: list[tuple[str, list[int]]], cuts: list[int], chunk_tokens: int, logprobs: bool,
        one_per_token: bool, chunked: bool) -> None:
    """Delta events of at most 3 tokens (or one each), read in any reads: the agent's chunks (each Progress's `cuts`)
    hold at most `chunk_tokens` tokens, their text and logprob entries are the reply's in order and nothing is held
    when the Final comes; and with one token per event, every chunk but the first hand-on's and the last is full
    (no more chunks than the tokens need). When the first text goes on: the test after this one."""
    if one_per_token:
        pieces = [(text, ids[:1]) for text, ids in pieces]
    raw, _ = _stream(pieces, incremental=True)
    progresses, final = asyncio.run(_progresses(raw, cuts, chunk_tokens, logprobs,
                                                _chunk_ends(raw, "sglang") if chunked else None))
    assert final is not None
    chunks: list[list[tuple[str, int]]] = []  # (text, tokens) of each chunk the agent gets, per Progress
    entries: list[Any] = []
    for progress in progresses:
        assert progress.cuts is not None and progress.cuts[-1][0] == len(progress.text)
        start = count = 0
        chunks.append([])
        for end, upto in progress.cuts:
            chunks[-1].append((progress.text[start:end], upto - count))
            start, count = end, upto
        entries += progress.tokens.ids.tolist() if progress.tokens is not None else []
    every = [chunk for batch in chunks for chunk in batch]
    intermediate = pieces[:-1]  # the final event's own piece comes with the Final
    assert "".join(text for text, _ in every) == "".join(text for text, _ in intermediate)  # in order, all of it
    wordy = all(text for text, _ in intermediate)  # else a chunk of no text and no logprobs is not sent at all
    if wordy or logprobs:
        assert sum(tokens for _, tokens in every) == sum(len(ids) for _, ids in intermediate)
    if logprobs:
        assert entries == [i for _, ids in intermediate for i in ids]
    assert all(0 < tokens <= chunk_tokens for _, tokens in every)
    if one_per_token and chunks and (wordy or logprobs):
        # full: all but the last of each hand-on up to the first with text (everything read goes on until then),
        # and the very last
        first = next((n for n, progress in enumerate(progresses) if progress.text), len(progresses))
        held = [tokens for b, batch in enumerate(chunks) for i, (_, tokens) in enumerate(batch)
                if not (b <= first and i == len(batch) - 1)]
        assert all(tokens == chunk_tokens for tokens in held[:-1])


def test_the_first_text_goes_on_at_once_and_held_text_by_the_deadline() -> None:
    """The first event's text is handed on before the next read is asked for; a second event's text, held (it fills
    no chunk), is handed on by the time rule while the engine sends nothing more. Built so that a reader that held
    either one would wait forever for a read that never comes (the bound is only there to fail, not to time)."""
    raw, _ = _stream([("a", [1]), ("b", [2]), ("c", [3])], incremental=True)
    chunks = [raw[a:b] for a, b in itertools.pairwise([0, *_chunk_ends(raw, "sglang")])]
    got: list[str] = []
    seen = [asyncio.Event(), asyncio.Event()]

    async def reads() -> AsyncIterator[list[bytes]]:
        yield [chunks[0]]
        await seen[0].wait()  # the first text must be out before the engine sends more
        yield [chunks[1]]
        await seen[1].wait()  # ... and the second before the engine sends its last event
        yield chunks[2:]

    async def run() -> None:
        async for event in engine_events(reads(), True,
                                         chunker=Chunker(64, 0.05, asyncio.get_running_loop().time)):
            if isinstance(event, Progress):
                got.append(event.text)
                seen[len(got) - 1].set()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert got == ["a", "b"]


class _PacedEngine:
    """An engine that sends its events (one HTTP chunk each) at given times on a clock of its own: `take` moves the
    clock on to when a real socket would answer it (the `enough`-th event after `after` seconds, or `within`
    seconds, or the body's end) and hands over what has arrived by then. The verdicts are the clock's, never the
    wall's: the stream loop and the chunker run as in the server, with this clock injected."""

    def __init__(self, pieces: list[bytes], times: list[float]) -> None:
        self.pieces, self.times = pieces, times
        self.now = 0.0
        self.taken = 0

    def clock(self) -> float:
        return self.now

    async def take(self, enough: int, after: float, within: float | None) -> list[bytes] | None:
        if self.taken == len(self.pieces):
            return None
        start = self.now
        last = min(self.taken + enough, len(self.pieces)) - 1  # the body's end wakes it too
        ready = max(self.times[last], start + after)
        self.now = max(start, min(ready, start + within) if within is not None else ready)
        upto = self.taken
        while upto < len(self.pieces) and self.times[upto] <= self.now:
            upto += 1
        out, self.taken = self.pieces[self.taken:upto], upto
        return out


def _paced_chunks(tokens: int, event_tokens: int, seconds_per_token: float, chunk_tokens: int,
                  chunk_seconds: float) -> tuple[list[tuple[float, int]], list[float]]:
    """A delta reply of `tokens` tokens in events of `event_tokens` (the first of one token, as SGLang sends it),
    decoded at `seconds_per_token`, through the stream loop (with the server's 20 ms between reads) and a chunker of
    `chunk_tokens` / `chunk_seconds`: (the clock time, the tokens) of each chunk the agent gets, and the events'
    times."""
    sizes = [1] + [event_tokens] * ((tokens - 1) // event_tokens)
    sizes += [tokens - sum(sizes)] if tokens > sum(sizes) else []
    raw, _ = _stream([("x" * n, [7] * n) for n in sizes], incremental=True)
    ends = _chunk_ends(raw, "sglang")
    pieces = [raw[a:b] for a, b in itertools.pairwise([0, *ends])]
    done = list(itertools.accumulate(sizes))
    times = [n * seconds_per_token for n in done] + [done[-1] * seconds_per_token]  # [DONE] with the last
    engine = _PacedEngine(pieces, times)
    chunks: list[tuple[float, int]] = []

    async def run() -> None:
        async for event in engine_events(engine, True, coalesce=0.02, event_tokens=event_tokens,
                                         chunker=Chunker(chunk_tokens, chunk_seconds, engine.clock)):
            if isinstance(event, Progress):
                assert event.cuts is not None
                ends = [tokens for _, tokens in event.cuts]
                chunks.extend((engine.now, b - a) for a, b in itertools.pairwise([0, *ends]))

    asyncio.run(run())
    return chunks, times[:-1]


@pytest.mark.parametrize(("tokens_per_second", "event_tokens"), [(2000, 32), (2000, 4), (5000, 32), (320, 32)])
def test_at_a_real_engines_pace_the_chunks_go_by_time(tokens_per_second: int, event_tokens: int) -> None:
    """The server's defaults (engine/pacing.py) at a GPU's pace: the first text as soon as the first event brings it,
    then a chunk per CHUNK_SECONDS -- not per CHUNK_TOKENS, which a GPU does not decode within that time -- each
    chunk at most CHUNK_SECONDS plus one event after the one before, and the rest with the last event."""
    chunks, times = _paced_chunks(4096, event_tokens, 1 / tokens_per_second, pacing.CHUNK_TOKENS,
                                  pacing.CHUNK_SECONDS)
    assert sum(n for _, n in chunks) == 4096 - (4095 % event_tokens or event_tokens)  # the last event's: the Final
    assert chunks[0] == (times[0], 1)  # the first token's event, at once
    event_time = event_tokens / tokens_per_second
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(chunks)]
    assert max(gaps) <= pacing.CHUNK_SECONDS + event_time + 1e-9
    # by time: every chunk but the last (cut short by the final event) comes CHUNK_SECONDS after the one before,
    # or with the first event after that
    assert all(gap >= pacing.CHUNK_SECONDS - 1e-9 for gap in gaps[:-1])
    assert all(n < pacing.CHUNK_TOKENS for _, n in chunks)
    assert len(chunks) <= 2 + times[-1] / pacing.CHUNK_SECONDS


def test_a_slow_decoder_gets_a_chunk_per_event() -> None:
    """At 50 tokens/s an event of 32 tokens comes every 640 ms, more than CHUNK_SECONDS: each goes out as it comes."""
    chunks, times = _paced_chunks(320, 32, 1 / 50, pacing.CHUNK_TOKENS, pacing.CHUNK_SECONDS)
    assert [t for t, _ in chunks] == times[:-1] and [n for _, n in chunks] == [1] + [32] * 9


def test_what_arrives_faster_than_the_cap_goes_in_chunks_of_the_cap() -> None:
    """An engine faster than the cap per CHUNK_SECONDS (here everything at once): chunks of the cap, cut where an
    event ends (the first: 225 tokens, the token of the first event and 7 of 32), all in one hand-on."""
    chunks, _ = _paced_chunks(4096, 32, 0.0, 256, pacing.CHUNK_SECONDS)
    assert chunks == [(0.0, 225)] + [(0.0, 256)] * 15
