"""The Anthropic Messages API's routes: `POST .../v1/messages` (a turn, on the turn pipeline) and
`POST .../v1/messages/count_tokens`, under the session URL (Claude Code's ANTHROPIC_BASE_URL) and at the root; errors
in Anthropic's shape. Query strings (`?beta=true`) are accepted as they are: they change nothing here."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import json_response
from session_server.frontend.root_session import serve_at_root, serve_root_turn
from session_server.messages.protocol import count_tokens
from session_server.messages.serving import MESSAGES
from session_server.state import server_of
from session_server.turns.pipeline import read_body, serve_turn
from trajectory.errors import SessionError


async def create(request: Request) -> Response:
    return await serve_turn(request, request.path_params["session_id"], MESSAGES)


async def create_at_root(request: Request) -> Response:
    return await serve_root_turn(request, MESSAGES)


async def _count(request: Request, session_id: str) -> Response:
    """Counts on a snapshot of the session, on the CPU pool; never claims the session."""
    server = server_of(request)
    config = server.config
    try:
        session = server.registry.require(session_id)
        body = await read_body(request, config.max_request_bytes, config.body_timeout)
        async with session.lock:
            snapshot = session.trajectory.snapshot()
        tokens = await server.pool.run_sized(len(body), count_tokens, body, snapshot, config.image_limits)
    except SessionError as err:
        return MESSAGES.error(err)
    return json_response({"input_tokens": tokens})


async def count(request: Request) -> Response:
    return await _count(request, request.path_params["session_id"])


async def count_at_root(request: Request) -> Response:
    return await serve_at_root(request, MESSAGES.error, True, _count)
