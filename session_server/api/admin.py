"""Operational routes: liveness, readiness, metrics, and pause/continue for weight updates.

/health must stay cheap and never touch the engine: it is what a load balancer (and the responsiveness benchmark)
polls while chats are in flight. Pause has three modes: `drain` refuses new chats (503 + Retry-After) and waits for
the in-flight ones that reached the engine to finish, for at most --drain-timeout seconds, then aborts the rest (a chat
still uploading its body is refused when it arrives); `abort` aborts them at once. An
aborted chat returns 503 + Retry-After and commits nothing, and its agent retries the same turn after `continue`.
`in_place` loses no turn: new chats are refused as in a drain, but the in-flight ones stay where they are, in the
engine (SGLang's `/pause_generation` mode `in_place` on every worker: requests keep their KV), while the trainer
updates the weights; `continue` resumes the engine, and each of those replies records which tokens each weight
version sampled (the sample's `weight_version_spans`).

With --journal the pause is durable: it is journaled before it is acknowledged, and a replica restarted during it
(a crash, an OOM kill, a redeploy) comes back paused in the same mode, refusing new chats until `continue` -- a weight
update in progress never gets traffic from a replica that forgot it. The admin plane cannot re-apply a pause itself:
it does not see a replica restart between its calls. Without a journal nothing of a replica survives a restart, the
pause included; `session-server-admin health` shows each replica's `paused`.
"""

from __future__ import annotations

import asyncio
import heapq
import hmac
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import AbortReason, AdminAuthError, json_response
from session_server.http.body import read_object
from session_server.metrics import CONTENT_TYPE
from session_server.state import server_of
from trajectory.errors import RequestValidationError


async def health(request: Request) -> Response:
    server = server_of(request)
    return json_response({"status": "ok", "instance_id": server.instance_id, "replica": server.config.replica_name,
                          "paused": server.lifecycle.paused})


async def ready(request: Request) -> Response:
    """Probes every engine worker now: 200 while at least one can take sessions ("ready", or "degraded" when some
    failed), 503 when none can; the body lists each worker's health and live sessions."""
    server = server_of(request)
    ok = await server.engine.ready()
    body = {**server.engine.status(), "instance_id": server.instance_id}
    return json_response(body, status=200 if ok else 503)


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's registry (see metrics.py for what is in it)."""
    return Response(server_of(request).metrics.render(), media_type=CONTENT_TYPE)


def _authorize(request: Request) -> None:
    token = server_of(request).config.admin_token
    if token is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise AdminAuthError("admin endpoints need 'Authorization: Bearer <admin token>'")


async def pause(request: Request) -> Response:
    server = server_of(request)
    _authorize(request)
    config = server.config
    obj = await read_object(request, config.max_request_bytes, config.body_timeout)
    mode = obj.get("mode", "drain")
    if not isinstance(mode, str) or mode not in ("drain", "abort", "in_place"):
        raise RequestValidationError("'mode' must be 'drain', 'abort' or 'in_place'")
    lifecycle = server.lifecycle
    # Journaled first: a pause acknowledged is a pause a restart keeps (a failed write is a 503, nothing paused).
    # Engines paused in place stay so until a continue, whatever mode a later pause asks for.
    previous = ("in_place" if server.paused_in_place else "drain") if lifecycle.paused else None
    if server.journal is not None:
        await server.journal.paused("in_place" if server.paused_in_place else mode)
    if mode == "in_place":
        try:
            await server.engine.pause_in_place()  # a refusal is a 502 and nothing is paused
        except BaseException:
            if server.journal is not None:
                await server.journal.paused(previous)
            raise
        lifecycle.paused = True
        server.paused_in_place = True
        return json_response({"status": "paused", "mode": mode, "aborted": 0})
    lifecycle.paused = True
    deadline = time.monotonic() + config.drain_timeout
    aborted = len(lifecycle.abort_all(AbortReason.PAUSE)) if mode == "abort" else 0
    try:
        # A drain waits for the chats that reached the engine, but not forever: an engine that never answers must
        # not hold a weight update. Past the deadline the rest are aborted (503 + Retry-After, nothing committed)
        # like mode=abort. Chats still uploading their bodies are not waited for: they are refused when their body
        # arrives (Lifecycle.admit).
        await asyncio.wait_for(lifecycle.wait_idle(admitted_only=True), config.drain_timeout)
    except TimeoutError:
        aborted = len(lifecycle.abort_all(AbortReason.PAUSE))
        await lifecycle.wait_idle()
    if server.drains is not None:
        # Aborted chats answer at once and their engine requests end in the background (engine/drains.py); the
        # pause returns once those have ended too (each drain is bounded), so the engine is quiet for the update;
        # aborts the engine did not answer are retried until it does, waited for until the drain's deadline.
        await server.drains.wait_all(retries_within=deadline - time.monotonic())
    return json_response({"status": "paused", "mode": mode, "aborted": aborted})


SESSION_LIST_LIMIT = 10_000  # entries of one listing (about 200 bytes each); `?limit=N` asks for fewer or more


async def sessions(request: Request) -> Response:
    """GET /admin/sessions: this replica's live sessions, most recently active first (`?limit=N`, default
    SESSION_LIST_LIMIT): id, metadata, turns, tokens, seconds since creation and since the last request, whether a
    chat is in flight. What `session-server-admin sessions` gathers from every replica. With --engine-sessions,
    `engine_sessions` says how many engine sessions are being closed in the background and lists the latest whose
    close never landed (the engine's idle timeout frees those)."""
    server = server_of(request)
    _authorize(request)
    raw = request.query_params.get("limit", str(SESSION_LIST_LIMIT))
    if not raw.isdigit():
        raise RequestValidationError("'limit' must be a non-negative integer")
    live = server.registry.sessions()
    now, wall = time.monotonic(), time.time()
    newest = heapq.nlargest(int(raw), live, key=lambda s: s.last_active)
    body: dict[str, Any] = {
        "replica": server.config.replica_name, "total": len(live), "sessions": [{
            "id": s.id, "metadata": s.metadata, "turns": len(s.trajectory.records), "tokens": s.trajectory.num_tokens,
            "age_s": round(wall - s.created_at, 3), "idle_s": round(now - s.last_active, 3),
            "in_flight": bool(s.claims),
        } for s in newest],
    }
    engine_sessions = server.engine_sessions
    if engine_sessions is not None:
        body["engine_sessions"] = {"closes_under_way": engine_sessions.closes_under_way,
                                   "unclosed": list(engine_sessions.unclosed)}
    return json_response(body)


async def resume(request: Request) -> Response:
    server = server_of(request)
    _authorize(request)
    if server.paused_in_place:
        await server.engine.continue_in_place()  # a refusal is a 502 and the server stays paused
        server.paused_in_place = False
    if server.journal is not None:
        await server.journal.paused(None)  # a failure (503) leaves the server paused, as the journal says
    server.lifecycle.paused = False
    server.registry.touch_all()  # the pause does not count as idleness (see sessions/sweeper.py)
    return json_response({"status": "running"})
