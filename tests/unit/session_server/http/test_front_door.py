"""The one ASGI layer: an exception no handler caught is one JSON 500, counted once in the response metrics and
logged once; POSTs on the chat route skip the router and reach the same endpoint, everything else takes the stack."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from session_server.errors import method_not_allowed, not_found
from session_server.http.front_door import FrontDoor, FrontDoorApp
from session_server.metrics import Metrics


async def boom(request: Request) -> Response:
    raise ValueError("a bug")


def test_unhandled_error_is_one_500_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    routes = [Route("/sessions/{session_id}/boom", boom, methods=["POST"])]
    app = FrontDoorApp(routes=routes)
    metrics = Metrics()
    app.state.server = SimpleNamespace(metrics=metrics)
    caplog.set_level(logging.ERROR)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/sessions/abc/boom")  # the transport would raise an exception that escaped

    resp = asyncio.run(call())
    assert resp.status_code == 500
    assert resp.json() == {"error": {"message": "internal server error", "type": "internal_error", "code": 500}}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "session abc" in errors[0].getMessage() and errors[0].exc_info
    text = metrics.render().decode()
    assert ('session_server_responses_total{method="POST",route="/sessions/{session_id}/boom",status="500"} 1.0'
            in text)


def test_the_lane_routes_exactly_what_the_route_table_routes() -> None:
    seen: list[str] = []

    async def chat(request: Request) -> Response:
        seen.append("router" if "router" in request.scope else "lane")
        endpoint = request.scope["endpoint"] is chat
        return JSONResponse({"session": request.path_params["session_id"], "endpoint": endpoint})

    async def other(request: Request) -> Response:
        return JSONResponse({"other": True})

    chat_route = Route("/sessions/{session_id}/v1/chat/completions", chat, methods=["POST"])
    app = FrontDoorApp(routes=[chat_route, Route("/other", other, methods=["POST"])], chat_route=chat_route,
                       exception_handlers={404: not_found, 405: method_not_allowed})
    metrics = Metrics()
    app.state.server = SimpleNamespace(metrics=metrics)
    with TestClient(app) as client:
        reply = client.post("/sessions/abc/v1/chat/completions", json={})
        assert reply.status_code == 200 and reply.json() == {"session": "abc", "endpoint": True}
        assert seen == ["lane"]
        wrong_method = client.get("/sessions/abc/v1/chat/completions")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == 405  # the router's
        assert client.post("/sessions/abc/v1/chat/completions/x", json={}).status_code == 404
        assert client.post("/other", json={}).json() == {"other": True}
        assert seen == ["lane"]
    text = metrics.render().decode()
    for route, method, status in [("/sessions/{session_id}/v1/chat/completions", "POST", 200),
                                  ("/sessions/{session_id}/v1/chat/completions", "GET", 405),
                                  ("<unmatched>", "POST", 404), ("/other", "POST", 200)]:
        assert (f'session_server_responses_total{{method="{method}",route="{route}",status="{status}"}} 1.0'
                in text), (route, method, status)


def test_it_is_the_one_layer() -> None:
    async def ok(request: Request) -> Response:
        return JSONResponse({})

    app = FrontDoorApp(routes=[Route("/", ok)])
    with TestClient(app) as client:
        assert client.get("/").status_code == 200
    assert isinstance(app.middleware_stack, FrontDoor)
    with pytest.raises(ValueError, match="no middleware"):
        FrontDoorApp(routes=[], middleware=[Middleware(FrontDoor, routes=[])])
