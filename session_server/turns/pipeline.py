"""One turn, whatever API carried it (the front end parses and formats; turn.py says how they meet):

    claim the slot (before the body is read)  ->  read the body  ->  parse + match a segment + prepare (pure)
    ->  bind the claim to the segment (409 if busy)  ->  the engine call (engine_call.py): open, then the engine
    requests WITHOUT the lock, raced against client disconnect, abort requests and the timeout, decoded
    ->  commit under the lock  ->  reply; with `stream: true` the same engine call, consumed by stream.py

Why no lock across the engine call: the gate already guarantees a single turn per segment -- the claim owner is the
segment's only writer -- and the lock only has to make each mutation atomic with respect to GET/samples/DELETE on
the same loop. Holding it across a multi-second engine call would make those readers wait for the engine, and a
cancelled holder could leave it taken. Prepare is pure and commit checks `version`, so nothing slips in unnoticed.

The slot is released by the `finally` of the handler that owns it (or by the stream it was handed to), exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from session_server.engine.adapters import recorded_adapter
from session_server.errors import AbortReason, ClientDisconnectedError, SessionBusyError, tag_abort
from session_server.http import body as body_reader
from session_server.http.disconnect import disconnects
from session_server.sessions.session import Claim
from session_server.state import ServerState, server_of
from session_server.tracing import TurnSpan, turn_facts
from session_server.turns.engine_call import EngineCall, count_failure
from session_server.turns.limits import TurnLimits
from session_server.turns.sampling_masks import SamplingMaskPolicy, mask_policy
from session_server.turns.stream import StreamedTurn
from session_server.turns.turn import FrontEnd, Turn, TurnRequest, new_rid
from trajectory import SegmentPlan, SegmentSet
from trajectory.errors import SessionError
from trajectory.messages import Message

R = TypeVar("R")

NO_LIMITS = TurnLimits()
# Rendering + tokenizing a byte of a first turn vs decoding a byte of an appended turn's body (~0.25 us vs a few ns,
# measured here): with the default 64 KiB cut, first turns under 1 KiB run inline.
FIRST_TURN_BYTE_WEIGHT = 64
SETTLE_LOOP_TURNS = 16


async def serve_turn(request: Request, session_id: str, api: FrontEnd[R]) -> Response:
    """One turn on the session `session_id`, however the request addressed it (URL path or header).

    Responses are counted by route and status in http/front_door.py; this counts what only a turn knows."""
    server = server_of(request)
    span = server.tracer.turn(request.headers, session_id, api.name) if server.tracer is not None else None
    try:
        claim = await _claim(server, session_id)
    except SessionError as err:
        if (session := server.registry.get(session_id)) is not None:
            session.record_failure(err)  # e.g. refused by a pause: an agent that gives up here was failed by it
        if span is not None:
            span.finish({"http.status_code": err.status}, f"{err.code}: {err.message}")
        return api.error(err)
    handed_over = False  # a streamed reply takes the claim along and releases it after its last byte
    failure: SessionError | None = None
    try:
        response = await _turn(server, claim, request, api)
        handed_over = isinstance(response, StreamedTurn)
    except SessionError as err:
        count_failure(server.metrics, err)
        claim.session.record_failure(err)
        failure = err
        response = api.error(err)
    finally:
        if not handed_over:
            claim.release()
        if span is not None:
            _finish_span(span, claim, failure, handed_over)
    return response


def _finish_span(span: TurnSpan, claim: Claim, failure: SessionError | None, streamed: bool) -> None:
    """End the turn's span with what the turn committed (session_server/tracing.py); a streamed turn's when its
    stream has released the slot."""
    if streamed and not claim.done.is_set():
        waiter = asyncio.ensure_future(claim.done.wait())
        waiter.add_done_callback(lambda _: _finish_span(span, claim, failure, False))
        return
    plan, segment = claim.plan, claim.segment
    trajectory = None if segment is None else claim.session.segments.segments.get(segment)
    committed = trajectory is not None and plan is not None and (
        trajectory.trajectory.version == plan.turn.version + 1)
    facts: dict[str, object] = {"session.segment": segment,
                                "http.status_code": failure.status if failure is not None else 200}
    if committed and trajectory is not None:
        records = trajectory.trajectory.records
        facts.update(turn_facts(len(records) - 1, records[-1]))
    error = f"{failure.code}: {failure.message}" if failure is not None else (
        None if committed else "the turn committed nothing")
    span.finish(facts, error)


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
    busy: Mapping[int, Message] | None = None, masks: SamplingMaskPolicy | None = None,
) -> tuple[TurnRequest[R], SegmentPlan]:
    """Parse the request, match its segment and build the TITO prompt: the CPU work of a turn before the engine call.

    Runs in a worker thread without the session lock when it is large. Prepare only reads, and a plan built while
    another segment's turn commits on the loop is at worst stale: `Lifecycle.bind` refuses a plan whose segment
    moved since (409), and a commit checks the version again. Rendering the chat template and tokenizing are the most
    expensive steps of a turn; on the loop they would delay every other request, /health included.

    `masks`: the session records sampling masks; a request that cannot be replayed with them is refused here, for
    every API, before anything is rendered (turns/sampling_masks.py).
    """
    family = segments.main.family
    turn = api.parse(body, segments.main, limits.images)  # previous_response_id: on the session's first segment
    if masks is not None:
        turn.sampling_mask_bound = masks.apply(turn.sampling_params)
    limits.before_render(turn.messages, family, len(body))
    plan = segments.prepare(turn.messages, turn.tools, turn.template_kwargs, busy, turn.messages_json)
    limits.after_render(plan.turn, turn.sampling_params)
    return turn, plan


async def _turn(server: ServerState, claim: Claim, request: Request, api: FrontEnd[R]) -> Response:
    session = claim.session
    metrics = server.metrics
    body = await _read_body_or_abort(claim, request, server.config.max_request_bytes, server.config.body_timeout)
    server.lifecycle.admit(claim)  # 503 if a pause began while the body was on its way
    # Work is sized by the body it parses (cpu_pool.py). A first turn renders and tokenizes every byte of its body
    # (tool schemas included), which costs far more per byte than decoding an appended turn's resent history, so
    # its bytes weigh FIRST_TURN_BYTE_WEIGHT times more: a short first turn runs inline (a pool hop would cost more
    # than it does), while one with a few tool schemas goes to the pool (run inline, a burst of those held the loop:
    # /health p99 89 ms under 64-chat waves of first turns with 8 tools).
    # A primed first turn (api/primes.py) renders nothing when it sends the primed request: sized as any other turn.
    first = not session.trajectory.checkpoints and session.trajectory.primed is None
    cost = FIRST_TURN_BYTE_WEIGHT * len(body) if first else len(body)
    t0 = time.perf_counter()
    prepare = functools.partial(
        prepare_turn, body, session.segments, api,
        TurnLimits(server.prompt_token_limit, server.config.max_session_tokens, server.config.image_limits),
        session.busy_segments(), mask_policy(server.config, session),
    )
    # A GRPO group's repeated first request with its ids kept: prepared here, no pool hop (repeated_first_turns.py),
    # if its parse is as small as what runs here anyway.
    on_loop = first and len(body) < server.pool.inline_below_bytes and server.family.first_turns.active
    prepared = server.first_turn_repeats.prepare(body, prepare) if on_loop else None
    if prepared is None:
        # A fetched image is read where the parse runs: never on the loop (frontend/images.py).
        prepared = await server.pool.run_sized(cost if not server.config.fetch_images else 1 << 62, prepare)
    parsed, matched = prepared
    metrics.stage("prepare", time.perf_counter() - t0)
    if parsed.ignored:
        metrics.ignored(api.name, parsed.ignored)
    claim.raise_if_aborted()
    matched = await _bind(server, claim, matched)
    # The rid has a fixed length: no rid is a prefix of another (abort matches by prefix).
    wants_ids = server.config.return_token_ids if parsed.return_token_ids is None else parsed.return_token_ids
    turn = Turn(parsed, matched.turn, new_rid(), parsed.model or server.family.name, server.family, matched,
                return_token_ids=wants_ids)
    server.engine.place(session.id)  # its worker, or a healthy one if its worker failed (placement.py)
    book = server.adapters
    if book is not None:  # the session's LoRA adapter revision, pinned; refused here if the engines do not hold it
        recorded = None if session.id in book.pins else recorded_adapter(session.trajectory.records)
        turn.adapter = await book.for_turn(session.id, session.metadata, parsed.model, recorded)
        claim.raise_if_aborted()
    call = EngineCall(server, claim, turn, api)
    await call.open()
    if parsed.stream:
        return StreamedTurn(call)  # type: ignore[return-value]  # an ASGI response
    try:
        out, reply = await call.reply(disconnects(request.scope, request.receive))
        await call.commit(out)
    finally:
        call.close()
    assert reply is not None  # a plain turn's reply is built with its decode
    return Response(reply, media_type="application/json", headers=turn.headers)
