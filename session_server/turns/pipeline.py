"""One turn, whatever API carried it (the front end parses and formats; turn.py says how they meet):

    claim the slot (before the body is read)  ->  read the body  ->  parse + match a segment + prepare (pure)
    ->  bind the claim to the segment (409 if busy)  ->  encode (pooled if large)
    ->  engine call + decode WITHOUT the lock, raced against client disconnect, abort requests and the timeout
    ->  commit under the lock  ->  reply (or, with `stream: true`, stream.py from the engine call on)

Why no lock across the engine call: the gate already guarantees a single turn per segment -- the claim owner is the
segment's only writer -- and the lock only has to make each mutation atomic with respect to GET/samples/DELETE on
the same loop. Holding it across a multi-second engine call would make those readers wait for the engine, and a
cancelled holder could leave it taken. Prepare is pure and commit checks `version`, so nothing slips in unnoticed.

Every way out of the race that is not a finished engine call aborts the engine request by our rid and commits
nothing; the slot is released by the `finally` of the handler that owns it (or by the stream it was handed to),
exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from session_server.engine.sessions import engine_session_gone
from session_server.engine.wire import split_routed_experts
from session_server.errors import (
    AbortReason,
    ClientDisconnectedError,
    EngineAbortedError,
    EngineRefusedError,
    EngineTimeoutError,
    SessionBusyError,
    tag_abort,
)
from session_server.http import body as body_reader
from session_server.http.disconnect import disconnects
from session_server.sessions.session import Claim
from session_server.state import ServerState, server_of
from session_server.turns.limits import TurnLimits
from session_server.turns.output import TurnOutput, decode_turn
from session_server.turns.race import Ending, race
from session_server.turns.resume import Continuation, continue_turn
from session_server.turns.stream import StreamedTurn
from session_server.turns.turn import (
    FrontEnd,
    Turn,
    TurnRequest,
    commit_output,
    count_failure,
    encode_payload,
    engine_sessions_of,
    new_rid,
)
from trajectory import GenerateResult, SegmentPlan, SegmentSet
from trajectory.errors import SessionError
from trajectory.messages import Message

logger = logging.getLogger("session_server.turns.pipeline")

R = TypeVar("R")

NO_LIMITS = TurnLimits()
# Rendering + tokenizing a byte of a first turn vs decoding a byte of an appended turn's body (~0.25 us vs a few ns,
# measured here): with the default 64 KiB cut, first turns under 1 KiB run inline.
FIRST_TURN_BYTE_WEIGHT = 64
SETTLE_LOOP_TURNS = 16


@dataclass(slots=True)
class TurnTiming:
    """Seconds spent waiting for the engine and decoding its reply (filled in by `_generate`)."""

    engine: float = 0.0
    decode: float = 0.0


async def serve_turn(request: Request, session_id: str, api: FrontEnd[R]) -> Response:
    """One turn on the session `session_id`, however the request addressed it (URL path or header).

    Responses are counted by route and status in http/front_door.py; this counts what only a turn knows."""
    server = server_of(request)
    try:
        claim = await _claim(server, session_id)
    except SessionError as err:
        return api.error(err)
    started = time.perf_counter()
    timing = TurnTiming()
    handed_over = False  # a streamed reply takes the claim along and releases it after its last byte
    try:
        response = await _turn(server, claim, request, api, timing)
        handed_over = isinstance(response, StreamedTurn)
    except SessionError as err:
        count_failure(server.metrics, err)
        response = api.error(err)
    finally:
        if not handed_over:
            claim.release()
    if not handed_over and response.status_code == 200:
        server.metrics.chat_done(time.perf_counter() - started, timing.engine)
    return response


async def _claim(server: ServerState, session_id: str) -> Claim:
    """Claim the slot; on 409, first let the event loop run what is already pending, once.

    An agent that loses its connection and retries the same turn at once must not get 409 for its own dead request.
    The old connection's EOF reaches the loop no later than the retry's bytes (the client closed it first), but the
    old handler needs a few loop turns to see it (receive -> the disconnect watcher -> release). Those turns are run
    here -- a bounded number of `sleep(0)`, never a timed wait -- so a slot held by a chat whose client is already
    gone is free by the time the retry is decided; a slot held by a live chat still gets its immediate 409.
    """
    try:
        return server.lifecycle.claim(session_id)
    except SessionBusyError:
        for _ in range(SETTLE_LOOP_TURNS):
            await asyncio.sleep(0)
            session = server.registry.get(session_id)
            if session is None or not session.claims:
                break
        return server.lifecycle.claim(session_id)


async def _bind(server: ServerState, claim: Claim, plan: SegmentPlan) -> SegmentPlan:
    """Bind the claim to its segment (Lifecycle.bind); on 409, the same bounded settling as `_claim`: a retry of a
    turn whose client just vanished finds the segment free."""
    try:
        return server.lifecycle.bind(claim, plan)
    except SessionBusyError:
        for _ in range(SETTLE_LOOP_TURNS):
            await asyncio.sleep(0)
            if plan.segment not in claim.session.busy_segments():
                break
        return server.lifecycle.bind(claim, plan)


async def read_body(request: Request, limit: int, deadline: float) -> bytes:
    """body.read_body, with a vanished client counted as a disconnect abort."""
    try:
        return await body_reader.read_body(request, limit, deadline)
    except ClientDisconnectedError as err:
        raise tag_abort(err, AbortReason.DISCONNECT) from None


async def _read_body_or_abort(claim: Claim, request: Request, limit: int, deadline: float) -> bytes:
    """Read the body, but let DELETE/pause/shutdown interrupt a client that sends it slowly (or never).

    In the handler's own task rather than in a task of its own raced against the claim: the claim's abort cancels
    this task, which can only be waiting here for the client's bytes, and a body that has already arrived (almost
    every chat) is read without waiting at all -- no task, future or timer spent on it. read_body keeps the upload
    deadline itself.
    """
    claim.raise_if_aborted()  # from here on an abort can only come while the read waits (it cancels that wait)
    task = asyncio.current_task()
    assert task is not None
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    unsubscribe = claim.on_abort(interrupt)
    try:
        return await read_body(request, limit, deadline)
    except asyncio.CancelledError:
        if not interrupted or task.uncancel() > 0:
            raise  # cancelled by someone else as well (shutdown): that cancellation goes on
        claim.raise_if_aborted()
        raise
    finally:
        unsubscribe()


def prepare_turn(
    body: bytes, segments: SegmentSet, api: FrontEnd[R], limits: TurnLimits = NO_LIMITS,
    busy: Mapping[int, Message] | None = None,
) -> tuple[TurnRequest[R], SegmentPlan]:
    """Parse the request, match its segment and build the TITO prompt: the CPU work of a turn before the engine call.

    Runs in a worker thread without the session lock when it is large. Prepare only reads, and a plan built while
    another segment's turn commits on the loop is at worst stale: `Lifecycle.bind` refuses a plan whose segment
    moved since (409), and a commit checks the version again. Rendering the chat template and tokenizing are the most
    expensive steps of a turn; on the loop they would delay every other request, /health included.
    """
    family = segments.main.family
    turn = api.parse(body, segments.main)  # previous_response_id: resolved on the session's first segment
    limits.before_render(turn.messages, family, len(body))
    plan = segments.prepare(turn.messages, turn.tools, turn.template_kwargs, busy, turn.messages_json)
    limits.after_render(plan.turn, turn.sampling_params)
    return turn, plan


async def engine_payload(server: ServerState, claim: Claim, turn: Turn[Any]) -> bytes:
    """The /generate body of this turn, built in one place: the whole prompt, or with engine sessions only what the
    session's engine-side KV does not hold yet (which `begin_turn` opens or reopens as needed)."""
    turn.engine_start, turn.session_params = 0, None
    if engine_sessions_of(server, claim) is not None:
        assert server.engine_sessions is not None
        turn.engine_start, turn.session_params = await server.engine_sessions.begin_turn(
            claim.session.id, turn.plan.new_token_start, _remaining(server, claim))
        claim.raise_if_aborted()
    return await encode_payload(server, turn, turn.plan.prompt_ids, turn.request.sampling_params)


async def _turn(server: ServerState, claim: Claim, request: Request, api: FrontEnd[R], timing: TurnTiming) -> Response:
    session = claim.session
    metrics = server.metrics
    body = await _read_body_or_abort(claim, request, server.config.max_request_bytes, server.config.body_timeout)
    server.lifecycle.admit(claim)  # 503 if a pause began while the body was on its way
    # Work is sized by the body it parses (cpu_pool.py). A first turn renders and tokenizes every byte of its body
    # (tool schemas included), which costs far more per byte than decoding an appended turn's resent history, so
    # its bytes weigh FIRST_TURN_BYTE_WEIGHT times more: a short first turn runs inline (a pool hop would cost more
    # than it does), while one with a few tool schemas goes to the pool (run inline, a burst of those held the loop:
    # /health p99 89 ms under 64-chat waves of first turns with 8 tools).
    first = not session.trajectory.checkpoints
    cost = FIRST_TURN_BYTE_WEIGHT * len(body) if first else len(body)
    t0 = time.perf_counter()
    prepare = functools.partial(
        prepare_turn, body, session.segments, api,
        TurnLimits(server.prompt_token_limit, server.config.max_session_tokens), session.busy_segments(),
    )
    # A GRPO group's repeated first request with its ids kept: prepared here, no pool hop (repeated_first_turns.py),
    # if its parse is as small as what runs here anyway.
    on_loop = first and len(body) < server.pool.inline_below_bytes and server.family.first_turns.active
    prepared = server.first_turn_repeats.prepare(body, prepare) if on_loop else None
    if prepared is None:
        prepared = await server.pool.run_sized(cost, prepare)
    parsed, matched = prepared
    metrics.stage("prepare", time.perf_counter() - t0)
    if parsed.ignored:
        metrics.ignored(api.name, parsed.ignored)
    claim.raise_if_aborted()
    matched = await _bind(server, claim, matched)
    plan = matched.turn
    # The rid has a fixed length: no rid is a prefix of another (abort matches by prefix).
    turn = Turn(parsed, plan, new_rid(), parsed.model or server.family.name, server.family, matched)
    server.engine.place(session.id)  # its worker, or a healthy one if its worker failed (placement.py)
    # The session's previous, aborted engine request must have ended first (with engine sessions: left its
    # streaming session) -- once, before anything of this turn reaches the engine.
    await _settle_previous(server, claim)
    payload = await engine_payload(server, claim, turn)
    if parsed.stream:
        return StreamedTurn(server, claim, turn, payload, api)  # type: ignore[return-value]  # an ASGI response

    engine_sessions = engine_sessions_of(server, claim)
    committed = False
    continuation = Continuation(server.config.max_turn_continuations)
    try:
        try:
            out, reply = await _engine_reply(server, claim, request, turn, payload, api, timing, continuation)
        except EngineRefusedError as refused:
            if engine_sessions is None or not engine_session_gone(refused.engine_status, refused.body):
                raise
            # The engine lost the session (restarted, or its idle timeout closed it): the turn never ran there.
            # Reopen and resend the whole prompt once; the agent never sees the engine's 400.
            logger.info("session %s: engine session gone (%r); reopening", session.id, refused.body[:120])
            metrics.engine_session_reopens.inc()
            engine_sessions.forget(session.id)
            claim.raise_if_aborted()
            payload = await engine_payload(server, claim, turn)
            out, reply = await _engine_reply(server, claim, request, turn, payload, api, timing, continuation)
        metrics.stage("decode", timing.decode)
        claim.raise_if_aborted()
        await commit_output(server, claim, plan, out)
        committed = True
    finally:
        if engine_sessions is not None and not committed:
            engine_sessions.mark_dirty(session.id)
    return Response(reply, media_type="application/json", headers=turn.headers)


def _remaining(server: ServerState, claim: Claim) -> float:
    """Seconds left of the turn's --request-timeout, counted from the claim: the total the client waits."""
    return claim.started + server.config.request_timeout - time.monotonic()


async def _settle_previous(server: ServerState, claim: Claim) -> None:
    """Wait (bounded) until this session's previously aborted engine request has ended, so the engine never runs
    two requests of one session at once (engine/drains.py)."""
    if server.drains is None or server.drains.pending(claim.lane) is None:
        return
    if not await server.drains.settle(claim.lane, _remaining(server, claim)):
        raise tag_abort(EngineTimeoutError(
            f"the session's previous engine request was still being aborted after "
            f"{server.config.request_timeout:g}s; nothing was sent"), AbortReason.TIMEOUT)
    claim.raise_if_aborted()


def decode_and_reply(
    body: bytes, split: tuple[bytes, memoryview | None], turn: Turn[R], api: FrontEnd[R], retry_after: int,
    before: GenerateResult | None = None,
) -> tuple[TurnOutput, bytes]:
    """The strict decode and the front end's reply, in one step on the pool (or inline, by size)."""
    out = decode_turn(body, turn.family, turn.rid, turn.request.parse_tool_calls, split, retry_after, turn.plan,
                      before)
    return out, api.reply(turn, out)


async def _generate(
    server: ServerState, session_id: str, turn: Turn[R], payload: bytes, api: FrontEnd[R], timing: TurnTiming,
    before: GenerateResult | None,
) -> tuple[TurnOutput, bytes]:
    """The engine call, the strict decode of its reply (continuing `before`) and the reply; the engine's own error
    is EngineRefusedError, an abort on its side EngineAbortedError (resume.py may continue the turn)."""
    t0 = time.perf_counter()
    reply = await server.engine.generate(payload, session_id)
    t1 = time.perf_counter()
    timing.engine = t1 - t0
    server.metrics.engine(timing.engine)
    if not reply.ok:
        raise EngineRefusedError(reply.status, reply.body, reply.content_type)
    # The cut is a memchr over the routed-experts megabytes (~0.1 ms); what is left to decode is what the pool-or-
    # inline choice should weigh, and it is usually small enough that a pool hop would cost more than the decode.
    split = split_routed_experts(reply.body)
    out = await server.pool.run_decode(
        len(split[0]), decode_and_reply, reply.body, split, turn, api, server.config.retry_after, before)
    timing.decode = time.perf_counter() - t1
    return out


async def _engine_reply(
    server: ServerState, claim: Claim, request: Request, turn: Turn[R], payload: bytes, api: FrontEnd[R],
    timing: TurnTiming, continuation: Continuation,
) -> tuple[TurnOutput, bytes]:
    """The turn's engine call, continued after each abort by the engine for everyone (resume.py) until its reply
    is whole; every request raced as `_run_engine` races it, within the turn's one deadline."""
    while True:
        try:
            return await _run_engine(server, claim, request, turn, payload, api, timing, continuation.before)
        except EngineAbortedError as aborted:
            payload = await continue_turn(server, turn, continuation, aborted)
            claim.raise_if_aborted()


async def _run_engine(
    server: ServerState, claim: Claim, request: Request, turn: Turn[R], payload: bytes, api: FrontEnd[R],
    timing: TurnTiming, before: GenerateResult | None = None,
) -> tuple[TurnOutput, bytes]:
    """The engine call raced against the client, the claim and the deadline (race.py). Every way out that is not a
    finished call aborts the engine request by our rid and commits nothing."""
    engine_task = asyncio.ensure_future(_generate(server, claim.session.id, turn, payload, api, timing, before))
    try:
        ending = await race(engine_task, disconnects(request.scope, request.receive), claim, _remaining(server, claim))
    except asyncio.CancelledError:
        # The handler itself is being cancelled: the engine request is still aborted (in the background).
        _abort_engine(server, claim, turn.engine_rid, engine_task)
        raise
    if ending is Ending.FINISHED:
        return engine_task.result()
    _abort_engine(server, claim, turn.engine_rid, engine_task)
    if ending is Ending.DISCONNECTED:
        raise tag_abort(
            ClientDisconnectedError("client disconnected during the chat; engine request aborted"),
            AbortReason.DISCONNECT,
        )
    claim.raise_if_aborted()
    raise tag_abort(
        EngineTimeoutError(f"engine did not answer within {server.config.request_timeout:g}s; request aborted"),
        AbortReason.TIMEOUT,
    )


def _abort_engine(server: ServerState, claim: Claim, rid: str, engine_task: asyncio.Future[Any]) -> None:
    """Abort by rid and let the engine end the request in the background (engine/drains.py): the client's answer
    and the slot never wait for the engine."""
    if server.drains is not None:
        server.drains.start(claim.session.id, rid, engine_task, claim.lane)
    else:  # no lifespan state (unit use): at least close the connection
        engine_task.cancel()
