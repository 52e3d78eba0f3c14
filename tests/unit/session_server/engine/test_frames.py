"""engine/frames.py: an engine stream's bytes into whole events, however they were cut into reads and pieces: the same
events, in order, up to `[DONE]`, in SGLang's framing and in every other the SSE format allows."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.engine.frames import Frames
from support.examples import examples

_EVENTS = st.lists(st.dictionaries(st.sampled_from(["text", "x"]), st.text(alphabet='ab \n\r"\\é{}:', max_size=5),
                                   max_size=2), min_size=1, max_size=5)
_FRAMINGS = ["sglang", "crlf", "cr", "comments", "lines"]


def _body(events: list[dict[str, str]], framing: str, done: bool) -> bytes:
    """The events as an engine writes them in `framing`: SGLang's (`data: <json>\\n\\n`), CR LF or CR line ends,
    comment lines between events, or an event's data over several `data:` lines (JSON allows the line break)."""
    out = []
    for event in events:
        payload = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        if framing == "lines":
            out.append("data: " + payload.replace(",", ",\ndata: ") + "\n\n")
        elif framing == "comments":
            out.append(f": keep-alive\ndata: {payload}\n\n")
        else:
            out.append(f"data: {payload}\n\n")
    if done:
        out.append("data: [DONE]\n\n")
    text = "".join(out)
    return text.replace("\n", {"crlf": "\r\n", "cr": "\r"}.get(framing, "\n")).encode()


def _read(raw: bytes, reads: list[list[int]]) -> tuple[list[dict[str, str]], bool]:
    """`raw` fed as reads, each a list of piece ends (offsets into raw), then closed."""
    frames = Frames()
    out = []
    at = 0
    for ends in reads:
        pieces = []
        for end in ends:
            pieces.append(raw[at:end])
            at = end
        out += [json.loads(bytes(p)) for p in frames.feed([p for p in pieces if p])]
    out += [json.loads(bytes(p)) for p in frames.feed([raw[at:]])]
    out += [json.loads(bytes(p)) for p in frames.close()]
    return out, frames.done


def test_every_single_cut_reads_the_same_events() -> None:
    """Every byte boundary of a stream in every framing, as the end of one read (one piece each) and as the end of
    a piece inside one read."""
    events = [{"text": "a\nb"}, {"text": "é\r"}, {"x": "{}"}]
    for framing in _FRAMINGS:
        raw = _body(events, framing, done=True)
        for cut in range(len(raw) + 1):
            for reads in ([[cut]], [[cut, len(raw)]]):
                assert _read(raw, reads) == (events, True), (framing, cut)


@settings(max_examples=examples(300), deadline=None)
@given(events=_EVENTS, framing=st.sampled_from(_FRAMINGS), done=st.booleans(),
       cuts=st.lists(st.lists(st.integers(0, 2000), max_size=4), max_size=6))
def test_any_split_reads_the_same_events(events: list[dict[str, str]], framing: str, done: bool,
                                         cuts: list[list[int]]) -> None:
    """However the body is cut into reads and each read into pieces, the same events come out, in order; `[DONE]`
    ends the stream, and without it the body's end does."""
    raw = _body(events, framing, done) + (b"data: {\"after\": 1}\n\n" if done else b"")
    edges = sorted({c % (len(raw) + 1) for read in cuts for c in read})
    it = iter(edges)
    reads = [sorted(itertools.islice(it, len(read))) for read in cuts]
    assert _read(raw, reads) == (events, done)


def test_a_piece_cut_one_byte_past_a_line_break_is_not_taken_for_a_whole_event() -> None:
    """A piece that ends in a line break and the next line's first byte (a proxy re-chunking the stream) looks like
    SGLang's one event per piece by its first line break; it is half an event (found by the property above)."""
    events = [{"x": ":"}, {"text": "a", "x": "b"}]
    raw = _body(events, "lines", done=True)
    first = raw.index(b"\n\n") + 2
    cut = raw.index(b",\ndata: ") + 3  # just past the line break inside the second event
    assert _read(raw, [[first, cut]]) == (events, True)


def test_sglangs_pieces_are_read_as_views_without_a_search() -> None:
    """One piece per event, as SGLang writes its HTTP chunks: each payload is a view of its piece (no copy of a
    cumulative event's megabytes), and `[DONE]` ends the stream."""
    raw = _body([{"text": "a"}, {"text": "b"}], "sglang", done=True)
    pieces = [p + b"\n\n" for p in raw.split(b"\n\n") if p]
    frames = Frames()
    payloads = frames.feed(pieces)
    assert all(isinstance(p, memoryview) for p in payloads) and frames.done
    assert [json.loads(bytes(p)) for p in payloads] == [{"text": "a"}, {"text": "b"}]
    assert frames.feed([b'data: {"text":"c"}\n\n']) == [] and frames.close() == []


def test_at_the_end_whole_lines_are_an_event_and_a_cut_line_is_not() -> None:
    frames = Frames()
    assert frames.feed([b'data: {"text":"a"}\n']) == []  # no blank line yet: the event may go on
    assert [bytes(p) for p in frames.close()] == [b'{"text":"a"}']
    cut = Frames()
    assert cut.feed([b'data: {"text":"a"}\n\ndata: {"te']) == [b'{"text":"a"}']
    assert cut.close() == [] and not cut.done
