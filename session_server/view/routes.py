"""GET /view/ (the session list), /view/sessions/{id} (one session's trajectory) and the JSON they fetch.

Read-only and off the chat lane: no route here takes a session's lock or claims a slot, so looking at an episode
costs it nothing; the session's document is built on the CPU pool (view/documents.py). Behind --admin-token when one
is set, like the admin routes; a browser cannot add a header to a link, so the pages also take the token as
`?token=` and the page's script sends it on as a header when it fetches the JSON.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from session_server.api.admin import authorize
from session_server.errors import SessionNotFoundError, json_response
from session_server.sessions.session import Session
from session_server.state import server_of
from session_server.view.documents import session_document
from trajectory import view as trajectory_view
from trajectory.errors import RequestValidationError

LIST_LIMIT = 1000  # sessions in one listing, most recently active first (`?limit=N`)


def _session(request: Request) -> Session:
    """The live session (a closing one too), without marking it active: looking does not keep an episode alive."""
    session_id = request.path_params["session_id"]
    session = server_of(request).registry.get(session_id)
    if session is None:
        raise SessionNotFoundError(f"session {session_id} not found")
    return session


def _authorize(request: Request) -> None:
    query = request.query_params.get("token")
    authorize(request, f"Bearer {query}" if query is not None and "authorization" not in request.headers else None)


async def list_page(request: Request) -> Response:
    _authorize(request)
    return HTMLResponse(trajectory_view.list_page())


async def session_page(request: Request) -> Response:
    _authorize(request)
    session = _session(request)  # an unknown id is a 404 here, not a page that says so later
    return HTMLResponse(trajectory_view.session_page(session.id))


def _summary(session: Session, now: float, wall: float) -> dict[str, object]:
    segments = list(session.segments)
    records = [r for s in segments for r in s.trajectory.records]
    return {
        "id": session.id, "metadata": session.metadata,
        "status": "closing" if session.closing else ("busy" if session.claims else "idle"),
        "segments": len(segments), "turns": len(records),
        "tokens": sum(s.trajectory.num_tokens for s in segments), "busy": bool(session.claims),
        "idle_s": round(now - session.last_active, 3), "age_s": round(wall - session.created_at, 3),
        "weight_versions": sorted({str(r.weight_version) for r in records if r.weight_version is not None}),
    }


async def sessions_json(request: Request) -> Response:
    """The live sessions, most recently active first: bounded by `limit`, read on the loop (no lock, no await)."""
    _authorize(request)
    server = server_of(request)
    raw = request.query_params.get("limit", str(LIST_LIMIT))
    if not raw.isdigit():
        raise RequestValidationError("'limit' must be a non-negative integer")
    live = server.registry.sessions()
    newest = sorted(live, key=lambda s: s.last_active, reverse=True)[:int(raw)]
    now, wall = time.monotonic(), time.time()
    return json_response({"replica": server.config.replica_name, "total": len(live),
                          "paused": server.lifecycle.paused,
                          "sessions": [_summary(s, now, wall) for s in newest]})


async def session_json(request: Request) -> Response:
    """One session's view document. The snapshot is a synchronous copy on the loop (see view/documents.py)."""
    _authorize(request)
    server = server_of(request)
    session = _session(request)
    snapshot = session.segments.snapshot()
    header = {"session": session.id, "status": "closing" if session.closing else (
        "busy" if session.claims else "idle"), "created": time.strftime(
        "%Y-%m-%d %H:%M:%S", time.gmtime(session.created_at)) + " UTC", "segments": len(snapshot),
        "turns": sum(len(t.records) for _, t in snapshot), "tokens": sum(t.num_tokens for _, t in snapshot),
        "metadata": session.metadata or None}
    body = await server.pool.run(session_document, snapshot, server.family, header)
    return Response(body, media_type="application/json")
