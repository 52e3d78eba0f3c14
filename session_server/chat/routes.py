"""Chat Completions' routes: `POST /sessions/{id}/v1/chat/completions`, and `POST /v1/chat/completions` at the root
for the session named by X-Session-ID or the API key (frontend/root_session.py); both are a turn on the pipeline."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from session_server.chat.serving import CHAT
from session_server.frontend.root_session import serve_root_turn
from session_server.turns.pipeline import serve_turn


async def create(request: Request) -> Response:
    return await serve_turn(request, request.path_params["session_id"], CHAT)


async def create_at_root(request: Request) -> Response:
    """The chat of the session named by X-Session-ID (created on first use if allowed)."""
    return await serve_root_turn(request, CHAT)
