"""The engine side of one turn, plain or streamed: one object owns all of it, so every rule below holds for both.

    wait for the session's previous, aborted engine request to end  ->  open (or reuse) the engine session
    ->  encode the payload  ->  each engine request raced against the client, the claim and the turn's deadline
        - the engine lost the engine session (restarted, or its idle timeout closed it): reopen it, resend, once
        - the engine aborted the request for everyone (a weight update): go on in a new request (resume.py)
    ->  the strict decode (routed experts cut off first)  ->  the commit  ->  the turn's metrics

A plain turn asks the engine for one reply (`/generate`) and has the front end's reply built in the same step as the
decode; a streamed one asks for the engine's events and hands each batch to its `Listener` (stream.py, which only
turns them into the front end's bytes). Every way out of a race that is not an engine request that ended aborts the
request by rid -- in the background (engine/drains.py), so neither the agent's answer nor the slot waits for the
engine -- and commits nothing; a turn that reached the engine and committed nothing leaves its engine session dirty
(the next turn starts a fresh one). The deadline is --request-timeout counted from the claim: the total the client
waits, over all of the turn's engine requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from session_server.engine.adapters import adapter_cache_key
from session_server.engine.chunker import Chunker
from session_server.engine.drains import abandon
from session_server.engine.http11 import EngineStream
from session_server.engine.pacing import stream_interval
from session_server.engine.sessions import engine_session_gone
from session_server.engine.sse import EngineError, Final, Progress, engine_events, reads_of
from session_server.engine.versions import version_lag
from session_server.engine.wire import GenerateRequest, encode_generate, split_routed_experts
from session_server.errors import (
    AbortReason,
    ClientDisconnectedError,
    EngineAbortedError,
    EngineRefusedError,
    EngineTimeoutError,
    LimitExceededError,
    tag_abort,
)
from session_server.http.disconnect import Disconnects
from session_server.metrics import Metrics
from session_server.sessions.session import Claim
from session_server.state import ServerState
from session_server.turns.commit import commit_turn
from session_server.turns.output import TurnOutput, decode_turn
from session_server.turns.race import Ending, race
from session_server.turns.resume import Continuation
from session_server.turns.sampling_masks import support_overflow
from session_server.turns.turn import FrontEnd, Turn, new_rid
from trajectory import GenerateResult, TurnRecord
from trajectory.continuation import WEIGHTS_CHANGED
from trajectory.errors import InvariantError, RequestValidationError, SessionError, UpstreamError

logger = logging.getLogger("session_server.turns.engine_call")

R = TypeVar("R")


class Listener(Protocol):
    """What a streamed turn does with the engine's events as they come (a plain turn has none)."""

    logprobs: bool  # whether the events' new tokens' logprob entries are wanted

    async def progress(self, progress: Progress) -> None: ...  # what a batch of intermediate events adds

    async def resumed(self, before: GenerateResult) -> None:  # before a continuation's first event: all sampled so far
        ...


class _Abandoned(Exception):
    """An engine request handed to the drains ended: what it sent is nobody's (never decoded, never committed)."""


def client_gone() -> SessionError:
    """What a turn whose client went away ends with (the engine request aborted, nothing committed)."""
    return tag_abort(ClientDisconnectedError("client disconnected during the chat; engine request aborted"),
                     AbortReason.DISCONNECT)


def count_failure(metrics: Metrics, err: SessionError) -> None:
    """A turn that ended in an error, counted once by what it was: an abort by its reason, a refused limit, an engine
    reply that broke a rule. Every other error is counted only as its response."""
    reason = err.abort_reason
    if reason is not None:
        metrics.abort(reason)
    elif isinstance(err, LimitExceededError):
        metrics.refused(err.limit)
    elif isinstance(err, UpstreamError):
        metrics.validation_failure(err.rule)


def decode_and_reply(
    body: bytes, split: tuple[bytes, memoryview | None], turn: Turn[R],
    reply: Callable[[Turn[R], TurnOutput], bytes] | None, retry_after: int, before: GenerateResult | None = None,
    version: str | None = None,
) -> tuple[TurnOutput, bytes | None]:
    """The strict decode (continuing `before`; tokens of other weights than `version` cut off) and, for a plain turn,
    the front end's reply: one step on the pool (or inline, by size)."""
    out = decode_turn(body, turn.family, turn.rid, turn.request.parse_tool_calls, split, retry_after, turn.plan,
                      before, turn.request.sampling_mask_bound, version)
    return out, reply(turn, out) if reply is not None else None


class _Finish(msgspec.Struct):
    finish_reason: Any = None


class _FinalMeta(msgspec.Struct):
    meta_info: _Finish | None = None


_final_meta = msgspec.json.Decoder(_FinalMeta).decode
_error_body = msgspec.json.Encoder().encode


def refused_in_stream(raw: bytes) -> EngineRefusedError | None:
    """SGLang's refusal of a streamed request it had accepted (a session that does not exist, a bad value found by
    the scheduler): a final event, HTTP 200, whose abort carries the `status_code` a plain request is answered with
    (tokenizer_manager.py `_handle_abort_finish_reason`; a plain one gets that status and `{"error": {"message"}}`).
    As that refusal, so the two modes treat it alike; None for any other final event (an abort of everything, e.g.
    a weight update, has no status code)."""
    if b'"status_code"' not in raw:  # memmem: nearly every final event stops here
        return None
    try:
        meta = _final_meta(raw).meta_info
    except msgspec.DecodeError:
        return None  # the strict decode says what is wrong with it
    finish = meta.finish_reason if meta is not None else None
    status = finish.get("status_code") if isinstance(finish, dict) else None
    if (not isinstance(finish, dict) or finish.get("type") != "abort" or not isinstance(status, int)
            or isinstance(status, bool) or not 400 <= status < 600):
        return None
    message = finish.get("message")
    return EngineRefusedError(status, _error_body({"error": {"message": str(message)}}), "application/json")


def _refusal(failed: EngineError) -> EngineRefusedError:
    """An `{"error": ...}` event as the engine's refusal (SGLang streams a refused request as HTTP 200 and one error
    event): the status its `code` names, else 400."""
    error = failed.error
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 400
    return EngineRefusedError(status, failed.raw, "application/json")


class EngineCall(Generic[R]):
    """The engine side of one prepared turn: `open`, then `reply` (raced, continued, reopened, decoded), then
    `commit`; `close` once the turn is over, committed or not, before its slot is released."""

    def __init__(self, server: ServerState, claim: Claim, turn: Turn[R], api: FrontEnd[R]) -> None:
        self.server = server
        self.claim = claim
        self.turn = turn
        self.api = api
        # The session's first segment keeps an SGLang streaming session (--engine-sessions); other segments send their
        # whole prompt, as a streaming session holds one history and takes one request at a time.
        self.sessions = server.engine_sessions if not claim.segment else None
        self.continuation = Continuation(server.config.max_turn_continuations)
        self.listener: Listener | None = None
        self.rid = turn.rid  # the engine request running now (what an abort names): a new one per continuation
        self.start = 0  # the first prompt index sent: past what the engine session holds
        self.session_params: dict[str, Any] | None = None
        self.payload = b""
        self.engine_seconds = 0.0  # over every engine request of the turn
        self.committed = False
        self.abandoned = False  # an engine request was handed to the drains: nothing more of it reaches the agent
        self._sent = False  # a request reached the engine (its engine session may hold what it ran)
        self._running = False  # a streamed request whose end the engine has not sent yet
        self._reopened = False
        self._resumed: GenerateResult | None = None  # what a streamed continuation hands its listener first
        # The weights the request running now is keyed for (engine/versions.py), and those of the turn's first request
        # (--max-staleness counts from it).
        self.version = ""
        self.cache_key = ""  # the `extra_key` of the request sent last (engine/versions.py)
        self.start_version: str | None = None

    # -- before the first request -----------------------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left of the turn's --request-timeout, counted from the claim: the total the client waits."""
        return self.claim.started + self.server.config.request_timeout - time.monotonic()

    def _timed_out(self, what: str, then: str) -> SessionError:
        """The turn's deadline passed (one text for every mode and stage: `what` did not happen, `then` followed)."""
        return tag_abort(EngineTimeoutError(
            f"{what} within the request timeout ({self.server.config.request_timeout:g}s); {then}"),
            AbortReason.TIMEOUT)

    async def open(self) -> None:
        """Everything before the turn's first byte reaches the engine: the session's previous, aborted engine request
        has ended (so the engine never runs two of one session at once, and a streaming session is free again), the
        engine session is opened or reused, and the payload is encoded."""
        if self.turn.plan.images and self.sessions is not None:  # an append-only engine session takes no image_data
            raise RequestValidationError("images need the whole prompt sent each turn: this server runs with "
                                         "--engine-sessions, which sends only new tokens")
        drains = self.server.drains
        if drains is not None and drains.pending(self.claim.lane) is not None:
            if not await drains.settle(self.claim.lane, self.remaining()):
                raise self._timed_out("the session's previous engine request did not end", "nothing was sent")
            self.claim.raise_if_aborted()
        await self._open_session()
        self.payload = await self._encode()

    async def _open_session(self) -> None:
        self.start, self.session_params = 0, None
        if self.sessions is not None:
            self.start, self.session_params = await self.sessions.begin_turn(
                self.claim.session.id, self.turn.plan.new_token_start, self.remaining(), self.claim.on_abort)
            self.claim.raise_if_aborted()

    def _request(self) -> GenerateRequest:
        """The request to send now (`self.rid`): the prompt past `self.start`; after an engine abort, the prompt + the
        tokens sampled so far (resume.py). The one place a turn's engine request is built."""
        server, config, request, plan = self.server, self.server.config, self.turn.request, self.turn.plan
        prompt, params = self.continuation.request(plan.prompt_ids, request.sampling_params)
        vision = server.family.vision
        self.version = server.engine.version_of(self.claim.session.id)
        self.cache_key = server.engine.cache_key_of(self.claim.session.id, self.version)
        if self.start_version is None:
            self.start_version = self.version
        return GenerateRequest(
            input_ids=prompt, start=self.start, sampling_params=params, rid=self.rid,
            session_params=self.session_params, stream=request.stream,
            stream_interval=stream_interval(config.engine_stream_interval, config.engine_incremental_streaming,
                                            params.get("max_new_tokens"), server.prompt_token_limit),
            top_logprobs=request.top_logprobs, routed_experts=config.return_routed_experts,
            routed_experts_start=plan.routed_experts_start,
            thinking=server.family.thinking_mode(request.template_kwargs),
            images=plan.images, image_pad=vision.tokens.pad if vision is not None else -1,
            sampling_masks=request.sampling_mask_bound is not None,
            extra_key=adapter_cache_key(self.cache_key, self.turn.adapter),
            lora_path=self.turn.adapter.engine_name if self.turn.adapter is not None else None,
            input_json=plan.wire_ids if prompt is plan.prompt_ids else None,
        )

    async def _encode(self) -> bytes:
        """The /generate body of the request to send now, on the pool when large."""
        generate = self._request()
        return await self.server.pool.run_sized(generate.size, encode_generate, generate)

    # -- the engine requests ----------------------------------------------------------------------------------------

    async def reply(self, client: Disconnects, listener: Listener | None = None) -> tuple[TurnOutput, bytes | None]:
        """The turn's output once its reply is whole, and for a plain turn (no `listener`) the front end's reply
        bytes. A streamed turn's `listener` gets the engine's events as they come."""
        self.listener = listener
        while True:
            try:
                return await self._race(client)
            except EngineAbortedError as aborted:
                await self._go_on(aborted)
            except EngineRefusedError as refused:
                await self._reopen(refused)

    async def _go_on(self, aborted: EngineAbortedError) -> None:
        """After an abort by the engine for everyone, or a reply cut where its weights changed (turns/output.py): the
        next request, or `aborted` when the turn cannot go on. A reply cut by a pause for a weight update goes on once
        the pause is over, under the new weights' cache key (sessions/pause.py)."""
        server, params = self.server, self.turn.request.sampling_params
        # Only a plain turn's reply is cut where its weights changed (decode's `version` is None for a streamed one:
        # what the agent was streamed cannot be taken back).
        cut = aborted.partial is not None and aborted.partial.finish_reason.get("message") == WEIGHTS_CHANGED
        result = self.continuation.go_on(params, aborted)
        self._count_continuation("recomputed" if cut and result == "continued" else result)
        if result != "continued":
            raise aborted
        pause = server.lifecycle.pause
        if pause.in_place and pause.cut_replies:
            if not await pause.wait_running(self.remaining()):
                raise self._timed_out("the pause for a weight update did not end", "the turn was not continued")
        elif not cut:  # an abort of everything the server did not ask for: a weight update it was not told of?
            await server.engine.refresh_version(self.claim.session.id)
        self.claim.raise_if_aborted()
        await self._bound_staleness(aborted)
        before = self.continuation.before
        old, self.rid = self.rid, new_rid()
        logger.info("turn %s: the engine aborted %s after %d tokens (%r); continuing as %s", self.turn.rid, old,
                    len(before.output_ids) if before is not None else 0, aborted.partial and
                    aborted.partial.finish_reason.get("message"), self.rid)
        if self.sessions is not None and server.engine.version_of(self.claim.session.id) != self.version:
            self.sessions.mark_dirty(self.claim.session.id)  # its KV is of the old weights: a fresh one, whole prompt
            await self._open_session()
        self.payload = await self._encode()
        self.claim.raise_if_aborted()
        self._resumed = before if self.listener is not None else None

    async def _bound_staleness(self, aborted: EngineAbortedError) -> None:
        """--max-staleness: a turn begun more than K versions before the weights it would go on under is sampled
        again from its prompt (--stale-turns regenerate; the tokens sampled so far are dropped), or refused (503)."""
        config = self.server.config
        if config.max_staleness < 0 or self.start_version is None:
            return
        now = self.server.engine.version_of(self.claim.session.id)
        if version_lag(self.start_version, now) <= config.max_staleness:
            return
        if config.stale_turns == "refuse" or self.listener is not None:
            self._count_continuation("stale")
            raise tag_abort(EngineAbortedError(
                f"the turn began under weights {self.start_version!r}, more than --max-staleness "
                f"{config.max_staleness} versions before {now!r}; retry the same turn", config.retry_after,
                aborted.partial), AbortReason.STALE) from None
        self._count_continuation("regenerated")
        self.continuation.before = None
        self.start_version = now

    def _count_continuation(self, result: str) -> None:
        """What followed an engine abort of the turn: in the server's metrics and in its session's own counts."""
        self.server.metrics.continuation(result)
        self.claim.session.count_continuation(result)

    async def _reopen(self, refused: EngineRefusedError) -> None:
        """The engine lost the engine session (restarted, or its idle timeout closed it): the request never ran there.
        Reopen it and resend the whole prompt, once; the agent never sees the engine's 400. Any other refusal is
        the agent's, as the engine gave it."""
        if (self.sessions is None or self._reopened
                or not engine_session_gone(refused.engine_status, refused.body)):
            raise refused
        self._reopened = True
        session_id = self.claim.session.id
        logger.info("session %s: engine session gone (%r); reopening", session_id, refused.body[:120])
        self.server.metrics.engine_session_reopens.inc()
        self.sessions.forget(session_id)
        self.claim.raise_if_aborted()
        # Under a new rid: SGLang ends the refused stream's response with an abort of its rid (http_server.py
        # `create_abort_task`), which would otherwise land on the resent request (seen on 0.5.23).
        self.rid = new_rid()
        await self._open_session()
        self.payload = await self._encode()

    async def _race(self, client: Disconnects) -> tuple[TurnOutput, bytes | None]:
        """One engine request raced against the client, the claim and the deadline (race.py)."""
        self._sent = True
        work = asyncio.ensure_future(self._generate() if self.listener is None else self._stream())
        try:
            ending = await race(work, client, self.claim, self.remaining())
        except asyncio.CancelledError:
            self._abandon(work)  # the handler itself is cancelled (shutdown): the request is still aborted
            raise
        if ending is Ending.FINISHED:
            if self._running and work.exception() is not None:
                # A stream that broke before the engine ended it (the agent gone, an event not SGLang's): its
                # connection is closed, and the request is aborted by rid as well.
                self._running = False
                self.server.metrics.engine_aborts.inc()
                await self.server.engine.abort(self.rid, self.claim.session.id)
            return work.result()
        self._abandon(work)
        if ending is Ending.DISCONNECTED:
            raise client_gone()
        if ending is Ending.ABORTED:
            err = self.claim.abort_error()
            assert err is not None  # the race ends ABORTED only once the claim has a reason
            raise err
        raise self._timed_out("the engine did not finish", "request aborted")

    def _abandon(self, work: asyncio.Future[Any]) -> None:
        """Abort by rid and let the engine end the request in the background (engine/drains.py)."""
        self.abandoned = True
        abandon(self.server.drains, self.claim.session.id, self.rid, work, self.claim.lane)

    def _engine_time(self, started: float) -> None:
        seconds = time.perf_counter() - started
        self.engine_seconds += seconds
        self.server.metrics.engine(seconds)

    async def _generate(self) -> tuple[TurnOutput, bytes | None]:
        """A plain turn's request: the engine's reply, decoded, with the front end's reply built from it."""
        t0 = time.perf_counter()
        reply = await self.server.engine.generate(self.payload, self.claim.session.id)
        self._engine_time(t0)
        if self.abandoned:
            raise _Abandoned
        if not reply.ok:
            refused = EngineRefusedError(reply.status, reply.body, reply.content_type)
            raise support_overflow(refused) or refused
        return await self._decode(reply.body)

    async def _stream(self) -> tuple[TurnOutput, bytes | None]:
        """A streamed turn's request: its events handed to the listener as they come (none once the request is
        abandoned: it is read on until the engine ends it), then its final event decoded."""
        listener, config = self.listener, self.server.config
        assert listener is not None
        if self._resumed is not None:
            before, self._resumed = self._resumed, None
            await listener.resumed(before)
        t0 = time.perf_counter()
        async with self.server.engine.stream_generate(self.payload, self.claim.session.id) as engine:
            if not 200 <= engine.status_code < 300:
                content_type = engine.headers.get("content-type", "application/json")
                raise EngineRefusedError(engine.status_code, await engine.aread(), content_type)
            self._running = True
            reads = engine if isinstance(engine, EngineStream) else reads_of(engine.aiter_bytes())
            raw = None
            progressed = False
            try:
                chunker = Chunker(config.stream_chunk_tokens, config.stream_chunk_ms / 1000,
                                  asyncio.get_running_loop().time)
                async for event in engine_events(
                        reads, config.engine_incremental_streaming, listener.logprobs, config.stream_coalesce_ms / 1000,
                        chunker=chunker, vocab_size=self.turn.family.vocab_size,
                        event_tokens=stream_interval(config.engine_stream_interval, True, None, None)):
                    if isinstance(event, Final):
                        raw = event.raw
                        break
                    progressed = True
                    if not self.abandoned:
                        await listener.progress(event)
            except EngineError as failed:
                self._running = False
                raise _refusal(failed) from None
            self._running = False
        self._engine_time(t0)
        if self.abandoned:
            raise _Abandoned
        if raw is None:
            raise InvariantError("the engine stream ended without its final event")  # engine_events raises first
        refused = refused_in_stream(raw)
        if refused is not None and (overflow := support_overflow(refused)) is not None:
            raise overflow  # after streamed tokens too: not an abort to continue or retry
        if refused is not None and not progressed:
            raise refused
        return await self._decode(raw)

    async def _decode(self, body: bytes) -> tuple[TurnOutput, bytes | None]:
        """The strict decode (an engine abort raises EngineAbortedError, which `reply` may continue)."""
        t0 = time.perf_counter()
        # The cut is a memchr over the routed-experts megabytes (~0.1 ms); what is left to decode is what the pool-or-
        # inline choice should weigh, and it is usually small enough that a pool hop would cost more than the decode.
        split = split_routed_experts(body)
        config = self.server.config
        try:
            out = await self.server.pool.run_decode(
                len(split[0]), decode_and_reply, body, split, self.turn,
                self.api.reply if self.listener is None else None, config.retry_after, self.continuation.before,
                # A streamed reply's tokens reached the agent as they came: it is not cut (the key is corrected by
                # `_learn` for its next request); at an abort of everything SGLang may label a token the old weights
                # sampled with the new version, which would make every such stream a 503.
                self.version if config.straddled_replies == "recompute" and self.listener is None else None)
        except EngineAbortedError as aborted:
            if aborted.partial is not None:
                self._learn(aborted.partial)
            raise
        finally:
            self.server.metrics.stage("decode", time.perf_counter() - t0)
        self._learn(out[0].result)
        return out

    def _learn(self, result: GenerateResult) -> None:
        """A reply that names other weights than its request was keyed for: the engine serves those now, and the KV it
        kept under the request's key is of those weights, so that key is not reused (a reply naming the expected ones
        says nothing new, and one sent before a push may arrive after it)."""
        version = result.weight_version
        if version is not None and version != self.version:
            self.server.engine.learn_version(self.claim.session.id, version)
            self.server.engine.distrust_key(self.claim.session.id, self.version, self.cache_key)

    # -- after the reply --------------------------------------------------------------------------------------------

    async def commit(self, out: TurnOutput) -> TurnRecord:
        """The commit (journaled with --journal), the turn's metrics, and the engine session's books (it now holds
        exactly the trajectory)."""
        server, claim, plan = self.server, self.claim, self.turn.plan
        metrics = server.metrics
        claim.raise_if_aborted()
        t0 = time.perf_counter()
        assert claim.plan is not None and claim.plan.turn is plan  # bound by the pipeline before the engine call
        result = out.result
        adapter = self.turn.adapter
        if adapter is not None:  # the revision that sampled every token of the turn, on its record
            result = dataclasses.replace(result, adapter=adapter.name, adapter_revision=adapter.revision)
        record = await commit_turn(server, claim.session, claim.plan, result, out.message)
        self.committed = True
        metrics.stage("commit", time.perf_counter() - t0)
        if claim.plan.start is not None:
            metrics.segment_started(claim.plan.start.reason)
        metrics.turn_tokens(len(plan.prompt_ids), record.cached_tokens, record.completion_len)
        if plan.rolled_back:
            metrics.rollback(plan.rollback_reason or "retry")
        if self.sessions is not None:
            self.sessions.committed(claim.session.id, len(plan.prompt_ids) + len(out.result.output_ids))
        metrics.chat_done(time.monotonic() - claim.started, self.engine_seconds)
        return record

    def close(self) -> None:
        """Once the turn is over, before its slot is released: a turn that reached the engine and committed nothing
        may have left its tokens in the engine session, which no longer matches the trajectory."""
        if self.sessions is not None and self._sent and not self.committed:
            self.sessions.mark_dirty(self.claim.session.id)
