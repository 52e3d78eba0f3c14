"""Operational routes: liveness, readiness, metrics, and pause/continue for weight updates.

/health must stay cheap and never touch the engine: it is what a load balancer (and the responsiveness benchmark)
polls while chats are in flight. Pause and continue only parse and answer here: the pause's modes, its journal row
and the engines' own pause are the session lifecycle's (sessions/pause.py). The admin plane cannot re-apply a pause
itself: it does not see a replica restart between its calls, so with --journal the replica keeps it; without a journal
nothing of a replica survives a restart, the pause included; `session-server-admin health` shows each replica's
`paused`.
"""

from __future__ import annotations

import heapq
import hmac
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import AdminAuthError, json_response
from session_server.http.body import read_object
from session_server.metrics import CONTENT_TYPE
from session_server.sessions.pause import MODES
from session_server.state import ServerState, server_of
from session_server.tracing import admin_span
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


def authorize(request: Request, given: str | None = None) -> None:
    """The admin token's check; `given` is the credential when it came another way than the Authorization header
    (the viewer's pages take `?token=`, view/routes.py)."""
    token = server_of(request).config.admin_token
    if token is None:
        return
    if given is None:
        given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise AdminAuthError("admin endpoints need 'Authorization: Bearer <admin token>'")


async def pause(request: Request) -> Response:
    """POST /admin/pause `{"mode": "drain" | "abort" | "in_place"}` (default drain): the pause of sessions/pause.py."""
    server = server_of(request)
    with admin_span(server.tracer, "admin.pause", request.headers):  # a span when tracing (tracing.py)
        return await _pause(request, server)


async def _pause(request: Request, server: ServerState) -> Response:
    authorize(request)
    config = server.config
    obj = await read_object(request, config.max_request_bytes, config.body_timeout)
    mode = obj.get("mode", "drain")
    if mode not in MODES:
        raise RequestValidationError("'mode' must be 'drain', 'abort' or 'in_place'")
    aborted = await server.lifecycle.pause.pause(mode, config.drain_timeout)
    return json_response({"status": "paused", "mode": mode, "aborted": aborted})


SESSION_LIST_LIMIT = 10_000  # entries of one listing (about 200 bytes each); `?limit=N` asks for fewer or more


async def sessions(request: Request) -> Response:
    """GET /admin/sessions: this replica's live sessions, most recently active first (`?limit=N`, default
    SESSION_LIST_LIMIT): id, metadata, turns, tokens, seconds since creation and since the last request, whether a
    chat is in flight; what followed engine aborts of its turns (`continuations`: recomputed, regenerated, stale, ...)
    and the infrastructure failure it ended with (`failure`, trajectory/infrastructure.py), where there are any. What
    `session-server-admin sessions` gathers from every replica. With --engine-sessions,
    `engine_sessions` says how many engine sessions are being closed in the background and lists the latest whose
    close never landed (the engine's idle timeout frees those). Once a session named a LoRA adapter, `adapters` says
    what the engines hold, each adapter's current revision, the sessions pinned to each revision and what this
    replica unloaded (engine/adapters.py)."""
    server = server_of(request)
    authorize(request)
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
            **({"continuations": dict(s.continuations)} if s.continuations else {}),
            **({"failure": f.info()} if (f := s.failure) is not None else {}),
        } for s in newest],
    }
    engine_sessions = server.engine_sessions
    if engine_sessions is not None:
        body["engine_sessions"] = {"closes_under_way": engine_sessions.closes_under_way,
                                   "unclosed": list(engine_sessions.unclosed)}
    if server.adapters is not None and server.adapters.loaded is not None:
        body["adapters"] = server.adapters.describe()
    return json_response(body)


async def resume(request: Request) -> Response:
    """POST /admin/continue, optional body `{"weight_version": "N"}` (the weights the engines serve now, as the push
    named them; else asked of each engine): the pause ends (sessions/pause.py). With `"adapter": {"name", "revision"}`
    a trainer announces the LoRA adapter revision it loaded (engine/adapters.py): checked in the engines' model list
    once the pause has ended (502 when they do not hold it), then the revision new sessions are pinned to."""
    server = server_of(request)
    with admin_span(server.tracer, "admin.continue", request.headers):
        return await _resume(request, server)


async def _resume(request: Request, server: ServerState) -> Response:
    authorize(request)
    config = server.config
    obj = await read_object(request, config.max_request_bytes, config.body_timeout)
    version = obj.get("weight_version")
    if version is not None and (not isinstance(version, str) or not version):
        raise RequestValidationError("'weight_version' must be a non-empty string")
    adapter = obj.get("adapter")
    if adapter is not None and not (isinstance(adapter, dict) and isinstance(adapter.get("name"), str)
                                    and adapter["name"] and isinstance(adapter.get("revision"), str)
                                    and adapter["revision"]):
        raise RequestValidationError("'adapter' must be {\"name\": str, \"revision\": str}, both non-empty")
    await server.lifecycle.pause.resume(version)
    if adapter is not None and server.adapters is not None:  # after the resume: an engine left paused stalls all
        ref = await server.adapters.learn(adapter["name"], adapter["revision"])
        return json_response({"status": "running", "adapter": ref.engine_name})
    return json_response({"status": "running"})
