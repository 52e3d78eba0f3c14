"""What an engine stream's events mean: each batch of whole events (engine/frames.py) into what it adds -- the new
text, the reply's tokens at each event's end, the new tokens' logprob entries, validated -- and, at the end, the
complete /generate body of the final event.

SGLang (0.5.23, default `incremental_streaming_output` off) sends cumulative events -- each carries the whole `text`,
`output_ids` and `meta_info` so far -- and a last one with `finish_reason` set, which is a complete `/generate`
response. With the engine's `--incremental-streaming-output` the events are deltas (text, output_ids and the
per-output-token meta lists); `--engine-incremental-streaming` tells the server. A cumulative engine meeting a server
that expects deltas (or the reverse) would commit garbage, so the counts are cross-checked and a mismatch names the
flag.

Why batches: everything that arrived in one read is handled at once, decoded by msgspec in one call, with a Python
step per event only inside list comprehensions (at one event per token a Python step per event is most of what a
stream costs). Nothing is re-read: a delta event adds its pieces; of a batch of cumulative events only the last one
is decoded at all (its big fields cut out before the decode where nothing reads them), and the new text is its tail.
The final event goes on as the raw bytes of a complete body for the strict decoder (for delta engines: the summed
body, its per-event lists spliced by one encode and byte replaces, encoded once).

Logprob entries, when the agent wants them, are validated here, once, by the same rules and the same decoder as the
final body (docs/design.md 5.3, trajectory/engine_output.py): an entry that breaks one is a 502 that names the rule,
and what goes on are arrays the front end formats as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from session_server.engine.frames import Payload
from trajectory.engine_output import decode_generate_response
from trajectory.errors import UpstreamError

_encoder = msgspec.json.Encoder()
_MASK_META = ("output_token_sampling_mask", "output_token_sampling_logprobs")  # with sampling masks (rows per token)
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", *_MASK_META)
_TOKEN_LOGPROBS = b'"output_token_logprobs":['  # SGLang's key and the list's opening, as orjson writes them
_AFTER_TOKEN_LOGPROBS = b'],"output_token_logprobs_length":'  # the list's closing `]` and the key SGLang puts next
_IDS_KEY = b'"output_ids":['  # SGLang's key of a cumulative event's ids and the list's opening
_AFTER_IDS = b'],"meta_info":{'  # the ids list's closing `]` and the member SGLang puts next

_ABSENT = msgspec.Raw()  # a field the event does not have (msgspec's Raw cannot be in a union with None)
# The structs below are decoded once per engine event (a thousand per long delta stream) and never hold a reference
# cycle: gc=False keeps them out of the cyclic collector's generations.


class _Meta(msgspec.Struct, gc=False):
    finish_reason: Any = None
    completion_tokens: Any = None
    output_token_logprobs: msgspec.Raw = _ABSENT
    output_top_logprobs: msgspec.Raw = _ABSENT
    output_token_sampling_mask: msgspec.Raw = _ABSENT
    output_token_sampling_logprobs: msgspec.Raw = _ABSENT


class _Event(msgspec.Struct, gc=False):
    """A cumulative event, its large parts left as raw JSON (only the last of a batch is decoded at all)."""

    text: msgspec.Raw = _ABSENT
    output_ids: msgspec.Raw = _ABSENT
    meta_info: _Meta | None = None
    error: Any = None


class _Delta(msgspec.Struct, gc=False):
    """A delta event: its text decoded (it is streamed), its ids and per-token lists kept raw for the final body."""

    text: str = ""
    output_ids: msgspec.Raw = _ABSENT
    meta_info: _Meta | None = None
    error: Any = None


_decode_cumulative = msgspec.json.Decoder(_Event).decode
_decode_deltas = msgspec.json.Decoder(list[_Delta]).decode
_decode_str = msgspec.json.Decoder(str).decode
_decode_ids = msgspec.json.Decoder(list[Any]).decode


@dataclass(slots=True)
class Tokens:
    """New tokens of a stream, validated (docs/design.md 5.3): ids (int32), their logprobs (float32) and, when the
    engine sent them, their top alternatives."""

    ids: np.ndarray
    logprobs: np.ndarray
    top: list[list[tuple[float, int]]] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def part(self, start: int, end: int) -> Tokens:
        return Tokens(self.ids[start:end], self.logprobs[start:end],
                      self.top[start:end] if self.top is not None else None)


@dataclass(slots=True)
class Added:
    """What a batch of intermediate events adds: their texts, the reply's tokens at each one's end (delta events;
    None for a cumulative batch, one piece of unknown tokens) and the new tokens when logprobs are wanted."""

    texts: list[str]
    counts: list[int] | None
    tokens: Tokens | None = None


@dataclass(slots=True)
class Final:
    """The last event: the raw bytes of a complete /generate body."""

    raw: bytes


class EngineError(Exception):
    """The engine sent an `{"error": ...}` event: its raw bytes and the error object."""

    def __init__(self, raw: bytes, error: Any) -> None:
        super().__init__("engine stream error")
        self.raw = raw
        self.error = error


class StreamReader:
    """One stream's events, batch by batch (`read`): what was seen (cumulative) or the summed pieces of the body
    (deltas). `vocab_size` bounds the token ids of the logprob entries; `logprobs`: the entries are wanted."""

    def __init__(self, incremental: bool, logprobs: bool = False, vocab_size: int = 2**31) -> None:
        self.incremental = incremental
        self.logprobs = logprobs
        self.vocab_size = vocab_size
        self.text_seen = 0  # cumulative: characters of text already reported
        self.tokens_seen = 0  # cumulative: logprob entries already reported
        # cumulative: two events with different token counts held all their output ids (a delta engine's second
        # event holds fewer); from then on the ids are not read (unless logprobs are, which are checked against them)
        self.shape_known = False
        self._first_count: int | None = None
        self.texts: list[str] = []  # deltas: every event's text, and its raw ids and per-token lists
        self.raws: dict[str, list[msgspec.Raw]] = {"output_ids": [], **{k: [] for k in _PER_TOKEN_META}}
        self.tokens = 0  # deltas: the reply's tokens in the events read so far
        self.event_tokens = 1  # deltas: the most tokens an event has brought (how far apart events are)

    def read(self, payloads: Sequence[Payload]) -> tuple[Added | None, Final | None]:
        """What a batch of whole events adds, up to an error or final event, and the final event if it holds it.
        An `{"error": ...}` event raises EngineError; an event that is not a JSON object, or a logprob entry that
        breaks a rule, raises UpstreamError (502)."""
        if not payloads:
            return None, None
        if not self.incremental:
            return self._cumulative(payloads)
        try:
            decoded: Sequence[_Event | _Delta] = _decode_deltas(_array(payloads))
        except msgspec.DecodeError:
            decoded = [_one(p) for p in payloads]  # find the culprit, with the rule it breaks
        return self._judge(decoded, lambda: payloads)

    def _cumulative(self, payloads: Sequence[Payload]) -> tuple[Added | None, Final | None]:
        """A cumulative event holds everything of the ones before it: only the last of a batch is read, and the one
        before it when the last ends the stream (what that adds goes out before the end, as in any other batch)."""
        last = bytes(payloads[-1])
        events = [self._cumulative_event(last)]
        kept = [last]
        if _stops(events[0]) and len(payloads) > 1:
            previous = bytes(payloads[-2])
            events.insert(0, self._cumulative_event(previous))
            kept.insert(0, previous)
        return self._judge(events, lambda: kept)

    def _cumulative_event(self, payload: bytes) -> _Event:
        """One cumulative event decoded. Its bulk is cut out first where SGLang's layout shows where it ends
        (lean_event): the per-token logprob list (~40 bytes per token of the reply so far, most of the event) when
        logprobs are not wanted, and the output ids once the stream's shape is known. Nothing reads them there (the
        final body goes on raw, to the strict decode), and the rest decodes the same."""
        lean = lean_event(payload, ids=self.shape_known and not self.logprobs, logprobs=not self.logprobs)
        if lean is not payload:
            try:
                return _decode_cumulative(lean)
            except msgspec.DecodeError:
                pass  # the whole event decides
        try:
            return _decode_cumulative(payload)
        except msgspec.DecodeError:
            return _one(payload)

    def _judge(self, events: Sequence[_Event | _Delta],
               payloads: Callable[[], Sequence[Payload]]) -> tuple[Added | None, Final | None]:
        """What the events add, up to an error or final event (whose raw payload is then looked up)."""
        # one comprehension, not a call per event (an error or final event is the last but in a broken stream)
        stops = [e.error is not None or (e.meta_info is not None and e.meta_info.finish_reason is not None)
                 for e in events]
        stop = stops.index(True) if True in stops else len(events)
        added = None
        if stop:
            if self.incremental:
                added = self._deltas([e for e in events[:stop] if isinstance(e, _Delta)])
            elif isinstance(last := events[stop - 1], _Event):
                added = self._cumulative_added(last)
        if stop == len(events):
            return added, None
        raw = bytes(payloads()[stop])
        if events[stop].error is not None:
            raise EngineError(raw, msgspec.json.decode(raw).get("error"))
        return added, Final(self._final(raw))

    def _deltas(self, deltas: list[_Delta]) -> Added | None:
        """Delta events' pieces kept for the final body, and their texts and token counts for the agent. Python
        steps per event are list comprehensions only: at one event per token they are most of the cost."""
        if not deltas:
            return None
        texts = [e.text for e in deltas]
        self.texts += texts
        ids = [e.output_ids for e in deltas if e.output_ids]
        self.raws["output_ids"] += ids
        metas = [e.meta_info for e in deltas if e.meta_info is not None]
        entries = [m.output_token_logprobs for m in metas if m.output_token_logprobs]
        tops = [m.output_top_logprobs for m in metas if m.output_top_logprobs]
        self.raws["output_token_logprobs"] += entries
        self.raws["output_top_logprobs"] += tops
        for key in _MASK_META:
            self.raws[key] += [raw for m in metas if (raw := getattr(m, key))]
        # The reply's tokens at each event's end: SGLang's meta_info.completion_tokens counts the whole reply in
        # both modes. Only where the chunks are cut depends on it (an engine without it: one token per event).
        counts: list[Any] = [e.meta_info.completion_tokens if e.meta_info is not None else None for e in deltas]
        try:
            if counts != sorted(counts) or counts[0] < self.tokens:
                raise TypeError
        except TypeError:  # missing, not numbers, or not growing
            counts = list(range(self.tokens + 1, self.tokens + 1 + len(deltas)))
        self.event_tokens = max(self.event_tokens, counts[-1] - (counts[-2] if len(counts) > 1 else self.tokens))
        self.tokens = counts[-1]
        tokens = None
        if self.logprobs and entries:
            tokens = self._validated(_spliced(ids, []), _spliced(entries, []), _spliced(tops, []) if tops else None)
        return Added(texts, counts, tokens)

    def _cumulative_added(self, event: _Event) -> Added | None:
        """The last cumulative event of a batch: its tail beyond what was seen; the counts checked."""
        meta = event.meta_info
        if event.output_ids and meta is not None:
            count = meta.completion_tokens
            raw = bytes(event.output_ids).strip()
            held = 0 if raw.replace(b" ", b"") == b"[]" else raw.count(b",") + 1  # ids hold no commas
            if raw.startswith(b"[") and isinstance(count, int) and not isinstance(count, bool):
                if count != held:
                    raise UpstreamError(
                        f"engine stream event holds {held} of {count} output ids: the engine streams deltas "
                        "(SGLang --incremental-streaming-output); start the session server with "
                        "--engine-incremental-streaming", rule="stream_shape")
                if self._first_count is None:
                    self._first_count = count
                elif count != self._first_count:
                    self.shape_known = True
        try:
            text = _decode_str(event.text).rstrip("\ufffd") if event.text else ""
        except msgspec.DecodeError:
            return None
        fresh = text[self.text_seen:]
        self.text_seen = max(self.text_seen, len(text))
        tokens = None
        if self.logprobs and meta is not None and meta.output_token_logprobs and event.output_ids:
            everything = self._validated(event.output_ids, meta.output_token_logprobs, meta.output_top_logprobs or None)
            if len(everything) > self.tokens_seen:
                tokens = everything.part(self.tokens_seen, len(everything))
                self.tokens_seen = len(everything)
        if not fresh and tokens is None:
            return None
        return Added([fresh], None, tokens)

    def _validated(self, ids: msgspec.Raw, entries: msgspec.Raw, tops: msgspec.Raw | None) -> Tokens:
        """The tokens of raw `output_ids` and logprob lists, held to the rules of the final body (docs/design.md
        5.3) by its own decoder: a body of just them, decoded strictly."""
        try:
            n = len(_decode_ids(ids))
        except msgspec.DecodeError:
            raise UpstreamError("engine stream event's output_ids is not a JSON list", rule="output_ids") from None
        body = b"".join([b'{"text":"","output_ids":', ids, b',"meta_info":{"finish_reason":{"type":"length","length":',
                         b"%d" % n, b'},"prompt_tokens":0,"completion_tokens":%d' % n,
                         b',"output_token_logprobs":', entries,
                         *((b',"output_top_logprobs":', tops) if tops is not None else ()), b"}}"])
        try:
            result = decode_generate_response(body, self.vocab_size)
        except UpstreamError as exc:
            raise UpstreamError(f"engine stream event: {exc}", rule=exc.rule) from None
        return Tokens(result.output_ids, result.logprobs, result.top_logprobs)

    def _final(self, payload: bytes) -> bytes:
        """The complete body: the final event itself, or (deltas) the final event with everything summed in -- the
        summed lists spliced from the events' raw JSON, encoded once."""
        if not self.incremental:
            return payload
        event = msgspec.json.decode(payload)
        meta = event.get("meta_info")
        ids = event.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            return payload  # malformed: the strict decode reports it
        summed = {**meta}
        for key in _PER_TOKEN_META:
            if isinstance(meta.get(key), list):
                summed[key] = _spliced(self.raws[key], meta[key])
        return _encoder.encode({**event, "text": "".join(self.texts) + (event.get("text") or ""),
                                "output_ids": _spliced(self.raws["output_ids"], ids), "meta_info": summed})


def _stops(event: _Event | _Delta) -> bool:
    """An error event, or the final one (finish_reason set): nothing after it is read."""
    return event.error is not None or (event.meta_info is not None and event.meta_info.finish_reason is not None)


def _one(payload: Payload) -> _Event:
    """An event the typed decode refused, judged alone: not JSON or not an object is a 502; anything else odd is
    skipped (nothing is taken from it; the final body's strict decode judges what is committed)."""
    try:
        value = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        raise UpstreamError("engine stream event is not valid JSON", rule="json") from None
    if not isinstance(value, dict):
        raise UpstreamError("engine stream event is not an object", rule="schema")
    if "error" in value:
        return _Event(error=value["error"] if value["error"] is not None else "null")
    meta = value.get("meta_info")
    return _Event(meta_info=_Meta(finish_reason=meta.get("finish_reason") if isinstance(meta, dict) else None))


def _spliced(raws: Sequence[Any], last: list[Any]) -> msgspec.Raw:
    """One JSON list of the items of raw JSON lists (the events' deltas) and `last`. A raw piece that is not a list
    becomes an object item, which the strict decode then refuses (nothing goes missing unnoticed).

    Why not piece by piece: a Python step per piece (even reading a Raw's bytes) costs ~1-3 us, and at one event
    per token there are tens of thousands of pieces. The pieces are written out by one encode of the list of them
    (msgspec copies a Raw as it is), and the inner brackets removed by byte replaces where the shape allows it
    (_flattened); any other shape goes piece by piece."""
    joined = _flattened(_encoder.encode(list(raws)), len(raws)) if raws else b""
    if joined is None:
        items = [bytes(raw) for raw in raws]
        joined = b",".join([item[1:-1] if item[:1] == b"[" else b"{}" for item in items if item != b"[]"])
    tail = _encoder.encode(last)[1:-1]
    return msgspec.Raw(b"[" + joined + (b"," if joined and tail else b"") + tail + b"]")


def _flattened(joined: bytes, n: int) -> bytes | None:
    """The items of the n raw lists written out in `joined` (`[r1,r2,...]`), comma-separated, when the lists are
    all of one depth d <= 3 (d brackets open each and close each: output ids `[1,2]`, logprob entries
    `[[-0.5,1,null]]`, top-logprob rows `[[[-0.1,2,null]]]`) with no strings or objects in them (a string could
    hold a bracket); None otherwise. Found with no step per item: n lists of depth d are joined by exactly n-1
    `]..],[..[` (d brackets each side), which become d-1 brackets each side. Flat lists are then checked to hold
    no bracket; deeper ones are left to the strict decode, which refuses an entry that is not SGLang's."""
    inner = joined[1:-1]
    depth = len(inner) - len(inner.lstrip(b"["))
    # Every list as deep as the first: a deeper one's own joins would pass for the joins between the lists (and
    # make up for a shallower one's missing ones), so d+1 brackets in a row send the whole to the piecewise path.
    if not 1 <= depth <= 3 or b'"' in inner or b"{" in inner or b"[" * (depth + 1) in inner:
        return None
    closes, opens = b"]" * depth, b"[" * depth
    if not inner.endswith(closes) or inner.count(closes + b"," + opens) != n - 1:
        return None
    flat = inner[depth:-depth].replace(closes + b"," + opens, closes[1:] + b"," + opens[1:])
    if depth == 1 and (b"[" in flat or b"]" in flat or b",," in flat or flat.startswith(b",")
                       or flat.endswith(b",")):
        return None  # a list in a list, or an empty one
    return opens[1:] + flat + closes[1:]


def _array(items: Sequence[Payload]) -> bytes:
    """The JSON array of items (each raw JSON, bytes or a view) in one copy: the brackets go onto the first and the
    last item, not onto the joined megabytes."""
    if len(items) < 2:
        return b"[" + bytes(items[0]) + b"]" if items else b"[]"
    return b",".join([b"[" + bytes(items[0]), *items[1:-1], bytes(items[-1]) + b"]"])


def lean_event(payload: bytes, *, ids: bool, logprobs: bool) -> bytes:
    """The cumulative event without its output ids (`ids`: the member removed) and with an empty
    `meta_info.output_token_logprobs` (`logprobs`), or the payload itself where its layout is not SGLang's.

    SGLang (tokenizer_manager.py, orjson) writes `{"text":...,"output_ids":[...],"meta_info":{...,
    "output_token_logprobs":[[lp,id,null],...],"output_token_logprobs_length":N,...}}`. Each list is found by byte
    searches for its key and for what SGLang writes after it, with needles long enough to skip (a search for a list's
    `]` alone scans slower than msgspec skips it); the end of the logprob list is searched from the event's end (a
    few hundred bytes of meta_info follow it). A key's spelling with its quotes unescaped is only ever a key (a
    string holds its quotes escaped), so the first one found is the key. The span between key and end must hold no
    quote (memchr), so no string is cut, and a span that is not the whole list leaves the rest unparsable: the
    caller then decodes the event as it came."""
    pieces: list[bytes] = []
    at = 0
    if ids:
        key = payload.find(_IDS_KEY)
        close = payload.find(_AFTER_IDS, key) if key >= 0 else -1
        if close >= 0 and payload.find(b'"', key + len(_IDS_KEY), close) < 0:
            pieces.append(payload[:key])  # `"output_ids":[...],` goes, `"meta_info"` follows the comma before
            at = close + 2
    if logprobs:
        key = payload.find(_TOKEN_LOGPROBS, at)
        if key >= 0:
            start = key + len(_TOKEN_LOGPROBS)
            close = payload.rfind(_AFTER_TOKEN_LOGPROBS, start)
            if close >= 0 and payload.find(b'"', start, close) < 0:
                pieces += (payload[at:start], b"]", payload[close + 1:])
                return b"".join(pieces)
    if not pieces:
        return payload
    pieces.append(payload[at:])
    return b"".join(pieces)
