"""HTTP glue for the one error hierarchy: every trajectory.errors.SessionError carries its status, we only render it.

The few failure modes that exist only at the HTTP layer (body too large, engine timeout, client gone) are added here as
subclasses of the same base, so the handler has exactly one `except SessionError` path and one renderer.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from trajectory.errors import (
    SessionError,
    SessionPausedError,
    error_body,
)


class RequestTooLargeError(SessionError):
    status = 413
    code = "request_too_large"


class EngineTimeoutError(SessionError):
    status = 504
    code = "engine_timeout"


class ClientDisconnectedError(SessionError):
    """Nobody reads this reply; the status (nginx's 499) only shows up in metrics and logs."""

    status = 499
    code = "client_disconnected"


class RouteNotFoundError(SessionError):
    status = 404
    code = "not_found"


class MethodNotAllowedError(SessionError):
    status = 405
    code = "method_not_allowed"


_json = msgspec.json.Encoder()


def json_response(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(payload), status_code=status, headers=headers, media_type="application/json")


def error_response(err: SessionError) -> Response:
    headers = None
    if isinstance(err, SessionPausedError):
        headers = {"Retry-After": str(max(1, int(err.retry_after)))}
    return json_response(error_body(err), err.status, headers)


async def not_found(request: Request, exc: Exception) -> Response:
    """Any path the route table does not know, including engine paths under a session URL."""
    return error_response(RouteNotFoundError(f"no route for {request.method} {request.url.path}"))


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(MethodNotAllowedError(f"method {request.method} not allowed on {request.url.path}"))
