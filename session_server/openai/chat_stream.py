"""`stream: true` chats: SGLang's SSE in, OpenAI chunks out, as the engine produces them; committed only at the end.

The engine request is the same `/generate` with `stream: true`. SGLang (0.5.23, default `incremental_streaming_output`
off) sends cumulative events -- each carries the whole `text`, `output_ids` and `meta_info` so far -- and a last one
with `finish_reason` set, which is a complete `/generate` response. Every intermediate event becomes OpenAI deltas
(reasoning_content, content, whole tool calls with their `index`; logprobs of the new tokens when asked), computed by
stream_parser.DeltaTracker so they can never contradict the final parse. The final event goes through exactly the
non-streaming path: strict validation (DESIGN.md 5.3), family parse, commit under the session lock; then the rest of
the message, the `finish_reason` chunk, a usage chunk with empty `choices` when `stream_options.include_usage`, and
`[DONE]`.

Failure rules: before the first byte to the agent, errors keep their real status (the engine's own non-2xx or in-
stream error passes through unrecorded; validation 502, abort 503, ...). After it, the stream ends with an error event
and nothing is committed. A client that disconnects (or a DELETE, pause, shutdown, the request timeout) aborts the
engine request by rid and closes the engine stream; the slot is released once, when the response ends.

Why a response object that owns the gate claim: the stream outlives the route handler (Starlette calls the response
after the handler returns), and the slot must stay taken until the last byte, so the handler hands its claim over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import msgspec
import numpy as np
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from session_server.engine.wire import split_routed_experts
from session_server.errors import (
    AbortReason,
    ClientDisconnectedError,
    EngineTimeoutError,
    SessionPausedError,
    error_response,
)
from session_server.openai.logprobs import openai_logprobs
from session_server.openai.protocol import ChatRequest, TurnOutput, decode_turn, system_fingerprint
from session_server.sessions.session import Claim
from session_server.state import ServerState
from session_server.turns.commit import commit_turn
from session_server.turns.deltas import DeltaTracker, StreamDivergedError
from session_server.turns.race import Ending, race
from trajectory import TurnPlan
from trajectory.errors import InvariantError, SessionError, UpstreamError

logger = logging.getLogger("session_server.openai.chat_stream")

_encoder = msgspec.json.Encoder()
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Gone(Exception):
    """The agent's connection is gone (a send failed)."""


class StreamingTurn:
    """The ASGI response of one streamed chat; owns the gate claim from the handler's return to its last byte."""

    def __init__(self, server: ServerState, claim: Claim, rid: str, payload: bytes, chat: ChatRequest,
                 plan: TurnPlan, headers: dict[str, str] | None = None) -> None:
        self.server = server
        self.claim = claim
        self.rid = rid
        self.payload = payload
        self.chat = chat
        self.plan = plan
        self.family = server.family
        self.model = chat.model or server.family.name
        self.created = int(time.time())
        self.tracker = DeltaTracker(server.family, f"call_{rid[:24]}", chat.options.parse_tool_calls)
        self.started = False  # response headers sent: from here on, failures are error events
        self.committed = False
        self.lp_sent: list[float] = []
        self.status = 200
        self.headers = headers or {}
        self.t_start = time.perf_counter()
        self.engine_seconds = 0.0
        self._settled = False
        self._abandoned = False  # handed to the engine drain: whatever the engine still sends is never committed
        self._acc: dict[str, Any] | None = (
            {"text": "", "output_ids": []} if server.config.engine_incremental_streaming else None)
        self._total_tokens = 0

    # -- ASGI -----------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._run(receive, send)
        finally:
            self._settle()
            if self.committed:
                self.server.metrics.chat_done(time.perf_counter() - self.t_start, self.engine_seconds)

    def _settle(self) -> None:
        """Engine-session books and the slot, once; called before the last bytes go out, so an agent that reacts to
        `[DONE]` (or to an error event) with its next request never meets its own finished chat in the gate."""
        if self._settled:
            return
        self._settled = True
        engine_sessions = self.server.engine_sessions
        if engine_sessions is not None:
            if self.committed:
                engine_sessions.committed(self.claim.session.id, self._total_tokens)
            else:
                engine_sessions.mark_dirty(self.claim.session.id)
        self.claim.release()

    async def _run(self, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        # --request-timeout is the total the client waits, counted from the claim (openai/chat.py _remaining).
        remaining = self.claim.started + self.server.config.request_timeout - time.monotonic()
        try:
            ending = await race(pump, receive, self.claim, remaining)
        except asyncio.CancelledError:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.ensure_future(self._abort_engine(pump)))
            raise
        if ending is Ending.FINISHED:
            error = pump.exception()
            if error is None:
                return
            if not self.committed:  # whatever broke, the engine request must not outlive the chat
                self.server.metrics.engine_aborts.inc()
                await self.server.engine.abort(self.rid)
            if isinstance(error, _Gone):
                self.status = ClientDisconnectedError.status
                self.server.metrics.abort(AbortReason.DISCONNECT)
            elif isinstance(error, SessionError):
                if isinstance(error, UpstreamError):
                    self.server.metrics.validation_failure(error.rule)
                elif self.claim.reason is not None:
                    self.server.metrics.abort(self.claim.reason)
                elif isinstance(error, SessionPausedError):
                    self.server.metrics.abort(AbortReason.ENGINE)
                await self._fail(send, error)
            else:  # an invariant of ours: never a half-written success
                logger.error("session %s: streaming chat failed", self.claim.session.id, exc_info=error)
                await self._fail(send, InvariantError(f"internal error while streaming: {type(error).__name__}"))
            return
        await self._abort_engine(pump)
        if ending is Ending.DISCONNECTED:
            self.status = ClientDisconnectedError.status
            self.server.metrics.abort(AbortReason.DISCONNECT)
            return
        if ending is Ending.ABORTED:
            self.server.metrics.abort(self.claim.reason or AbortReason.SHUTDOWN)
            await self._fail(send, self.claim.abort_error() or SessionPausedError("chat aborted"))
            return
        self.server.metrics.abort(AbortReason.TIMEOUT)
        await self._fail(send, EngineTimeoutError(
            f"engine did not finish within {self.server.config.request_timeout:g}s; request aborted"))

    async def _abort_engine(self, pump: asyncio.Future[Any]) -> None:
        """Abort by rid, then drop the engine stream (closing it is a disconnect the engine also acts on)."""
        if pump.done():
            if not pump.cancelled():
                pump.exception()
            return
        drains = self.server.drains
        if drains is not None:  # the engine ends it in the background; the client and the slot do not wait
            self._abandoned = True
            drains.start(self.claim.session.id, self.rid, pump)
            return
        self.server.metrics.engine_aborts.inc()
        await self.server.engine.abort(self.rid)
        pump.cancel()
        await asyncio.wait((pump,))
        if not pump.cancelled():
            pump.exception()

    # -- sending --------------------------------------------------------------------------------------------------

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        try:
            await send(message)
        except Exception as exc:  # uvicorn raises once the client is gone
            raise _Gone(str(exc)) from exc

    async def _start(self, send: Send) -> None:
        if self.started:
            return
        self.started = True
        headers = SSE_HEADERS + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await self._send(send, {"type": "http.response.start", "status": 200, "headers": headers})
        await self._event(send, self._chunk({"role": "assistant", "content": ""}))

    async def _event(self, send: Send, obj: Any) -> None:
        body = b"data: " + _encoder.encode(obj) + b"\n\n"
        await self._send(send, {"type": "http.response.body", "body": body, "more_body": True})

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               fingerprint: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": f"chatcmpl-{self.rid}", "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if fingerprint is not None:
            chunk["system_fingerprint"] = fingerprint
        return chunk

    async def _fail(self, send: Send, err: SessionError) -> None:
        """Before the first byte: the error as its own status. After: an error event ends the stream."""
        self.status = err.status
        self._settle()
        try:
            if not self.started:
                response = error_response(err)
                await self._send(send, {"type": "http.response.start", "status": response.status_code,
                                        "headers": response.raw_headers})
                await self._send(send, {"type": "http.response.body", "body": response.body})
                return
            error: dict[str, Any] = {"message": err.message, "type": err.code, "code": err.status}
            if isinstance(err, SessionPausedError):
                error["retry_after"] = max(1, int(err.retry_after))
            await self._event(send, {"error": error})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except _Gone:
            pass

    # -- the engine stream ----------------------------------------------------------------------------------------

    async def _pump(self, send: Send) -> None:
        final: bytes | None = None
        async with self.server.engine.stream_generate(self.payload, self.claim.session.id) as engine:
            if not 200 <= engine.status_code < 300:  # the engine's own error: pass it through, unrecorded
                body = await engine.aread()
                self.status = engine.status_code
                self._settle()
                content_type = engine.headers.get("content-type", "application/json").encode("latin-1")
                await self._send(send, {"type": "http.response.start", "status": engine.status_code,
                                        "headers": [(b"content-type", content_type)]})
                await self._send(send, {"type": "http.response.body", "body": body})
                return
            async for line in engine.aiter_lines():
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
                    await self._engine_error(send, raw, event["error"])
                    return
                event = self._cumulative(event)
                meta = event.get("meta_info")
                if isinstance(meta, dict) and meta.get("finish_reason") is not None:
                    final = raw if self._acc is None else _encoder.encode(event)
                    break
                await self._progress(send, event)
        if final is None:
            raise UpstreamError("engine stream ended without a final event", rule="stream_incomplete")
        await self._finish(send, final)

    def _cumulative(self, event: dict[str, Any]) -> dict[str, Any]:
        """SGLang's default events are already cumulative. With --engine-incremental-streaming they are deltas
        (text, output_ids, and the per-output-token meta lists), summed here into the cumulative shape, so the final
        one is a complete /generate body for the strict decoder. A cumulative server meeting delta events would
        commit garbage, so the counts are cross-checked and a mismatch names the flag."""
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
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if isinstance(meta.get(key), list):
                acc[key] = acc.get(key, []) + meta[key]
        full_meta = {**meta, **{k: acc[k] for k in ("output_token_logprobs", "output_top_logprobs") if k in acc}}
        return {**event, "text": acc["text"], "output_ids": list(acc["output_ids"]), "meta_info": full_meta}

    async def _engine_error(self, send: Send, raw: bytes, error: Any) -> None:
        code = error.get("code") if isinstance(error, dict) else None
        if not self.started:
            status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 400
            self.status = status
            self._settle()
            await self._send(send, {"type": "http.response.start", "status": status,
                                    "headers": [(b"content-type", b"application/json")]})
            await self._send(send, {"type": "http.response.body", "body": raw})
            return
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise UpstreamError(f"engine failed mid-stream: {message}", rule="stream_error")

    async def _progress(self, send: Send, event: dict[str, Any]) -> None:
        """An intermediate (cumulative) event: send whatever it settles. Not yet validated, so only what the final,
        validated event is later checked against (text deltas, logprobs of new tokens) is taken from it."""
        text = event.get("text")
        delta = self.tracker.update(text) if isinstance(text, str) else None
        logprobs = self._new_logprobs(event.get("meta_info"))
        if delta is None and logprobs is None:
            return
        await self._start(send)
        await self._event(send, self._chunk(delta or {}, logprobs=logprobs))

    def _new_logprobs(self, meta: Any) -> dict[str, Any] | None:
        options = self.chat.options
        if not options.logprobs or not isinstance(meta, dict):
            return None
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) <= len(self.lp_sent):
            return None
        fresh = entries[len(self.lp_sent):]
        try:
            values = np.asarray([float(e[0]) for e in fresh], dtype=np.float32)
            ids = np.asarray([int(e[1]) for e in fresh], dtype=np.int64)
        except (TypeError, ValueError, IndexError):
            return None  # left to the final, validated event
        if not np.isfinite(values).all() or (len(ids) and (ids.min() < 0 or ids.max() >= self.family.vocab_size)):
            return None
        top = None
        rows = meta.get("output_top_logprobs")
        if options.top_logprobs and isinstance(rows, list) and len(rows) == len(entries):
            try:
                top = [[(float(a[0]), int(a[1])) for a in (row or ())] for row in rows[len(self.lp_sent):]]
            except (TypeError, ValueError, IndexError):
                return None
            if any(not 0 <= t < self.family.vocab_size for row in top for _, t in row):
                return None
        self.lp_sent.extend(values.tolist())
        return openai_logprobs(self.family.tokenizer, ids, values, top, options.top_logprobs)

    async def _finish(self, send: Send, raw: bytes) -> None:
        server, chat, claim = self.server, self.chat, self.claim
        self.engine_seconds = time.perf_counter() - self.t_start
        t0 = time.perf_counter()
        split = split_routed_experts(raw)
        out: TurnOutput = await server.pool.run_decode(
            len(split[0]), decode_turn, raw, self.family, self.rid, self.model, split=split,
            options=dataclasses.replace(chat.options, logprobs=False),  # the chunks carry their own logprobs
            retry_after=server.config.retry_after,
        )
        server.metrics.stage("decode", time.perf_counter() - t0)
        result = out.result
        try:
            rest = self.tracker.finish(out.message)
        except StreamDivergedError as exc:
            raise InvariantError(f"streamed deltas disagree with the final reply: {exc}") from exc
        sent = np.asarray(self.lp_sent, dtype=np.float32)
        if not np.array_equal(sent, result.logprobs[: len(sent)]):
            raise UpstreamError("engine stream logprobs changed between events", rule="stream_logprobs")
        claim.raise_if_aborted()
        if self._abandoned:
            raise _Gone("the chat ended before the engine finished; nothing is committed")
        session = claim.session
        t0 = time.perf_counter()
        record = await commit_turn(server, session, self.plan, result, out.message)
        self.committed = True
        self._total_tokens = len(self.plan.prompt_ids) + len(result.output_ids)
        server.metrics.stage("commit", time.perf_counter() - t0)
        server.metrics.turn_tokens(len(self.plan.prompt_ids), record.cached_tokens, record.completion_len)
        if self.plan.rolled_back:
            server.metrics.rollback(self.plan.rollback_reason or "retry")
        logprobs = None
        if chat.options.logprobs and len(sent) < len(result.output_ids):
            n = len(sent)
            top = result.top_logprobs[n:] if result.top_logprobs is not None else None
            logprobs = openai_logprobs(self.family.tokenizer, result.output_ids[n:], result.logprobs[n:], top,
                                       chat.options.top_logprobs)
        tool_calls = bool(out.message.get("tool_calls"))
        kind = result.finish_reason.get("type")
        finish = "length" if kind == "length" else ("tool_calls" if tool_calls else "stop")
        fingerprint = system_fingerprint(self.family, result)
        await self._start(send)
        if rest is not None:
            await self._event(send, self._chunk(rest, logprobs=logprobs, fingerprint=fingerprint))
            logprobs = None
        await self._event(send, self._chunk({}, finish=finish, logprobs=logprobs, fingerprint=fingerprint))
        if chat.options.include_usage:
            usage = {
                "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            }
            await self._event(send, {"id": f"chatcmpl-{self.rid}", "object": "chat.completion.chunk",
                                     "created": self.created, "model": self.model,
                                     "system_fingerprint": fingerprint, "choices": [], "usage": usage})
        self._settle()
        await self._send(send, {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def stream_response(server: ServerState, claim: Claim, rid: str, payload: bytes, chat: ChatRequest,
                    plan: TurnPlan, headers: dict[str, str] | None = None) -> Response:
    """The handler's return value for a streamed chat (typed as a Response for Starlette's sake)."""
    return StreamingTurn(server, claim, rid, payload, chat, plan, headers)  # type: ignore[return-value]
