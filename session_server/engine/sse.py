"""The engine's side of a streamed /generate: SGLang's server-sent events, read into cumulative event objects.

SGLang (0.5.23, default `incremental_streaming_output` off) sends cumulative events -- each carries the whole
`text`, `output_ids` and `meta_info` so far -- and a last one with `finish_reason` set, which is a complete
`/generate` response. With the engine's `--incremental-streaming-output` the events are deltas (text, output_ids and
the per-output-token meta lists); `--engine-incremental-streaming` tells the server, and the deltas are summed here
into the cumulative shape, so every consumer sees one shape and the final event is a complete body for the strict
decoder. A cumulative engine meeting a server that expects deltas (or the reverse) would commit garbage, so the
counts are cross-checked and a mismatch names the flag.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from trajectory.errors import UpstreamError

_encoder = msgspec.json.Encoder()
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs")


@dataclass(slots=True)
class EngineEvent:
    """One event of the engine stream: cumulative, and `raw` (the bytes of a complete /generate body) when final."""

    body: dict[str, Any]
    final: bool
    raw: bytes | None = None


class EngineError(Exception):
    """The engine sent an `{"error": ...}` event: its raw bytes and the error object."""

    def __init__(self, raw: bytes, error: Any) -> None:
        super().__init__("engine stream error")
        self.raw = raw
        self.error = error


class Cumulative:
    """Sums delta events into SGLang's cumulative shape, or checks that cumulative events are whole."""

    def __init__(self, incremental: bool) -> None:
        self._acc: dict[str, Any] | None = {"text": "", "output_ids": []} if incremental else None

    @property
    def incremental(self) -> bool:
        return self._acc is not None

    def feed(self, event: dict[str, Any]) -> dict[str, Any]:
        meta = event.get("meta_info")
        ids = event.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            return event  # malformed: the final decode (or its absence) reports it
        if self._acc is None:
            count = meta.get("completion_tokens")
            if isinstance(count, int) and count != len(ids):
                raise UpstreamError(
                    f"engine stream event holds {len(ids)} of {count} output ids: the engine streams deltas "
                    "(SGLang --incremental-streaming-output); start the session server with "
                    "--engine-incremental-streaming", rule="stream_shape")
            return event
        acc = self._acc
        acc["text"] += event.get("text") or ""
        acc["output_ids"] += ids
        for key in _PER_TOKEN_META:
            if isinstance(meta.get(key), list):
                acc[key] = acc.get(key, []) + meta[key]
        full_meta = {**meta, **{k: acc[k] for k in _PER_TOKEN_META if k in acc}}
        return {**event, "text": acc["text"], "output_ids": list(acc["output_ids"]), "meta_info": full_meta}


async def engine_events(lines: AsyncIterator[str], incremental: bool) -> AsyncIterator[EngineEvent]:
    """The events of one engine stream, each cumulative; the last is final. An `{"error": ...}` event raises
    EngineError; a stream that is not SGLang's (bad JSON, no final event) raises UpstreamError (502)."""
    cumulative = Cumulative(incremental)
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        raw = data.encode()
        try:
            event = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise UpstreamError("engine stream event is not valid JSON", rule="json") from None
        if not isinstance(event, dict):
            raise UpstreamError("engine stream event is not an object", rule="schema")
        if "error" in event:
            raise EngineError(raw, event["error"])
        event = cumulative.feed(event)
        meta = event.get("meta_info")
        if isinstance(meta, dict) and meta.get("finish_reason") is not None:
            yield EngineEvent(event, True, raw if not cumulative.incremental else _encoder.encode(event))
            return
        yield EngineEvent(event, False)
    raise UpstreamError("engine stream ended without a final event", rule="stream_incomplete")
