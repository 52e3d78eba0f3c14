"""The last line of defence: an exception no handler turned into a response becomes one JSON 500, logged once.

Starlette's own ServerErrorMiddleware re-raises after answering, so uvicorn logs the same exception a second time
("Exception in ASGI application"). This middleware sits inside ResponseMetrics (which counts the 500 it sends) and
does not re-raise: one log line with the route and, where there is one, the session id; one counted response.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from session_server.errors import error_body, error_response, json_response
from trajectory.errors import SessionError

logger = logging.getLogger("session_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ErrorBoundary:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except SessionError as err:  # a handler let its own error escape: it still has its status
            if started:
                return
            await error_response(err)(scope, receive, send)
        except Exception as exc:
            session = scope.get("path_params", {}).get("session_id")
            logger.error(
                "unhandled error on %s %s%s", scope["method"], scope["path"],
                f" (session {session})" if session else "", exc_info=exc,
            )
            if started:  # too late for a status: the connection is closed mid-response
                return
            await json_response(error_body(exc), 500)(scope, receive, send)
