"""ChatLane: POSTs on the chat route skip the router and reach the same endpoint; everything else takes the stack."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from session_server.http.chat_lane import ChatLane


def test_the_lane_routes_exactly_what_the_route_table_routes() -> None:
    seen: list[str] = []

    async def chat(request: Request) -> Response:
        seen.append("router" if "router" in request.scope else "lane")
        endpoint = request.scope["endpoint"] is chat
        return JSONResponse({"session": request.path_params["session_id"], "endpoint": endpoint})

    async def other(request: Request) -> Response:
        return JSONResponse({"other": True})

    chat_route = Route("/sessions/{session_id}/v1/chat/completions", chat, methods=["POST"])
    app = Starlette(routes=[chat_route, Route("/other", other, methods=["POST"])],
                    middleware=[Middleware(ChatLane, route=chat_route)])
    with TestClient(app) as client:
        reply = client.post("/sessions/abc/v1/chat/completions", json={})
        assert reply.status_code == 200 and reply.json() == {"session": "abc", "endpoint": True}
        assert seen == ["lane"]
        assert client.get("/sessions/abc/v1/chat/completions").status_code == 405  # the router's answer
        assert client.post("/sessions/abc/v1/chat/completions/x", json={}).status_code == 404
        assert client.post("/other", json={}).json() == {"other": True}
        assert seen == ["lane"]
