"""engine/reader.py: an engine stream's events into what they add and the final body. Cumulative and delta events of
the same reply, read in any batches, give the same text and the same final body; a cumulative event's bulk is cut
out before its decode without changing what is read; logprob entries are validated once, by the final body's rules
(docs/design.md 5.3), and one that breaks a rule is a 502 that names it."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from session_server.engine import reader as rd
from session_server.engine.reader import Added, EngineError, Final, StreamReader
from support.examples import examples
from trajectory.errors import UpstreamError

VOCAB = 100


def _meta(ids: list[int], done: int, final: bool) -> dict[str, Any]:
    return {"id": "r", "finish_reason": {"type": "stop"} if final else None, "completion_tokens": done,
            "prompt_tokens": 3, "output_token_logprobs": [[-0.5 - i / 8, i, None] for i in ids],
            "output_token_logprobs_length": len(ids), "cached_tokens": 0}


def events(pieces: list[tuple[str, list[int]]], incremental: bool) -> tuple[list[bytes], dict[str, Any]]:
    """SGLang's event payloads for a reply made of `pieces` (text, ids), and the /generate body it amounts to."""
    out, text, ids = [], "", []
    for n, (piece, piece_ids) in enumerate(pieces):
        text, ids = text + piece, ids + piece_ids
        final = n == len(pieces) - 1
        event = ({"text": piece, "output_ids": piece_ids, "meta_info": _meta(piece_ids, len(ids), final)}
                 if incremental else {"text": text, "output_ids": ids, "meta_info": _meta(ids, len(ids), final)})
        out.append(json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode())
    return out, {"text": text, "output_ids": ids, "meta_info": _meta(ids, len(ids), True)}


def _read(payloads: list[bytes], batches: list[int], incremental: bool,
          logprobs: bool) -> tuple[str, list[int], list[float], dict[str, Any] | None]:
    """The events read in batches that end at `batches`: the text and tokens they added, and the final body."""
    reader = StreamReader(incremental, logprobs, VOCAB)
    bounds = [0, *sorted({b % (len(payloads) + 1) for b in batches}), len(payloads)]
    text, ids, values, final = "", [], [], None
    for a, b in itertools.pairwise(bounds):
        if b <= a or final is not None:
            continue
        added, last = reader.read(payloads[a:b])
        if added is not None:
            text += "".join(added.texts)
            if added.tokens is not None:
                ids += added.tokens.ids.tolist()
                values += added.tokens.logprobs.tolist()
        if last is not None:
            final = json.loads(last.raw)
    return text, ids, values, final


_PIECES = st.lists(st.tuples(st.text(alphabet='ab \n"\\é{}[],:', max_size=6),
                             st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)), min_size=1, max_size=10)


@settings(max_examples=examples(200), deadline=None)
@given(pieces=_PIECES, batches=st.lists(st.integers(0, 20), max_size=6), logprobs=st.booleans())
def test_cumulative_and_delta_events_give_the_same_reply(pieces: list[tuple[str, list[int]]], batches: list[int],
                                                        logprobs: bool) -> None:
    """The same reply as cumulative events and as deltas, each read in any batches: the same final body (text, ids,
    logprob entries), what was added before it a prefix of the reply, its tokens (when wanted) the reply's, in
    order, with their logprobs as float32."""
    finals = []
    for incremental in (False, True):
        payloads, whole = events(pieces, incremental)
        text, ids, values, final = _read(payloads, batches, incremental, logprobs)
        assert final is not None
        assert (final["text"], final["output_ids"]) == (whole["text"], whole["output_ids"])
        assert final["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
        assert whole["text"].startswith(text)
        assert ids == whole["output_ids"][: len(ids)] and (logprobs or not ids)
        entries = whole["meta_info"]["output_token_logprobs"]
        assert values == [float(np.float32(e[0])) for e in entries[: len(values)]]
        finals.append((final["text"], final["output_ids"]))
    assert finals[0] == finals[1]


# Entries that break one rule of docs/design.md 5.3 each, and the rule the 502 names.
_BROKEN = [
    ([[float("nan"), 1, None]], [1], "json"),  # SGLang's NaN constant: not JSON
    ([[-1e39, 1, None]], [1], "logprob_value"),  # no float32 holds it
    ([[-0.5, True, None]], [1], "token_id_type"),
    ([[-0.5, VOCAB, None]], [VOCAB], "token_range"),
    ([[-0.5, 2, None]], [1], "token_mismatch"),
    ([[-0.5, 1, None, 4]], [1], "logprob_entry"),
    ([[-0.5, 1, None], [-0.5, 2, None]], [1], "length_mismatch"),
    ([["-0.5", 1, None]], [1], "logprob_value"),
]


@pytest.mark.parametrize(("entries", "ids", "rule"), _BROKEN)
@pytest.mark.parametrize("incremental", [False, True])
def test_a_malformed_logprob_entry_is_a_502_that_names_its_rule(entries: list[Any], ids: list[int], rule: str,
                                                                incremental: bool) -> None:
    first = {"text": "a", "output_ids": [3], "meta_info": {**_meta([3], 1, False)}}
    meta = {**_meta(ids, 1 + len(ids), False), "output_token_logprobs": entries}
    second = {"text": "b" if incremental else "ab", "output_ids": ids if incremental else [3, *ids],
              "meta_info": meta if incremental else {**meta, "output_token_logprobs": [[-0.5, 3, None], *entries]}}
    payloads = [json.dumps(e).encode() for e in (first, second)]
    reader = StreamReader(incremental, True, VOCAB)
    added, _ = reader.read(payloads[:1])
    assert added is not None and added.tokens is not None and added.tokens.ids.tolist() == [3]
    with pytest.raises(UpstreamError, match="engine stream event") as caught:
        reader.read(payloads[1:])
    assert caught.value.rule == rule and caught.value.status == 502
    if rule != "json":  # without logprobs wanted, nothing reads them (the final body's strict decode judges them)
        assert StreamReader(incremental, False, VOCAB).read(payloads)[0] is not None


def test_top_logprob_rows_are_validated_and_go_on_with_their_tokens() -> None:
    meta = {**_meta([1, 2], 2, False), "output_top_logprobs": [[[-0.5, 1, None], [-1.0, 7, None]],
                                                               [[-0.25, 2, None]]]}
    payload = json.dumps({"text": "ab", "output_ids": [1, 2], "meta_info": meta}).encode()
    for incremental in (False, True):
        added, _ = StreamReader(incremental, True, VOCAB).read([payload])
        assert added is not None and added.tokens is not None
        assert added.tokens.top == [[(-0.5, 1), (-1.0, 7)], [(-0.25, 2)]]
        bad = payload.replace(b"7, null", b"%d, null" % VOCAB)
        with pytest.raises(UpstreamError) as caught:
            StreamReader(incremental, True, VOCAB).read([bad])
        assert caught.value.rule == "token_range"


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
    cut out before the decode (reader.lean_event): every field the stream reads comes out as from the whole event,
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
    whole = rd._decode_cumulative(payload)
    for wanted, known in itertools.product((False, True), (False, True)):
        reader = StreamReader(False, wanted)
        reader.shape_known = known
        got = reader._cumulative_event(payload)
        assert (bytes(got.text), got.error) == (bytes(whole.text), whole.error)
        assert bytes(got.output_ids) == bytes(whole.output_ids) or (known and not wanted and not got.output_ids)
        assert got.meta_info is not None and whole.meta_info is not None
        assert (got.meta_info.finish_reason, got.meta_info.completion_tokens) == (
            whole.meta_info.finish_reason, whole.meta_info.completion_tokens)
        if wanted:
            assert bytes(got.meta_info.output_token_logprobs) == bytes(whole.meta_info.output_token_logprobs)


def test_the_bulk_of_sglangs_event_is_cut_out() -> None:
    payload = (b'{"text":"a","output_ids":[5,6],"meta_info":{"id":"r","finish_reason":null,'
               b'"output_token_logprobs":[[-0.5,5,null],[-1.25e-05,6,null]],"output_token_logprobs_length":2,'
               b'"completion_tokens":2}}')
    assert rd.lean_event(payload, ids=False, logprobs=True) == (
        b'{"text":"a","output_ids":[5,6],"meta_info":{"id":"r","finish_reason":null,'
        b'"output_token_logprobs":[],"output_token_logprobs_length":2,"completion_tokens":2}}')
    assert rd.lean_event(payload, ids=True, logprobs=True) == (
        b'{"text":"a","meta_info":{"id":"r","finish_reason":null,'
        b'"output_token_logprobs":[],"output_token_logprobs_length":2,"completion_tokens":2}}')
    assert rd.lean_event(payload, ids=True, logprobs=False) == payload.replace(b'"output_ids":[5,6],', b"")
    assert rd.lean_event(payload, ids=False, logprobs=False) is payload
    quoted = payload.replace(b"5,null]", b'5,"x"]')  # text in the entries: the logprobs are not cut
    assert rd.lean_event(quoted, ids=False, logprobs=True) is quoted
    other = payload.replace(b',"output_token_logprobs_length":2', b"")  # not SGLang's layout: nothing is cut
    assert rd.lean_event(other, ids=False, logprobs=True) is other
    between = payload.replace(b'[5,6],"meta_info"', b'[5,6],"x":[1],"meta_info"')  # a member between: kept
    assert rd.lean_event(between, ids=True, logprobs=False) is between


def test_a_cumulative_stream_stops_reading_ids_once_its_shape_is_known() -> None:
    """Two events with different token counts that held all their ids: the shape is known, and a later event is
    read without its ids; a delta engine's second event is refused before that."""
    payloads, _ = events([("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])], incremental=False)
    reader = StreamReader(False, False)
    for n, payload in enumerate(payloads[:3]):
        reader.read([payload])
        assert reader.shape_known == (n >= 1)
    deltas, _ = events([("a", [1]), ("b", [2]), ("c", [3])], incremental=True)
    reader = StreamReader(False, False)
    reader.read(deltas[:1])
    with pytest.raises(UpstreamError, match="--engine-incremental-streaming"):
        reader.read(deltas[1:2])


def test_an_error_event_raises_with_its_bytes() -> None:
    payloads = [b'{"text":"a","output_ids":[1],"meta_info":{"finish_reason":null}}',
                b'{"error":{"message":"boom","code":400}}']
    for incremental in (False, True):
        with pytest.raises(EngineError) as caught:
            StreamReader(incremental).read(payloads)
        assert caught.value.error == {"message": "boom", "code": 400}


@pytest.mark.parametrize("payload", [b'{"text":"a",', b"[1]"])
def test_an_event_that_is_not_a_json_object_is_a_502(payload: bytes) -> None:
    for incremental in (False, True):
        with pytest.raises(UpstreamError, match=r"not valid JSON|not an object"):
            StreamReader(incremental).read([payload])


def test_a_delta_piece_that_is_not_a_list_makes_the_final_body_invalid() -> None:
    payloads = [b'{"text":"a","output_ids":5,"meta_info":{"finish_reason":null}}',
                b'{"text":"b","output_ids":[2],"meta_info":{"finish_reason":{"type":"stop"}}}']
    added, final = StreamReader(True).read(payloads)
    assert isinstance(added, Added) and added.texts == ["a"] and isinstance(final, Final)
    assert json.loads(final.raw)["output_ids"] == [{}, 2]  # refused by the strict decode, never one id short


@given(lists=st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=5),
       last=st.lists(st.integers(0, 9), max_size=2))
def test_spliced_lists_are_the_concatenation(lists: list[list[int]], last: list[int]) -> None:
    """The summed per-token lists of a delta stream: the events' raw lists (empty ones too) and the final event's."""
    raws = [msgspec.Raw(json.dumps(x, separators=(",", ":")).encode()) for x in lists]
    assert json.loads(bytes(rd._spliced(raws, last))) == [i for x in lists for i in x] + last


@given(lists=st.lists(st.one_of(
    st.lists(st.integers(0, 99), min_size=1, max_size=3),
    st.lists(st.tuples(st.floats(-9, 0), st.integers(0, 99), st.none() | st.sampled_from(["]],[[", "x"])).map(list),
             max_size=3),
    st.lists(st.lists(st.tuples(st.floats(-9, 0), st.integers(0, 99), st.none()).map(list), max_size=2),
             max_size=2)), max_size=6))
# Mixed depths whose joins add up to n-1 all the same: the deeper lists' own joins made up for the shallow one's.
@example(lists=[[[0.0, 0, None]], [0], [[[0.0, 0, None]], [[0.0, 0, None]]], [[[0.0, 0, None]], [[0.0, 0, None]]]])
def test_spliced_lists_of_any_depth_are_the_concatenation(lists: list[list[Any]]) -> None:
    """The byte-level flattening (_flattened) and the piece-by-piece one agree with the concatenation, whatever
    depth the pieces have, empty ones and strings holding brackets included."""
    raws = [msgspec.Raw(json.dumps(x, separators=(",", ":")).encode()) for x in lists]
    assert json.loads(bytes(rd._spliced(raws, []))) == [i for x in lists for i in x]
