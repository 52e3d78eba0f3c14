"""A streamed turn (`stream: true`), whatever API carried it: the engine call's events in (engine_call.py), the front
end's events out, as the engine produces them; committed only at the end, as a plain turn is.

Everything on the engine side -- the race, continuation, reopening a lost engine session, the strict decode, the
commit, the metrics -- is the engine call's, the same code as a plain turn's. What is left here is what only a
stream has: each batch of engine events becomes deltas (reasoning, content, whole tool calls; the new tokens'
logprobs when the front end wants them), computed by deltas.DeltaTracker so they can never contradict the final
parse, and checked against the final reply before the commit; then the front end's closing events. After an abort
by the engine for everyone (a weight update) the stream simply goes on: what the aborted request's last event added
is sent first, then the continuation's events.

Failure rules: before the first byte to the agent, errors keep their real status, in the front end's shape (the
engine's own refusal passes through unrecorded, as a plain turn's; validation 502, abort 503, ...). After it, the
stream ends with the front end's error event (an engine refusal then is a 502 `stream_error`) and nothing is
committed. A client gone (or a DELETE, pause, shutdown, the request timeout) ends the engine call as it ends a plain
one; the slot is released once, before the stream's last bytes. Failures are counted exactly as a plain turn's
(engine_call.count_failure).

Why a response object that owns the gate claim: the stream outlives the route handler (Starlette calls the response
after the handler returns), and the slot must stay taken until the last byte, so the handler hands its claim over.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np
from starlette.types import Receive, Scope, Send

from session_server.engine.chunker import Progress
from session_server.engine.reader import Tokens
from session_server.errors import AbortReason, EngineRefusedError, engine_message
from session_server.http.disconnect import disconnects
from session_server.turns.deltas import DeltaTracker, StreamDivergedError
from session_server.turns.engine_call import EngineCall, count_failure
from session_server.turns.output import TurnOutput, call_id_prefix
from session_server.turns.turn import NewTokens
from trajectory import GenerateResult
from trajectory.errors import InvariantError, SessionError, UpstreamError

logger = logging.getLogger("session_server.turns.stream")

R = TypeVar("R")
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Gone(Exception):
    """The agent's connection is gone (a send failed)."""


class StreamedTurn(Generic[R]):
    """The ASGI response of one streamed turn (the engine call's Listener); owns the gate claim from the handler's
    return to its last byte."""

    def __init__(self, call: EngineCall[R]) -> None:
        turn = call.turn
        self.call = call
        self.turn = turn
        self.api = call.api
        self.format = call.api.stream(turn)
        self.family = turn.family
        self.tracker = DeltaTracker(turn.family, call_id_prefix(turn.rid), turn.request.parse_tool_calls,
                                    opening=turn.plan.reply_opening, tools=turn.plan.tools)
        self.logprobs = call.api.wants_logprobs(turn.request.api)
        self.started = False  # response headers sent: from here on, failures are error events
        self.lp_sent: list[np.ndarray] = []  # the logprobs sent, in order (float32, as the engine's were validated)
        self._lp_count = 0
        self._settled = False
        self._text_seen = 0  # characters of reply text handed to the tracker, over every engine request
        self._send: Send | None = None

    # -- ASGI -----------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        try:
            await self._run(scope, receive)
        finally:
            self._settle()

    def _settle(self) -> None:
        """Engine-session books and the slot, once; called before the last bytes go out, so an agent that reacts to
        the stream's end (or to an error event) with its next request never meets its own finished turn in the
        gate."""
        if self._settled:
            return
        self._settled = True
        self.call.close()
        self.call.claim.release()

    async def _run(self, scope: Scope, receive: Receive) -> None:
        metrics = self.call.server.metrics
        try:
            out, _ = await self.call.reply(disconnects(scope, receive), self)
            rest, tail = self._closing(out)
            await self.call.commit(out)
        except _Gone:
            metrics.abort(AbortReason.DISCONNECT)
            return
        except SessionError as err:
            if self.started and isinstance(err, EngineRefusedError):  # a continuation refused after the reply began
                err = UpstreamError(f"engine failed mid-stream: {engine_message(err.body)}", rule="stream_error")
            count_failure(metrics, err)
            self.call.claim.session.record_failure(err)
            if err.abort_reason is not AbortReason.DISCONNECT:  # else nobody is left to tell
                await self._fail(err)
            return
        except Exception as exc:  # an invariant of ours: never a half-written success
            logger.error("session %s: streamed turn failed", self.call.claim.session.id, exc_info=exc)
            await self._fail(InvariantError(f"internal error while streaming: {type(exc).__name__}"))
            return
        try:
            await self._start()
            await self._events(self.format.finish(out, rest, tail))
            self._settle()
            await self._send_message({"type": "http.response.body", "body": self.format.end(), "more_body": False})
        except _Gone:
            pass  # committed: the agent left after its turn was whole

    def _closing(self, out: TurnOutput) -> tuple[dict[str, Any] | None, NewTokens | None]:
        """What the final reply adds to what was streamed (deltas, logprobs), once it is checked to extend it."""
        result = out.result
        try:
            rest = self.tracker.finish(out.message)
        except StreamDivergedError as exc:
            raise InvariantError(f"streamed deltas disagree with the final reply: {exc}") from exc
        sent = np.concatenate(self.lp_sent) if self.lp_sent else np.zeros(0, dtype=np.float32)
        if not np.array_equal(sent, result.logprobs[: len(sent)]):
            raise UpstreamError("engine stream logprobs changed between events", rule="stream_logprobs")
        tail = None
        n = len(sent)
        if self.logprobs and n < len(result.output_ids):
            top = result.top_logprobs[n:] if result.top_logprobs is not None else None
            tail = NewTokens(result.output_ids[n:], result.logprobs[n:], top)
        return rest, tail

    # -- sending --------------------------------------------------------------------------------------------------

    async def _send_message(self, message: dict[str, Any]) -> None:
        assert self._send is not None
        try:
            await self._send(message)
        except Exception as exc:  # uvicorn raises once the client is gone
            raise _Gone(str(exc)) from exc

    async def _events(self, events: Sequence[bytes]) -> None:
        if events:
            await self._send_message({"type": "http.response.body", "body": b"".join(events), "more_body": True})

    async def _start(self) -> None:
        if self.started:
            return
        self.started = True
        headers = SSE_HEADERS + [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                 for k, v in self.turn.headers.items()]
        await self._send_message({"type": "http.response.start", "status": 200, "headers": headers})
        await self._events(self.format.start())

    async def _fail(self, err: SessionError) -> None:
        """Before the first byte: the error as its own status, in the front end's shape (the engine's own refusal as
        it came, for Chat Completions). After: an error event ends the stream."""
        self._settle()
        try:
            if not self.started:
                response = self.api.error(err)
                await self._send_message({"type": "http.response.start", "status": response.status_code,
                                          "headers": response.raw_headers})
                await self._send_message({"type": "http.response.body", "body": response.body})
                return
            await self._events(self.format.error(err))
            await self._send_message({"type": "http.response.body", "body": b"", "more_body": False})
        except _Gone:
            pass

    # -- the engine call's events (engine_call.Listener) ------------------------------------------------------------

    async def progress(self, progress: Progress) -> None:
        """What a batch of intermediate events adds: whatever it settles, one front-end chunk per chunk of it
        (`progress.cuts`, engine/chunker.py), all in one write. Its logprob entries come validated (engine/reader.py);
        the text and the logprobs sent are checked against the final event before the commit."""
        tokens = self._new_tokens(progress.tokens)
        if progress.cuts is None or len(progress.cuts) == 1:
            await self._send_new(progress.text, tokens)
            return
        events: list[bytes] = []
        chars = count = 0
        for end, upto in progress.cuts:
            piece = progress.text[chars:end]
            delta = self.tracker.extend(piece)
            self._text_seen += len(piece)
            some = None
            if tokens is not None and upto > count:
                some = NewTokens(tokens.ids[count:upto], tokens.logprobs[count:upto],
                                 tokens.top[count:upto] if tokens.top is not None else None)
            if delta is not None or some is not None:
                events += self.format.delta(delta, some)
            chars, count = end, upto
        if events:
            await self._start()
            await self._events(events)

    async def resumed(self, before: GenerateResult) -> None:
        """Before a continuation's events: what the aborted request's last event added (its text and tokens were
        not sent as progress), so the continuation's text and logprobs follow on exactly."""
        n = self._lp_count
        tokens = None
        if self.logprobs and n < len(before.output_ids):
            top = before.top_logprobs[n:] if before.top_logprobs is not None else None
            tokens = self._new_tokens(Tokens(before.output_ids[n:], before.logprobs[n:], top))
        await self._send_new(before.text[self._text_seen:], tokens)

    async def _send_new(self, text: str, tokens: NewTokens | None) -> None:
        delta = self.tracker.extend(text)
        self._text_seen += len(text)
        if delta is None and tokens is None:
            return
        await self._start()
        await self._events(self.format.delta(delta, tokens))

    def _new_tokens(self, tokens: Tokens | None) -> NewTokens | None:
        """The new tokens for the front end, when it wants logprobs; recorded, so the final event can be checked to
        extend what was sent."""
        if not self.logprobs or tokens is None or not len(tokens):
            return None
        self.lp_sent.append(tokens.logprobs)
        self._lp_count += len(tokens)
        return NewTokens(tokens.ids, tokens.logprobs, tokens.top if self.turn.request.top_logprobs else None)
