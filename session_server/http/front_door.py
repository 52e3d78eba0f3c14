"""The one ASGI layer every request passes: it counts the response, guards against an unhandled error, and takes
chats past the router. `FrontDoorApp` is the Starlette app with this layer as its whole middleware stack.

Why one layer and not three middlewares: each middleware adds a coroutine frame to every request and a send wrapper
to every `send`, and the chat route answers in well under a millisecond of CPU, so that machinery was a measurable
share of a turn. What each part does, and why:

- count: every response once, into the server's metrics (metrics.py), by route template, method and status
  (`RouteTemplates`: bounded labels, never the raw path); the 500 of an unhandled error and the 404/405 of paths no
  route knows included; a handler cancelled before it sent anything counts as 499.
- guard: an exception no handler turned into a response becomes one JSON 500 (a SessionError keeps its own status),
  logged once with the route and, where there is one, the session id, and not re-raised. Starlette's own
  ServerErrorMiddleware (which this stack leaves out) re-raised after answering, so uvicorn logged the same exception
  a second time ("Exception in ASGI application").
- the chat lane: below the middleware, Starlette tries the routes in order (a regex each), then wraps the handler in
  its exception middleware and `request_response`, each adding a coroutine to the call and to every `send`. A POST
  on the chat route goes straight to its endpoint, as `request_response` would call it; every other request goes
  down the normal stack (Starlette's ExceptionMiddleware for the 404/405 handlers, then the router). The route
  object is the one in the route table (same path, endpoint and path parameters), so the lane cannot route anything
  the table would not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from session_server.errors import error_body, error_response, json_response
from trajectory.errors import SessionError

logger = logging.getLogger("session_server")

UNMATCHED = "<unmatched>"  # the route label of a path no route knows (bounded: never the raw path)
CANCELLED = 499  # the handler was cancelled before it sent anything (nginx's "client closed request")


class RouteTemplates:
    """The route label of a request: the template of the route the router matched (`/sessions/{session_id}`).

    Found through the endpoint the router put in the scope (`scope["endpoint"]`); an endpoint mounted under several
    templates is told apart by the route's own regex."""

    def __init__(self, routes: Sequence[Any]) -> None:
        by_endpoint: dict[Any, list[Any]] = {}
        for route in routes:
            endpoint = getattr(route, "endpoint", None)
            if endpoint is not None and all(route.path != r.path for r in by_endpoint.get(endpoint, [])):
                by_endpoint.setdefault(endpoint, []).append(route)
        self._single = {e: rs[0].path for e, rs in by_endpoint.items() if len(rs) == 1}
        self._multi = {e: rs for e, rs in by_endpoint.items() if len(rs) > 1}

    def route_of(self, scope: Scope) -> str:
        endpoint = scope.get("endpoint")
        if endpoint is None:
            return UNMATCHED
        path = self._single.get(endpoint)
        if path is not None:
            return str(path)
        for route in self._multi.get(endpoint, ()):
            if route.path_regex.match(scope["path"]):
                return str(route.path)
        return UNMATCHED


class FrontDoor:
    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute], chat_route: Route | None = None) -> None:
        self.app = app
        self.templates = RouteTemplates(routes)
        self.chat_route = chat_route
        self.chat_template = chat_route.path if chat_route is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        route: str | None = None

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            try:
                chat = self.chat_route
                if chat is not None and scope["method"] == "POST":
                    match, child = chat.matches(scope)
                    if match is Match.FULL:
                        scope.update(child)
                        route = self.chat_template
                        response = await chat.endpoint(Request(scope, receive, send_status))
                        await response(scope, receive, send_status)
                        return
                await self.app(scope, receive, send_status)
            except SessionError as err:  # a handler let its own error escape: it still has its status
                if not status:
                    await error_response(err)(scope, receive, send_status)
            except Exception as exc:
                session = scope.get("path_params", {}).get("session_id")
                logger.error(
                    "unhandled error on %s %s%s", scope["method"], scope["path"],
                    f" (session {session})" if session else "", exc_info=exc,
                )
                if not status:  # else too late for a status: the connection is closed mid-response
                    await json_response(error_body(exc), 500)(scope, receive, send_status)
        except Exception:  # the error answer itself failed: uvicorn answers 500 and logs it
            status = status or 500
            raise
        except BaseException:
            status = status or CANCELLED
            raise
        finally:
            server = getattr(scope["app"].state, "server", None) if "app" in scope else None
            if server is not None:
                server.metrics.response(route or self.templates.route_of(scope), scope["method"], status)


class FrontDoorApp(Starlette):
    """Starlette whose middleware stack is FrontDoor over the exception middleware and the router: no
    ServerErrorMiddleware (FrontDoor guards), no user middleware (FrontDoor is the one layer)."""

    def __init__(self, *args: Any, chat_route: Route | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.user_middleware or self.max_body_size is not None:
            raise ValueError("FrontDoorApp takes no middleware and no max_body_size: FrontDoor is the one layer")
        self.chat_route = chat_route

    def build_middleware_stack(self) -> ASGIApp:
        handlers = {k: v for k, v in self.exception_handlers.items() if k not in (500, Exception)}
        if len(handlers) != len(self.exception_handlers):
            raise ValueError("FrontDoorApp answers unhandled errors itself: no 500/Exception handler")
        inner = ExceptionMiddleware(self.router, handlers=handlers, debug=self.debug)
        return FrontDoor(inner, self.routes, self.chat_route)
