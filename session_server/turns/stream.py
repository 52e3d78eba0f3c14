"""A streamed turn (`stream: true`), whatever API carried it: the engine's events in, the front end's events out, as
the engine produces them; committed only at the end.

The engine request is the same `/generate` with `stream: true`; engine/sse.py reads its events into one cumulative
shape. Every intermediate event becomes deltas (reasoning, content, whole tool calls; the new tokens' logprobs when
the front end wants them), computed by deltas.DeltaTracker so they can never contradict the final parse. The final
event goes through exactly the plain turn's path: strict validation (DESIGN.md 5.3), family parse, the commit under
the session lock (turn.commit_output); then the front end's closing events.

When the engine aborts the request for everyone (a weight update), the turn goes on in a new engine request
(resume.py) and the stream simply continues: what the aborted request's last event added is sent first, then the
continuation's events.

Failure rules: before the first byte to the agent, errors keep their real status, in the front end's shape (the
engine's own non-2xx or in-stream error passes through unrecorded; validation 502, abort 503, ...). After it, the
stream ends with the front end's error event and nothing is committed. A client that disconnects (or a DELETE,
pause, shutdown, the request timeout) aborts the engine request by rid and closes the engine stream; the slot is
released once, when the response ends. Failures are counted exactly as a plain turn's (turn.count_failure).

Why a response object that owns the gate claim: the stream outlives the route handler (Starlette calls the response
after the handler returns), and the slot must stay taken until the last byte, so the handler hands its claim over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np
from starlette.types import Receive, Scope, Send

from session_server.engine.http11 import EngineStream
from session_server.engine.sse import EngineError, Final, Progress, engine_events, reads_of
from session_server.engine.wire import split_routed_experts
from session_server.errors import (
    AbortReason,
    ClientDisconnectedError,
    EngineAbortedError,
    EngineRefusedError,
    EngineTimeoutError,
    tag_abort,
)
from session_server.http.disconnect import Disconnects, disconnects
from session_server.sessions.session import Claim
from session_server.state import ServerState
from session_server.turns.deltas import DeltaTracker, StreamDivergedError
from session_server.turns.output import TurnOutput, call_id_prefix, decode_turn
from session_server.turns.race import Ending, race
from session_server.turns.resume import Continuation, continue_turn
from session_server.turns.turn import FrontEnd, NewTokens, Turn, commit_output, count_failure, engine_sessions_of
from trajectory import GenerateResult
from trajectory.errors import InvariantError, SessionError, UpstreamError

logger = logging.getLogger("session_server.turns.stream")

R = TypeVar("R")
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Gone(Exception):
    """The agent's connection is gone (a send failed)."""


class StreamedTurn(Generic[R]):
    """The ASGI response of one streamed turn; owns the gate claim from the handler's return to its last byte."""

    def __init__(self, server: ServerState, claim: Claim, turn: Turn[R], payload: bytes, api: FrontEnd[R]) -> None:
        self.server = server
        self.claim = claim
        self.turn = turn
        self.payload = payload
        self.api = api
        self.format = api.stream(turn)
        self.family = turn.family
        self.tracker = DeltaTracker(turn.family, call_id_prefix(turn.rid), turn.request.parse_tool_calls,
                                    opening=turn.plan.reply_opening, tools=turn.plan.tools)
        self.logprobs = api.wants_logprobs(turn.request.api)
        self.started = False  # response headers sent: from here on, failures are error events
        self.committed = False
        self.lp_sent: list[float] = []
        self._lp_broken = False  # an unsound logprob entry: the rest come with the final event
        self.status = 200
        self.t_start = time.perf_counter()
        self.engine_seconds = 0.0
        self._settled = False
        self._abandoned = False  # handed to the engine drain: whatever the engine still sends is never committed
        self._total_tokens = 0
        self._text_seen = 0  # characters of reply text handed to the tracker, over every engine request
        self.continuation = Continuation(server.config.max_turn_continuations)

    # -- ASGI -----------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._run(disconnects(scope, receive), send)
        finally:
            self._settle()
            if self.committed:
                self.server.metrics.chat_done(time.perf_counter() - self.t_start, self.engine_seconds)

    def _settle(self) -> None:
        """Engine-session books and the slot, once; called before the last bytes go out, so an agent that reacts to
        the stream's end (or to an error event) with its next request never meets its own finished turn in the
        gate."""
        if self._settled:
            return
        self._settled = True
        engine_sessions = engine_sessions_of(self.server, self.claim)
        if engine_sessions is not None and not self.committed:
            engine_sessions.mark_dirty(self.claim.session.id)
        self.claim.release()

    async def _run(self, client: Disconnects, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        # --request-timeout is the total the client waits, counted from the claim (pipeline._remaining).
        remaining = self.claim.started + self.server.config.request_timeout - time.monotonic()
        try:
            ending = await race(pump, client, self.claim, remaining)
        except asyncio.CancelledError:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.ensure_future(self._abort_engine(pump)))
            raise
        metrics = self.server.metrics
        if ending is Ending.FINISHED:
            error = pump.exception()
            if error is None:
                return
            if not self.committed:  # whatever broke, the engine request must not outlive the turn
                metrics.engine_aborts.inc()
                await self.server.engine.abort(self.turn.engine_rid)
            if isinstance(error, _Gone):
                self.status = ClientDisconnectedError.status
                metrics.abort(AbortReason.DISCONNECT)
            elif isinstance(error, SessionError):
                count_failure(metrics, error)
                await self._fail(send, error)
            else:  # an invariant of ours: never a half-written success
                logger.error("session %s: streamed turn failed", self.claim.session.id, exc_info=error)
                await self._fail(send, InvariantError(f"internal error while streaming: {type(error).__name__}"))
            return
        await self._abort_engine(pump)
        if ending is Ending.DISCONNECTED:
            self.status = ClientDisconnectedError.status
            metrics.abort(AbortReason.DISCONNECT)
            return
        if ending is Ending.ABORTED:
            err = self.claim.abort_error()
            assert err is not None  # the race ends ABORTED only once the claim has a reason
        else:
            err = tag_abort(EngineTimeoutError(
                f"engine did not finish within {self.server.config.request_timeout:g}s; request aborted"),
                AbortReason.TIMEOUT)
        count_failure(metrics, err)
        await self._fail(send, err)

    async def _abort_engine(self, pump: asyncio.Future[Any]) -> None:
        """Abort by rid, then drop the engine stream (closing it is a disconnect the engine also acts on)."""
        if pump.done():
            if not pump.cancelled():
                pump.exception()
            return
        drains = self.server.drains
        if drains is not None:  # the engine ends it in the background; the client and the slot do not wait
            self._abandoned = True
            drains.start(self.claim.session.id, self.turn.engine_rid, pump, self.claim.lane)
            return
        self.server.metrics.engine_aborts.inc()
        await self.server.engine.abort(self.turn.engine_rid)
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

    async def _events(self, send: Send, events: Sequence[bytes]) -> None:
        if events:
            await self._send(send, {"type": "http.response.body", "body": b"".join(events), "more_body": True})

    async def _start(self, send: Send) -> None:
        if self.started:
            return
        self.started = True
        headers = SSE_HEADERS + [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                 for k, v in self.turn.headers.items()]
        await self._send(send, {"type": "http.response.start", "status": 200, "headers": headers})
        await self._events(send, self.format.start())

    async def _fail(self, send: Send, err: SessionError) -> None:
        """Before the first byte: the error as its own status. After: an error event ends the stream."""
        self.status = err.status
        self._settle()
        try:
            if not self.started:
                response = self.api.error(err)
                await self._send(send, {"type": "http.response.start", "status": response.status_code,
                                        "headers": response.raw_headers})
                await self._send(send, {"type": "http.response.body", "body": response.body})
                return
            await self._events(send, self.format.error(err))
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except _Gone:
            pass

    async def _passthrough(self, send: Send, status: int, content_type: bytes, body: bytes) -> None:
        """The engine's own error, before the first byte: unrecorded, as the API passes an engine refusal on (Chat
        Completions as it came; another API in its own error shape)."""
        response = self.api.error(EngineRefusedError(status, body, content_type.decode("latin-1")))
        self.status = response.status_code
        self._settle()
        await self._send(send, {"type": "http.response.start", "status": response.status_code,
                                "headers": response.raw_headers})
        await self._send(send, {"type": "http.response.body", "body": response.body})

    # -- the engine stream ----------------------------------------------------------------------------------------

    async def _pump(self, send: Send) -> None:
        """The engine stream, then the commit; after an abort by the engine for everyone, the continuation's stream
        (resume.py), whose events go on where the aborted one's stopped."""
        payload = self.payload
        while True:
            final = await self._engine_stream(send, payload)
            if final is None:
                return
            try:
                await self._finish(send, final)
                return
            except EngineAbortedError as aborted:
                payload = await continue_turn(self.server, self.turn, self.continuation, aborted)
                self.claim.raise_if_aborted()
                if self._abandoned:
                    raise _Gone("the turn ended while the engine aborted it; nothing is continued") from None
                assert self.continuation.before is not None
                await self._catch_up(send, self.continuation.before)

    async def _engine_stream(self, send: Send, payload: bytes) -> bytes | None:
        """One engine request's events, sent on as they come; its final event's raw body, or None when the engine's
        own error ended the turn (passed through before the first byte)."""
        config = self.server.config
        async with self.server.engine.stream_generate(payload, self.claim.session.id) as engine:
            if not 200 <= engine.status_code < 300:  # the engine's own error: pass it through, unrecorded
                content_type = engine.headers.get("content-type", "application/json")
                body = await engine.aread()
                if self.started:  # a continuation refused after the reply began: an error event
                    raise EngineRefusedError(engine.status_code, body, content_type)
                await self._passthrough(send, engine.status_code, content_type.encode("latin-1"), body)
                return None
            try:
                reads = engine.aiter_pieces() if isinstance(engine, EngineStream) else reads_of(engine.aiter_bytes())
                async for event in engine_events(reads, config.engine_incremental_streaming,
                                                 self.logprobs, config.stream_coalesce_ms / 1000):
                    if isinstance(event, Final):
                        return event.raw
                    await self._progress(send, event)
            except EngineError as failed:
                await self._engine_error(send, failed)
                return None
        raise InvariantError("the engine stream ended without its final event")  # engine_events raises first

    async def _engine_error(self, send: Send, failed: EngineError) -> None:
        error = failed.error
        if self.started:
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise UpstreamError(f"engine failed mid-stream: {message}", rule="stream_error")
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 400
        await self._passthrough(send, status, b"application/json", failed.raw)

    async def _progress(self, send: Send, progress: Progress) -> None:
        """What a batch of intermediate events adds: send whatever it settles, as one chunk. Not yet validated, so
        only what the final, validated event is later checked against (text deltas, logprobs of new tokens) is taken
        from it."""
        if self._abandoned:  # the engine drain owns the request now: read on until the engine ends it, send nothing
            return
        await self._send_new(send, progress.text, self._new_tokens(progress.logprobs, progress.top_logprobs))

    async def _send_new(self, send: Send, text: str, tokens: NewTokens | None) -> None:
        delta = self.tracker.extend(text)
        self._text_seen += len(text)
        if delta is None and tokens is None:
            return
        await self._start(send)
        await self._events(send, self.format.delta(delta, tokens))

    async def _catch_up(self, send: Send, partial: GenerateResult) -> None:
        """Before a continuation's events: what the aborted request's last event added (its text and tokens were
        not sent as progress), so the continuation's text and logprobs follow on exactly."""
        n = len(self.lp_sent)
        tokens = None
        if self.logprobs and not self._lp_broken and n < len(partial.output_ids):
            top = partial.top_logprobs[n:] if partial.top_logprobs is not None else None
            tokens = NewTokens(partial.output_ids[n:], partial.logprobs[n:], top)
            self.lp_sent.extend(tokens.logprobs.tolist())
        await self._send_new(send, partial.text[self._text_seen:], tokens)

    def _new_tokens(self, fresh: list[Any] | None, rows: list[Any] | None) -> NewTokens | None:
        """The new tokens' logprobs, if the entries are sound (else they are left to the final, validated event,
        and so is every later token: the logprobs sent must stay a prefix of the final ones)."""
        if not self.logprobs or not fresh or self._lp_broken:
            return None
        try:
            values = np.asarray([float(e[0]) for e in fresh], dtype=np.float32)
            ids = np.asarray([int(e[1]) for e in fresh], dtype=np.int64)
        except (TypeError, ValueError, IndexError):
            self._lp_broken = True
            return None
        if not np.isfinite(values).all() or (len(ids) and (ids.min() < 0 or ids.max() >= self.family.vocab_size)):
            self._lp_broken = True
            return None
        top = None
        if self.turn.request.top_logprobs and rows is not None and len(rows) == len(fresh):
            try:
                top = [[(float(a[0]), int(a[1])) for a in (row or ())] for row in rows]
            except (TypeError, ValueError, IndexError):
                self._lp_broken = True
                return None
            if any(not 0 <= t < self.family.vocab_size for row in top for _, t in row):
                self._lp_broken = True
                return None
        self.lp_sent.extend(values.tolist())
        return NewTokens(ids, values, top)

    async def _finish(self, send: Send, raw: bytes) -> None:
        server, claim, turn = self.server, self.claim, self.turn
        self.engine_seconds = time.perf_counter() - self.t_start
        t0 = time.perf_counter()
        split = split_routed_experts(raw)
        out: TurnOutput = await server.pool.run_decode(
            len(split[0]), decode_turn, raw, self.family, turn.rid, turn.request.parse_tool_calls, split,
            server.config.retry_after, turn.plan, self.continuation.before,
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
            raise _Gone("the turn ended before the engine finished; nothing is committed")
        await commit_output(server, claim, turn.plan, out)
        self.committed = True
        tail = None
        n = len(sent)
        if self.logprobs and n < len(result.output_ids):
            top = result.top_logprobs[n:] if result.top_logprobs is not None else None
            tail = NewTokens(result.output_ids[n:], result.logprobs[n:], top)
        await self._start(send)
        await self._events(send, self.format.finish(out, rest, tail))
        self._settle()
        await self._send(send, {"type": "http.response.body", "body": self.format.end(), "more_body": False})
