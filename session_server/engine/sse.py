"""The engine's side of a streamed /generate: SGLang's server-sent events, read in batches into what is new.

SGLang (0.5.23, default `incremental_streaming_output` off) sends cumulative events -- each carries the whole
`text`, `output_ids` and `meta_info` so far -- and a last one with `finish_reason` set, which is a complete
`/generate` response. With the engine's `--incremental-streaming-output` the events are deltas (text, output_ids and
the per-output-token meta lists); `--engine-incremental-streaming` tells the server. A cumulative engine meeting a
server that expects deltas (or the reverse) would commit garbage, so the counts are cross-checked and a mismatch
names the flag.

Why batches: at SGLang's default `stream_interval` 1 there is one event per token, and handling each on its own
(a line, a JSON decode, a delta, a chunk to the agent) costs tens of microseconds -- far more than the token costs
in an unstreamed reply. So everything that arrived in one read is handled at once: the events are split and decoded
by msgspec in one call, with a Python step per event only inside list comprehensions. SGLang's framing is split with
bytes operations, never a Python step per event. Nothing is re-read: a delta event adds its pieces; of a batch of
cumulative events only the last one is decoded at all (its big fields skipped unparsed but its text), and the new
text is its tail. How many events there are is asked of the engine per request (engine/pacing.py). The final event
is returned as the raw bytes of a complete /generate body for the strict decoder (for delta engines: the summed
body, its per-event lists spliced by one encode and byte replaces, encoded once).

What reaches the agent (engine_events): a delta stream's text is held per event and handed on in chunks of at most
pacing.CHUNK_TOKENS tokens, as soon as a chunk is full or pacing.CHUNK_SECONDS after the last one, the first text at
once and everything before the final event; a cumulative stream's new text goes on per read.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from session_server.engine import pacing
from trajectory.errors import UpstreamError

_encoder = msgspec.json.Encoder()
_MASK_META = ("output_token_sampling_mask", "output_token_sampling_logprobs")  # with sampling masks (rows per token)
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", *_MASK_META)
_DONE = b"data: [DONE]"
_DONE_PIECE = _DONE + b"\n\n"  # as SGLang writes it, one HTTP chunk
_TOKEN_LOGPROBS = b'"output_token_logprobs":['  # SGLang's key and the list's opening, as orjson writes them
_AFTER_TOKEN_LOGPROBS = b'],"output_token_logprobs_length":'  # the list's closing `]` and the key SGLang puts next
_SEPARATOR = b"\n\ndata: "  # between two events in SGLang's own framing (`data: <json>\n\n`, no other lines)
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
_decode_list = msgspec.json.Decoder(list[Any]).decode


@dataclass(slots=True)
class Progress:
    """What one batch of intermediate events adds: the new text, and the new tokens' logprob entries (SGLang's
    `[logprob, id, text]` and top-logprob rows, unvalidated) when they were asked for. `cuts` (delta events): where
    the agent's chunks end, as (characters of `text`, tokens) from its start, the last one at its end; a chunk
    holds at most engine_events' `chunk_tokens` tokens where the engine's events are that fine. None (cumulative
    events): one chunk of unknown tokens."""

    text: str
    logprobs: list[Any] | None = None
    top_logprobs: list[Any] | None = None
    cuts: list[tuple[int, int]] | None = None


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


def _stops(event: _Event | _Delta) -> bool:
    """An error event, or the final one (finish_reason set): nothing after it is read."""
    return event.error is not None or (event.meta_info is not None and event.meta_info.finish_reason is not None)


class _Reader:
    """The state of one stream: what was seen (cumulative) or the summed pieces of the body (deltas)."""

    def __init__(self, incremental: bool, logprobs: bool) -> None:
        self.incremental = incremental
        self.logprobs = logprobs
        self.text_seen = 0  # cumulative: characters of text already reported
        self.tokens_seen = 0  # cumulative: logprob entries already reported
        # cumulative: two events with different token counts held all their output ids (a delta engine's second
        # event holds fewer); from then on the ids are not read
        self.shape_known = False
        self._first_count: int | None = None
        self.texts: list[str] = []  # deltas: every event's text, and its raw ids and per-token lists
        self.raws: dict[str, list[msgspec.Raw]] = {"output_ids": [], **{k: [] for k in _PER_TOKEN_META}}
        # deltas: the events not yet handed on, one unit each (engine_events cuts the agent's chunks between them):
        # their texts, the tokens of the reply at each one's end, their logprob entries and top rows
        self.held_texts: list[str] = []
        self.held_counts: list[int] = []
        self.held_logprobs: list[Any] = []
        self.held_tops: list[Any] = []
        self.tokens = 0  # deltas: the reply's tokens in the events read so far
        self.handed = 0  # deltas: ... and in those handed on

    def block(self, data: bytes, end: int) -> tuple[Progress | None, Final | None]:
        """Progress and maybe the final event of the whole events in `data[:end]` (`data: ...` lines; no `[DONE]`).

        SGLang's framing (each event one `data: <json>` line, then a blank line) is read with bytes-level searches,
        never a Python step per event and never a copy of more than the events read: of cumulative events only the
        last (and the one before a final event) is decoded, found by searches for the line breaks before them (in C,
        `memrchr`: JSON holds none), delta events by one msgspec call over the run. Other framings (comments,
        CR LF) go line by line."""
        if data.startswith(b"data: "):
            if not self.incremental:
                starts = _last_two_events(data, end)
                if starts is not None:
                    last, previous = starts

                    def before() -> bytes | None:
                        return None if previous is None else data[previous: last - len(_SEPARATOR)]
                    return self._cumulative(data[last:end], before)
            else:
                payloads = data[6:end].split(_SEPARATOR)  # one pass (a replace by "," searches twice)
                joined = _array(payloads)
                if b"\n" not in joined:
                    try:
                        events = _decode_deltas(joined)
                    except msgspec.DecodeError:
                        return self.batch(payloads)
                    return self._judge(events, lambda: payloads)
        payloads = [line[5:].strip() for line in data[:end].split(b"\n") if line.startswith(b"data:")]
        if b"[DONE]" in payloads:
            payloads = payloads[: payloads.index(b"[DONE]")]
        return self.batch(payloads) if payloads else (None, None)

    def pieces(self, pieces: list[bytes]) -> tuple[Progress | None, Final | None] | None:
        """Progress and maybe the final event of delta events that are one piece each (`data: {...}` and the blank
        line: SGLang's HTTP chunks), decoded by one msgspec call with no search for where they begin or end; None
        when the pieces are not that (cumulative events, a `[DONE]`, other framings): the caller reads them as
        bytes."""
        if not self.incremental:
            return None
        payloads = [piece[6:-2] for piece in pieces if piece.startswith(b"data: {") and piece.endswith(b"\n\n")]
        if len(payloads) < len(pieces):
            return None
        joined = _array(payloads)
        if b"\n" in joined:  # a piece held more than one line
            return None
        try:
            events = _decode_deltas(joined)
        except msgspec.DecodeError:
            return self.batch(payloads)
        return self._judge(events, lambda: payloads)

    def batch(self, payloads: list[bytes]) -> tuple[Progress | None, Final | None]:
        """Progress of the batch's intermediate events, and the final event if the batch holds it."""
        if not self.incremental:
            return self._cumulative(payloads[-1], lambda: payloads[-2] if len(payloads) > 1 else None)
        try:
            decoded: Sequence[_Event | _Delta] = _decode_deltas(_array(payloads))
        except msgspec.DecodeError:
            decoded = [self._one(p) for p in payloads]  # find the culprit, with the rule it breaks
        return self._judge(decoded, lambda: payloads)

    def _cumulative(self, last: bytes, before: Callable[[], bytes | None]) -> tuple[Progress | None, Final | None]:
        """A cumulative event holds everything of the ones before it: only the last of a batch is read, and the one
        before it when the last ends the stream (what that adds goes out before the end, as in any other batch)."""
        events = [self._cumulative_event(last)]
        payloads = [last]
        if _stops(events[0]) and (previous := before()) is not None:
            events.insert(0, self._cumulative_event(previous))
            payloads.insert(0, previous)
        return self._judge(events, lambda: payloads)

    def _cumulative_event(self, payload: bytes) -> _Event:
        """One cumulative event decoded. Its bulk is cut out first where SGLang's layout shows where it ends
        (_lean_event): the per-token logprob list (~40 bytes per token of the reply so far, most of the event) when
        logprobs are not wanted, and the output ids once the stream's shape is known. Nothing reads them there (the
        final body goes on raw, to the strict decode), and the rest decodes the same."""
        lean = _lean_event(payload, ids=self.shape_known, logprobs=not self.logprobs)
        if lean is not payload:
            try:
                return _decode_cumulative(lean)
            except msgspec.DecodeError:
                pass  # the whole event decides
        try:
            return _decode_cumulative(payload)
        except msgspec.DecodeError:
            return self._one(payload)

    def _judge(self, events: Sequence[_Event | _Delta],
               payloads: Callable[[], list[bytes]]) -> tuple[Progress | None, Final | None]:
        """What the events add, up to an error or final event (whose raw payload is then looked up)."""
        # one comprehension, not a call per event (an error or final event is the last but in a broken stream)
        stops = [e.error is not None or (e.meta_info is not None and e.meta_info.finish_reason is not None)
                 for e in events]
        stop = stops.index(True) if True in stops else len(events)
        progress = self._progress(events[:stop])
        if stop == len(events):
            return progress, None
        raw = payloads()[stop]
        if events[stop].error is not None:
            raise EngineError(raw, msgspec.json.decode(raw).get("error"))
        return progress, Final(self._final(raw))

    @staticmethod
    def _one(payload: bytes) -> _Event:
        """An event the typed decode refused, judged alone: not JSON or not an object is a 502; anything else odd
        is skipped (nothing is taken from it; the final body's strict decode judges what is committed)."""
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

    def _progress(self, events: Sequence[_Event | _Delta]) -> Progress | None:
        if not events:
            return None
        if not self.incremental:
            last = events[-1]
            return self._cumulative_progress(last) if isinstance(last, _Event) else None
        self._hold([e for e in events if isinstance(e, _Delta)])
        return None  # engine_events takes what is held (take), when the chunk rules say so

    def _hold(self, deltas: list[_Delta]) -> None:
        """Delta events' pieces kept for the final body, and their text held for the agent, one unit per event.
        Python steps per event are list comprehensions only: at one event per token they are most of the cost."""
        texts = [e.text for e in deltas]
        self.texts += texts
        self.raws["output_ids"] += [e.output_ids for e in deltas if e.output_ids]
        metas = [e.meta_info for e in deltas if e.meta_info is not None]
        self.raws["output_token_logprobs"] += [m.output_token_logprobs for m in metas if m.output_token_logprobs]
        self.raws["output_top_logprobs"] += [m.output_top_logprobs for m in metas if m.output_top_logprobs]
        for key in _MASK_META:
            self.raws[key] += [raw for m in metas if (raw := getattr(m, key))]
        # The reply's tokens at each event's end: SGLang's meta_info.completion_tokens counts the whole reply in
        # both modes. Only where the chunks are cut depends on it (an engine without it: one token per event).
        counts: list[Any] = [e.meta_info.completion_tokens if e.meta_info is not None else None for e in deltas]
        try:
            if counts and (counts != sorted(counts) or counts[0] < self.tokens):
                raise TypeError
        except TypeError:  # missing, not numbers, or not growing
            counts = list(range(self.tokens + 1, self.tokens + 1 + len(deltas)))
        if counts:
            self.tokens = counts[-1]
        self.held_texts += texts
        self.held_counts += counts
        if self.logprobs:  # unvalidated; the consumer checks them
            try:
                self.held_logprobs += [x for m in metas if m.output_token_logprobs
                                       for x in _decode_list(m.output_token_logprobs)]
                self.held_tops += [x for m in metas if m.output_top_logprobs
                                   for x in _decode_list(m.output_top_logprobs)]
            except msgspec.DecodeError:
                pass

    def take(self, chunk_tokens: int, everything: bool) -> Progress | None:
        """What is held, cut into the agent's chunks of at most `chunk_tokens` tokens each (an event is never cut:
        an engine that sends more tokens per event gets a chunk per event); with `everything` false a last chunk
        that is not full stays held. None: nothing to hand on."""
        counts = self.held_counts
        if not counts:
            return None
        base = self.handed
        cuts: list[tuple[int, int]] = []
        chars = 0
        at = 0
        texts = self.held_texts
        while at < len(counts):
            end = bisect.bisect_right(counts, base + chunk_tokens, at)
            if end == at:
                end = at + 1  # one event of more tokens than a chunk holds
            full = end < len(counts) or counts[end - 1] - base >= chunk_tokens
            if not full and not everything:
                break
            chars += sum(map(len, texts[at:end]))
            cuts.append((chars, counts[end - 1] - self.handed))
            base = counts[end - 1]
            at = end
        if not cuts:
            return None
        text = "".join(texts[:at])
        tokens = base - self.handed
        logprobs = tops = None
        if self.held_logprobs or self.held_tops:
            # entries of the tokens handed on; if their number is not the tokens' (an odd engine), the chunks are
            # not cut (the consumer validates the entries and leaves unsound ones to the final event)
            logprobs, self.held_logprobs = self.held_logprobs[:tokens], self.held_logprobs[tokens:]
            tops, self.held_tops = self.held_tops[:tokens], self.held_tops[tokens:]
            if len(logprobs) != tokens:
                cuts = [(len(text), tokens)]
        del self.held_texts[:at]
        del self.held_counts[:at]
        self.handed = base
        if not text and not logprobs:
            return None
        return Progress(text, logprobs or None, tops or None, cuts)

    def _cumulative_progress(self, event: _Event) -> Progress | None:
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
        entries = tops = None
        if self.logprobs and meta is not None and meta.output_token_logprobs:
            try:
                everything = _decode_list(meta.output_token_logprobs)
                rows = _decode_list(meta.output_top_logprobs) if meta.output_top_logprobs else None
            except msgspec.DecodeError:
                everything, rows = [], None
            if len(everything) > self.tokens_seen:
                entries = everything[self.tokens_seen:]
                tops = rows[self.tokens_seen:] if rows is not None and len(rows) == len(everything) else None
                self.tokens_seen = len(everything)
        if not fresh and entries is None:
            return None
        return Progress(fresh, entries, tops)

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
    if not 1 <= depth <= 3 or b'"' in inner or b"{" in inner:
        return None
    closes, opens = b"]" * depth, b"[" * depth
    if not inner.endswith(closes) or inner.count(closes + b"," + opens) != n - 1:
        return None
    flat = inner[depth:-depth].replace(closes + b"," + opens, closes[1:] + b"," + opens[1:])
    if depth == 1 and (b"[" in flat or b"]" in flat or b",," in flat or flat.startswith(b",")
                       or flat.endswith(b",")):
        return None  # a list in a list, or an empty one
    return opens[1:] + flat + closes[1:]


def _array(items: Sequence[Any]) -> bytes:
    """The JSON array of items (each raw JSON, bytes or a view) in one copy: the brackets go onto the first and the
    last item, not onto the joined megabytes."""
    if len(items) < 2:
        return b"[" + bytes(items[0]) + b"]" if items else b"[]"
    return b",".join([b"[" + bytes(items[0]), *items[1:-1], bytes(items[-1]) + b"]"])


async def engine_events(reads: AsyncIterator[list[bytes]], incremental: bool, logprobs: bool = False,
                        coalesce: float = 0.0, chunk_tokens: int = pacing.CHUNK_TOKENS,
                        chunk_seconds: float = pacing.CHUNK_SECONDS) -> AsyncIterator[Progress | Final]:
    """What an engine stream adds, as Progress for the agent's chunks, then the Final. `reads`: the body as it
    arrives, each read as the pieces the HTTP parser handed over (for a chunked body, its chunks: SGLang's events).
    `logprobs`: the new tokens' logprob entries are wanted. `coalesce`: seconds to leave between reads (the events
    that arrive meanwhile wait in the socket and become one batch). An `{"error": ...}` event raises EngineError; a
    stream that is not SGLang's (bad JSON, no final event) raises UpstreamError (502).

    The agent's chunks (delta events): the first text is handed on at once, and then what is held goes on as soon as
    it fills a chunk of `chunk_tokens` tokens or `chunk_seconds` after the last hand-on, whichever comes first, and
    all of it before the Final (a Progress may carry several chunks, `cuts`, to be sent in one write). So the agent
    gets new text at least every `chunk_tokens` tokens (where the engine's events hold no more) or `chunk_seconds`
    (plus a read's pacing), and never more chunks than the reply has chunks of tokens or of time. A cumulative
    event's text cannot be cut by tokens: each read's is handed on as one chunk."""
    reader = _Reader(incremental, logprobs)
    loop = asyncio.get_running_loop()
    source = reads.__aiter__()
    pending: list[bytes] = []  # what arrived since the last complete event, joined only once an event completes
    next_read = 0.0
    handed: float | None = None  # loop time of the last hand-on (None: none yet)
    texted = False  # some text was handed on: until then, everything read goes on at once
    reading: asyncio.Future[list[bytes]] | None = None  # a read raced against the hand-on deadline
    done = False
    try:
        while not done:
            if handed is not None and reader.held_counts:  # text held back: it goes on by the deadline at the latest
                deadline = handed + chunk_seconds
                if coalesce > 0 and (delay := min(next_read, deadline) - loop.time()) > 0:
                    await asyncio.sleep(delay)
                if loop.time() < deadline:
                    if reading is None:
                        reading = asyncio.ensure_future(source.__anext__())
                    await asyncio.wait((reading,), timeout=deadline - loop.time())
                if loop.time() >= deadline and (late := reader.take(chunk_tokens, True)) is not None:
                    handed = loop.time()
                    texted = texted or bool(late.text)
                    yield late
                    continue
            elif coalesce > 0 and (delay := next_read - loop.time()) > 0:
                await asyncio.sleep(delay)
            data: bytes | None = None  # the events to read as bytes, up to `end`, when they are not one piece each
            progress: Progress | None = None
            final: Final | None = None
            try:
                if reading is not None:
                    read, reading = await reading, None
                else:
                    read = await source.__anext__()
            except StopAsyncIteration:
                data, done = b"".join(pending), True  # whole lines left, however they are framed; not a cut-off one
                end = _trimmed(data, data.rfind(b"\n") + 1)
            else:
                next_read = loop.time() + coalesce
                carried = len(pending)  # the start of an event an earlier read cut short
                pending += read
                whole = _whole_pieces(pending)
                if whole > carried > 0:  # the read's first piece is its rest (as the HTTP parser hands it over)
                    pending[:carried + 1] = [b"".join(pending[:carried + 1])]
                    whole -= carried
                ends = whole > 0 and pending[whole - 1] == _DONE_PIECE  # SGLang's `[DONE]`: nothing after it is read
                if whole and (result := reader.pieces(pending[:whole - ends])) is not None:
                    del pending[:whole]
                    progress, final = result
                    done = ends
                elif any(b"\n" in piece for piece in read):  # memchr: an event ends at a line break
                    data = b"".join(pending)
                    end, rest = _whole_events(data)
                    pending[:] = [data[rest:]] if rest < len(data) else []
                else:
                    continue
            if data is not None:
                if data.endswith(_DONE, 0, end):
                    end, done = _trimmed(data, end - len(_DONE)), True
                if end > 0:
                    progress, final = reader.block(data, end)
            if incremental:
                progress = reader.take(chunk_tokens, not texted or final is not None or done
                                       or handed is None or loop.time() >= handed + chunk_seconds)
            if progress is not None:
                handed = loop.time()
                texted = texted or bool(progress.text)
                yield progress
            if final is not None:
                yield final
                return
    finally:
        if reading is not None:
            reading.cancel()
    raise UpstreamError("engine stream ended without a final event", rule="stream_incomplete")


async def reads_of(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The reads of a client that hands the body over in joined chunks (httpx), as engine_events takes them."""
    async for chunk in chunks:
        yield [chunk]


def _whole_pieces(pending: list[bytes]) -> int:
    """How many of the pending pieces end at an event's end, when an event's end is a piece's end (0: unknown).
    SGLang writes each event as one HTTP chunk, so a read ends with a whole event or cuts the last one short (a piece
    without a line break); a stream cut otherwise (a proxy's own chunks) is searched for its events' ends."""
    if pending[-1].endswith(b"\n\n"):
        return len(pending)
    if len(pending) > 1 and pending[-2].endswith(b"\n\n") and b"\n" not in pending[-1]:
        return len(pending) - 1
    return 0


def _lean_event(payload: bytes, *, ids: bool, logprobs: bool) -> bytes:
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


def _last_two_events(data: bytes, end: int) -> tuple[int, int | None] | None:
    """Where the last event of `data[:end]` begins and the one before it (None: there is none), in SGLang's framing
    (`data: <json>` lines between blank lines, JSON holding no line break); None for any other framing. Each is the
    line break before it, found from the end (`memrchr`), never a search through the events' bytes."""
    starts: list[int] = []
    stop = end
    while len(starts) < 2:
        nl = data.rfind(b"\n", 0, stop)
        if nl < 0:
            starts.append(6)  # the first event (`data` begins with `data: `)
            break
        if nl == 0 or not data.startswith(_SEPARATOR, nl - 1):
            return None
        starts.append(nl + 7)
        stop = nl - 1
    return starts[0], starts[1] if len(starts) > 1 else None


def _whole_events(buffer: bytes) -> tuple[int, int]:
    """Where the buffer's complete events end (an SSE event ends at a blank line) and the rest begins. SGLang's
    events end in `\n\n` and hold no other line break, so the buffer's last line break or the one before it
    (`memrchr`, no scan through the event) ends the last one; other framings are searched for."""
    stop = len(buffer)
    for _ in range(2):
        nl = buffer.rfind(b"\n", 0, stop)
        if nl <= 0:
            break
        if buffer[nl - 1] == 10:  # \n
            return nl - 1, nl + 1
        stop = nl
    end = buffer.rfind(b"\n\n")
    if end >= 0:
        return end, end + 2
    end = buffer.rfind(b"\r\n\r\n")
    if end >= 0:
        return end, end + 4
    return 0, 0


def _trimmed(data: bytes, end: int) -> int:
    """`end` moved back over line breaks and blanks."""
    while end > 0 and data[end - 1] in b" \t\r\n":
        end -= 1
    return end
