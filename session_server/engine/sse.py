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
by msgspec in one call, and one `Progress` says what they add (the agent gets one chunk for them: when the agent or
the server is slower than the engine, chunks coalesce instead of queueing). SGLang's framing is split with bytes
operations, never a Python step per event. Nothing is re-read: a delta event adds its pieces; of a batch of
cumulative events only the last one is decoded at all (its big fields skipped unparsed but its text), and the new
text is its tail. How many events there are is asked of the engine per request (engine/pacing.py). The final
event is returned as the raw bytes of a complete /generate body for the strict decoder (for delta engines: the
summed body, encoded once).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from trajectory.errors import UpstreamError

_encoder = msgspec.json.Encoder()
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs")
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
    `[logprob, id, text]` and top-logprob rows, unvalidated) when they were asked for."""

    text: str
    logprobs: list[Any] | None = None
    top_logprobs: list[Any] | None = None


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
        stop = next((i for i, e in enumerate(events) if _stops(e)), len(events))
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
        deltas = [e for e in events if isinstance(e, _Delta)]
        texts = [e.text for e in deltas]
        self.texts += texts
        self.raws["output_ids"] += [e.output_ids for e in deltas if e.output_ids]
        metas = [e.meta_info for e in deltas if e.meta_info is not None]
        self.raws["output_token_logprobs"] += [m.output_token_logprobs for m in metas if m.output_token_logprobs]
        self.raws["output_top_logprobs"] += [m.output_top_logprobs for m in metas if m.output_top_logprobs]
        entries = tops = None
        if self.logprobs:  # unvalidated; the consumer checks them
            try:
                entries = [x for m in metas if m.output_token_logprobs for x in _decode_list(m.output_token_logprobs)]
                tops = [x for m in metas if m.output_top_logprobs for x in _decode_list(m.output_top_logprobs)]
            except msgspec.DecodeError:
                entries = tops = None
        text = "".join(texts)
        if not text and not entries:
            return None
        return Progress(text, entries or None, tops or None)

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
    becomes an object item, which the strict decode then refuses (nothing goes missing unnoticed). The pieces are
    read through views (a Raw is a buffer), not copied out one by one."""
    items: list[Any] = [v[1:-1] if (v := memoryview(raw))[0] == 91 else b"{}" for raw in raws]  # 91: `[`
    items.append(_encoder.encode(last)[1:-1])
    return msgspec.Raw(_array([item for item in items if item]))


def _array(items: Sequence[Any]) -> bytes:
    """The JSON array of items (each raw JSON, bytes or a view) in one copy: the brackets go onto the first and the
    last item, not onto the joined megabytes."""
    if len(items) < 2:
        return b"[" + bytes(items[0]) + b"]" if items else b"[]"
    return b",".join([b"[" + bytes(items[0]), *items[1:-1], bytes(items[-1]) + b"]"])


async def engine_events(reads: AsyncIterator[list[bytes]], incremental: bool, logprobs: bool = False,
                        coalesce: float = 0.0) -> AsyncIterator[Progress | Final]:
    """What an engine stream adds, one Progress per read that completes events, then the Final. `reads`: the body
    as it arrives, each read as the pieces the HTTP parser handed over (for a chunked body, its chunks: SGLang's
    events). `logprobs`: the new tokens' logprob entries are wanted. `coalesce`: seconds to leave between reads
    after a Progress (the events that arrive meanwhile wait in the socket and become one batch). An `{"error": ...}`
    event raises EngineError; a stream that is not SGLang's (bad JSON, no final event) raises UpstreamError (502)."""
    reader = _Reader(incremental, logprobs)
    loop = asyncio.get_running_loop()
    source = reads.__aiter__()
    pending: list[bytes] = []  # what arrived since the last complete event, joined only once an event completes
    next_read = 0.0
    done = False
    while not done:
        if coalesce > 0 and (delay := next_read - loop.time()) > 0:
            await asyncio.sleep(delay)
        data: bytes | None = None  # the events to read as bytes, up to `end`, when they are not one piece each
        try:
            read = await source.__anext__()
        except StopAsyncIteration:
            data, done = b"".join(pending), True  # whole lines left, however they are framed; not a cut-off one
            end = _trimmed(data, data.rfind(b"\n") + 1)
        else:
            carried = len(pending)  # the start of an event an earlier read cut short
            pending += read
            whole = _whole_pieces(pending)
            if whole > carried > 0:  # the read's first piece is its rest (as the HTTP parser hands it over): one piece
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
            if end <= 0:
                continue
            progress, final = reader.block(data, end)
        if progress is not None:
            yield progress
            next_read = loop.time() + coalesce
        if final is not None:
            yield final
            return
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
