"""An exception no handler caught: one JSON 500, counted once in the response metrics and logged once."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from session_server.http.boundary import ErrorBoundary
from session_server.metrics import Metrics, ResponseMetrics


async def boom(request: Request) -> Response:
    raise ValueError("a bug")


def build() -> tuple[Starlette, Metrics]:
    routes = [Route("/sessions/{session_id}/boom", boom, methods=["POST"])]
    app = Starlette(routes=routes, middleware=[Middleware(ResponseMetrics, routes=routes), Middleware(ErrorBoundary)])
    metrics = Metrics()
    app.state.server = SimpleNamespace(metrics=metrics)
    return app, metrics


def test_unhandled_error_is_one_500_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    app, metrics = build()
    caplog.set_level(logging.ERROR)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/sessions/abc/boom")

    resp = asyncio.run(call())
    assert resp.status_code == 500
    assert resp.json() == {"error": {"message": "internal server error", "type": "internal_error", "code": 500}}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "session abc" in errors[0].getMessage() and errors[0].exc_info
    text = metrics.render().decode()
    assert ('session_server_responses_total{method="POST",route="/sessions/{session_id}/boom",status="500"} 1.0'
            in text)
