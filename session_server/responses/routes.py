"""The Responses API's routes: `POST .../v1/responses` (a turn, on the turn pipeline) and
`GET .../v1/responses/{response_id}` (a committed turn's response), under the session URL and at the root; errors
in the Responses shape."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import json_response
from session_server.frontend.root_session import serve_at_root, serve_root_turn
from session_server.responses.reply import stored_response
from session_server.responses.serving import RESPONSES
from session_server.state import server_of
from session_server.turns.pipeline import serve_turn
from trajectory.errors import SessionError


async def create(request: Request) -> Response:
    return await serve_turn(request, request.path_params["session_id"], RESPONSES)


async def create_at_root(request: Request) -> Response:
    return await serve_root_turn(request, RESPONSES)


async def _retrieve(request: Request, session_id: str) -> Response:
    server = server_of(request)
    try:
        session = server.registry.require(session_id)
        async with session.lock:  # the records and tokens as of the last commit
            body = stored_response(session.trajectory, request.path_params["response_id"])
    except SessionError as err:
        return RESPONSES.error(err)
    return json_response(body)


async def retrieve(request: Request) -> Response:
    return await _retrieve(request, request.path_params["session_id"])


async def retrieve_at_root(request: Request) -> Response:
    return await serve_at_root(request, RESPONSES.error, False, _retrieve)
