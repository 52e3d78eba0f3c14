"""engine/sse.py: an engine stream read in any split into reads gives the same text and the same final body as the
stream read whole, in both of SGLang's streaming modes; SGLang's own framing and odd framings alike; errors and
truncated streams are reported. engine/pacing.py: the stream interval asked of the engine."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from session_server.engine import pacing, sse
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
            logprobs += event.logprobs or []
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
    assert [e[1] for e in logprobs] == whole["output_ids"][: len(logprobs)]
    assert wanted or not logprobs


_TEXTS = st.lists(st.sampled_from(['"output_token_logprobs":[', '],"output_token_logprobs_length":', "]]", '"', "\\",
                                   "[", "]", ",", "null", "a", "é", '"},"meta_info":{', '"output_ids":[',
                                   '],"meta_info":{']), max_size=8).map("".join)
_SGLANG_ORDER = ("text", "output_ids", "extra", "meta_info")
_SGLANG_META_ORDER = ("finish_reason", "completion_tokens", "output_token_logprobs", "output_token_logprobs_length",
                      "extra")
# members SGLang does not write: a list with a string, the error, a list that holds an `output_ids` member
_EXTRA = st.sampled_from([None, ("x", ["s"]), ("error", [5]), ("x", [{"output_ids": [7]}]), ("x", [1, 2])])
_META_EXTRA = st.sampled_from([None, ("y", ["s"]), ("y", [{"output_token_logprobs": [[1]]}]), ("y", [1])])


@settings(max_examples=examples(400), deadline=None)
@given(text=_TEXTS, ids=st.lists(st.integers(0, 99), max_size=5), final=st.booleans(), spaced=st.booleans(),
       entry_text=st.none() | _TEXTS, tops=st.booleans(), extra=_EXTRA, meta_extra=_META_EXTRA,
       order=st.just(_SGLANG_ORDER) | st.permutations(_SGLANG_ORDER),
       meta_order=st.just(_SGLANG_META_ORDER) | st.permutations(_SGLANG_META_ORDER))
@example(text="a", ids=[1], final=False, spaced=False, entry_text=None, tops=False, extra=("x", [{"output_ids": [7]}]),
         meta_extra=None, order=("text", "extra", "meta_info", "output_ids"), meta_order=_SGLANG_META_ORDER)
@example(text="a", ids=[1], final=False, spaced=False, entry_text=None, tops=False, extra=("error", [5]),
         meta_extra=None, order=_SGLANG_ORDER, meta_order=_SGLANG_META_ORDER)
@example(text="a", ids=[1], final=True, spaced=False, entry_text=None, tops=False, extra=None,
         meta_extra=None, order=_SGLANG_ORDER, meta_order=("output_token_logprobs", "finish_reason", "extra",
                                                           "completion_tokens", "output_token_logprobs_length"))
def test_a_cumulative_event_decodes_the_same_without_its_bulk(
        text: str, ids: list[int], final: bool, spaced: bool, entry_text: str | None, tops: bool,
        extra: tuple[str, Any] | None, meta_extra: tuple[str, Any] | None, order: tuple[str, ...],
        meta_order: tuple[str, ...]) -> None:
    """An event's logprob list (without logprobs wanted) and its output ids (once the stream's shape is known) are
    cut out before the decode (sse._lean_event): every field the stream reads comes out as from the whole event,
    whatever the text holds (the keys' spellings, quotes, brackets), with text in the entries, deeper lists after
    the list, members SGLang does not write between or around them, any member order, or another spacing. Without
    the quote checks or the fallback to the whole event's decode, a member between a key and the end searched for
    is lost with the cut (the error, the finish reason) or the rest does not decode."""
    meta = _meta(ids, len(ids), final)
    meta["output_token_logprobs"] = [[-0.5, i, entry_text] for i in ids]
    meta["extra"] = None
    if tops:
        meta["output_top_logprobs"] = [[[-0.5, i, None], [-1.5, i + 1, None]] for i in ids]
    meta = {key: meta[key] for key in (*meta_order, *meta) if key in meta}  # the order asked, the rest after
    del meta["extra"]
    if meta_extra is not None:
        meta = {(meta_extra[0] if k == "extra" else k): v for k, v in {**meta, "extra": meta_extra[1]}.items()}
    members: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
    event = {}
    for key in order:
        if key != "extra":
            event[key] = members[key]
        elif extra is not None:
            event[extra[0]] = extra[1]
    payload = json.dumps(event, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=False).encode()
    whole = sse._decode_cumulative(payload)
    for wanted, known in itertools.product((False, True), (False, True)):
        reader = sse._Reader(False, wanted)
        reader.shape_known = known
        got = reader._cumulative_event(payload)
        assert (bytes(got.text), got.error) == (bytes(whole.text), whole.error)
        assert bytes(got.output_ids) == bytes(whole.output_ids) or (known and not got.output_ids)
        assert got.meta_info is not None and whole.meta_info is not None
        assert (got.meta_info.finish_reason, got.meta_info.completion_tokens) == (
            whole.meta_info.finish_reason, whole.meta_info.completion_tokens)
        if wanted:
            assert bytes(got.meta_info.output_token_logprobs) == bytes(whole.meta_info.output_token_logprobs)


def test_the_bulk_of_sglangs_event_is_cut_out() -> None:
    payload = (b'{"text":"a","output_ids":[5,6],"meta_info":{"id":"r","finish_reason":null,'
               b'"output_token_logprobs":[[-0.5,5,null],[-1.25e-05,6,null]],"output_token_logprobs_length":2,'
               b'"completion_tokens":2}}')
    assert sse._lean_event(payload, ids=False, logprobs=True) == (
        b'{"text":"a","output_ids":[5,6],"meta_info":{"id":"r","finish_reason":null,'
        b'"output_token_logprobs":[],"output_token_logprobs_length":2,"completion_tokens":2}}')
    assert sse._lean_event(payload, ids=True, logprobs=True) == (
        b'{"text":"a","meta_info":{"id":"r","finish_reason":null,'
        b'"output_token_logprobs":[],"output_token_logprobs_length":2,"completion_tokens":2}}')
    assert sse._lean_event(payload, ids=True, logprobs=False) == payload.replace(b'"output_ids":[5,6],', b"")
    assert sse._lean_event(payload, ids=False, logprobs=False) is payload
    quoted = payload.replace(b"5,null]", b'5,"x"]')  # text in the entries: the logprobs are not cut
    assert sse._lean_event(quoted, ids=False, logprobs=True) is quoted
    other = payload.replace(b',"output_token_logprobs_length":2', b"")  # not SGLang's layout: nothing is cut
    assert sse._lean_event(other, ids=False, logprobs=True) is other
    between = payload.replace(b'[5,6],"meta_info"', b'[5,6],"x":[1],"meta_info"')  # a member between: kept
    assert sse._lean_event(between, ids=True, logprobs=False) is between


def test_a_cumulative_stream_stops_reading_ids_once_its_shape_is_known() -> None:
    """Two events with different token counts that held all their ids: the shape is known, and a later event is
    read without its ids; a delta engine's second event is refused before that."""
    raw, _ = _stream([("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])], incremental=False)
    reader = sse._Reader(False, False)
    events = raw.split(b"\n\n")[:3]
    for n, event in enumerate(events):
        reader.block(event + b"\n\n", len(event))
        assert reader.shape_known == (n >= 1)
    deltas, _ = _stream([("a", [1]), ("b", [2]), ("c", [3])], incremental=True)
    with pytest.raises(UpstreamError, match="--engine-incremental-streaming"):
        asyncio.run(_read(deltas, list(range(0, len(deltas), 7)), incremental=False))


def test_delta_events_one_per_piece_are_read_without_a_search() -> None:
    """SGLang's delta events, one HTTP chunk each, are decoded as they came (sse._Reader.pieces); pieces that are not
    one event each (a proxy's chunks, `[DONE]`, cumulative events) are left to the bytes path."""
    raw, whole = _stream([("a", [1]), ("b", [2]), ("c", [3])], incremental=True)
    ends = _chunk_ends(raw, "sglang")
    chunks = [raw[a:b] for a, b in itertools.pairwise([0, *ends])]
    assert chunks[-1] == b"data: [DONE]\n\n"
    reader = sse._Reader(True, True)
    _, final = reader.pieces(chunks[:-1]) or (None, None)
    progress = reader.take(64, True)  # what the intermediate events add is held for engine_events to hand on
    assert progress is not None and progress.text == "ab" and final is not None
    assert json.loads(final.raw)["output_ids"] == whole["output_ids"]
    two = [chunks[0] + chunks[1], chunks[2]]
    halves = [chunks[0][:9], chunks[0][9:]]
    for pieces, incremental in ((chunks, True), (two, True), (halves, True), (chunks[:-1], False)):
        assert sse._Reader(incremental, True).pieces(pieces) is None


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


@given(lists=st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=5),
       last=st.lists(st.integers(0, 9), max_size=2))
def test_spliced_lists_are_the_concatenation(lists: list[list[int]], last: list[int]) -> None:
    """The summed per-token lists of a delta stream: the events' raw lists (empty ones too) and the final event's."""
    raws = [msgspec.Raw(json.dumps(x, separators=(",", ":")).encode()) for x in lists]
    assert json.loads(bytes(sse._spliced(raws, last))) == [i for x in lists for i in x] + last


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

    monkeypatch.setattr(sse._Reader, "block", refused)
    for cuts in ([], [len(raw) - 3], [30, 200, len(raw) - 20]):
        text, _, final = asyncio.run(_read(raw, cuts, True, piece_ends=_chunk_ends(raw, "sglang")))
        assert final is not None and final["output_ids"] == whole["output_ids"] and text == "abc"


def test_an_event_that_is_not_json_is_a_502() -> None:
    raw = b'data: {"text":"a",\n\ndata: [DONE]\n\n'
    for incremental in (False, True):
        with pytest.raises(UpstreamError, match="not valid JSON"):
            asyncio.run(_read(raw, [], incremental))


def test_a_delta_piece_that_is_not_a_list_makes_the_final_body_invalid() -> None:
    raw = b'data: {"text":"a","output_ids":5,"meta_info":{"finish_reason":null}}\n\n' \
          b'data: {"text":"b","output_ids":[2],"meta_info":{"finish_reason":{"type":"stop"}}}\n\n'
    _, _, final = asyncio.run(_read(raw, [], True))
    assert final["output_ids"] == [{}, 2]  # refused by the strict decode, never silently one id short


def test_stream_interval_by_mode_and_reply_size() -> None:
    assert pacing.stream_interval(3, True, 100, None) == 3  # the flag wins in both modes
    assert pacing.stream_interval(1, False, 32_768, None) == 1
    assert pacing.stream_interval(0, True, 32_768, None) == pacing.DELTA_INTERVAL
    events = pacing.CUMULATIVE_EVENTS
    assert pacing.stream_interval(0, False, 32_768, None) == -(-32_768 // events)
    assert pacing.stream_interval(0, False, None, 65_536) == -(-65_536 // events)  # no max_tokens: the context
    assert pacing.stream_interval(0, False, None, None) == -(-pacing.UNKNOWN_REPLY_TOKENS // events)
    assert pacing.stream_interval(0, False, 10, None) == pacing.CHUNK_TOKENS  # never finer than the agent's chunks
    assert pacing.DELTA_INTERVAL <= pacing.CHUNK_TOKENS  # a delta engine's events are finer than the chunks


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
    async for event in engine_events(reads(), True, logprobs=logprobs, chunk_tokens=chunk_tokens,
                                     chunk_seconds=1e9):
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
        entries += progress.logprobs or []
    every = [chunk for batch in chunks for chunk in batch]
    intermediate = pieces[:-1]  # the final event's own piece comes with the Final
    assert "".join(text for text, _ in every) == "".join(text for text, _ in intermediate)  # in order, all of it
    wordy = all(text for text, _ in intermediate)  # else a chunk of no text and no logprobs is not sent at all
    if wordy or logprobs:
        assert sum(tokens for _, tokens in every) == sum(len(ids) for _, ids in intermediate)
    if logprobs:
        assert [e[1] for e in entries] == [i for _, ids in intermediate for i in ids]
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
        async for event in engine_events(reads(), True, chunk_tokens=64, chunk_seconds=0.05):
            if isinstance(event, Progress):
                got.append(event.text)
                seen[len(got) - 1].set()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert got == ["a", "b"]


@given(lists=st.lists(st.one_of(
    st.lists(st.integers(0, 99), min_size=1, max_size=3),
    st.lists(st.tuples(st.floats(-9, 0), st.integers(0, 99), st.none() | st.sampled_from(["]],[[", "x"])).map(list),
             max_size=3),
    st.lists(st.lists(st.tuples(st.floats(-9, 0), st.integers(0, 99), st.none()).map(list), max_size=2),
             max_size=2)), max_size=6))
def test_spliced_lists_of_any_depth_are_the_concatenation(lists: list[list[Any]]) -> None:
    """The byte-level flattening (_flattened) and the piece-by-piece one agree with the concatenation, whatever
    depth the pieces have, empty ones and strings holding brackets included."""
    raws = [msgspec.Raw(json.dumps(x, separators=(",", ":")).encode()) for x in lists]
    assert json.loads(bytes(sse._spliced(raws, []))) == [i for x in lists for i in x]
