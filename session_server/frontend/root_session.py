"""One base URL for many episodes: `POST /v1/chat/completions` (and `/v1/responses`, `/v1/messages`) and `GET
/v1/models` at the root, addressed by the `X-Session-ID` request header (or, for a turn, by the API key).

Harnesses such as verifiers configure one OpenAI client for a whole run and tell concurrent rollouts apart by a
per-request `X-Session-ID` header. Each id is its own session, so episodes never interleave: two requests with the
same id are one session's turns (the second concurrent one gets the usual 409), and different ids never share a
trajectory. The id either names a session created with `POST /sessions`, or -- when the operator allows it with
`--create-sessions-on-demand` -- a new id the client chose, and the session is created on first use. A deleted id is
never revived. The trainer then collects `/sessions/{id}/samples` with the same id.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import SessionNotFoundError
from session_server.state import ServerState, server_of
from session_server.turns.pipeline import serve_turn
from session_server.turns.turn import FrontEnd
from trajectory.errors import RequestValidationError, SessionError

SESSION_HEADER = "X-Session-ID"
# Ids end up in URLs (/sessions/{id}/samples), logs and metrics labels: a conservative charset and length.
MAX_SESSION_ID_LEN = 128
_VALID_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_SESSION_ID_LEN}}}")


def header_id(request: Request, keys: bool = False) -> str | None:
    """The session id in X-Session-ID, or with `keys` (a turn at the root) in the API key -- `x-api-key` or
    `Authorization: Bearer` -- for harnesses that can set a key but no header (Claude Code, Codex)."""
    sid, where = request.headers.get(SESSION_HEADER), SESSION_HEADER
    if sid is None and keys:
        sid, where = request.headers.get("x-api-key"), "the API key (x-api-key)"
        auth = request.headers.get("authorization")
        if sid is None and auth is not None and auth[:7].lower() == "bearer ":
            sid, where = auth[7:].strip(), "the API key (Authorization: Bearer)"
    if sid is None:
        return None
    if not _VALID_ID.fullmatch(sid):
        raise RequestValidationError(
            f"{where} must name a session: 1-{MAX_SESSION_ID_LEN} characters of A-Z a-z 0-9 . _ : - "
            f"(got {len(sid)} characters)"
        )
    return sid


def not_found(server: ServerState, sid: str) -> SessionNotFoundError:
    how = f"create it with POST /sessions and send the returned session_id in {SESSION_HEADER}"
    if not server.config.create_sessions_on_demand:
        how += ", or start the server with --create-sessions-on-demand to create sessions on first use"
    return SessionNotFoundError(f"session {sid} not found: {how}")


def resolve_session(server: ServerState, request: Request, create: bool) -> str:
    """The session id the request addresses; with `create` and on-demand creation on, an unknown id is created."""
    sid = header_id(request, keys=True)
    if sid is None:
        raise RequestValidationError(
            f"a chat at the root URL needs a {SESSION_HEADER} header (or an API key) naming its session (or use the "
            "session's own base URL, /sessions/{session_id}/v1)"
        )
    if server.registry.knows(sid):
        return sid  # the lifecycle's claim answers for it: live, closing (404), deleted (404 "was deleted")
    if not (create and server.config.create_sessions_on_demand):
        raise not_found(server, sid)
    server.lifecycle.check_accepting()
    # Synchronous from the lookup to the insert: two first requests with one new id cannot both create it.
    server.lifecycle.create(server.new_segments(), session_id=sid)
    return sid


async def serve_at_root(
    request: Request, error: Callable[[SessionError], Response], create: bool,
    handler: Callable[[Request, str], Awaitable[Response]],
) -> Response:
    """Any route at the root URL: `handler` for the session named by X-Session-ID or the API key (created on first
    use when `create` and allowed), a session error in the API's own shape (`error`)."""
    try:
        sid = resolve_session(server_of(request), request, create)
    except SessionError as err:
        return error(err)
    return await handler(request, sid)


async def serve_root_turn(request: Request, api: FrontEnd[Any]) -> Response:
    """A turn at the root URL of any API."""
    return await serve_at_root(request, api.error, True, lambda req, sid: serve_turn(req, sid, api))
