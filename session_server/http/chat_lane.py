"""The chat route's own lane past Starlette's router: the one route every turn of every episode takes.

Why: below the middleware, Starlette tries the routes in order (a regex each), then wraps the handler in its
exception middleware and `request_response`, each adding a coroutine to the call and to every `send`. For a route
that answers in well under a millisecond of CPU that machinery is a measurable share of a turn. `ChatLane` sits
inside ResponseMetrics and ErrorBoundary, so a chat is counted and guarded exactly like any other request, and hands
a POST on the chat route straight to its handler, as `request_response` would; every other request goes down the
normal stack. The route object is the one in the route table (same path, same endpoint, same path parameters), so
the lane cannot route anything the table would not.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send


class ChatLane:
    def __init__(self, app: ASGIApp, route: Route) -> None:
        self.app = app
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match, child = self.route.matches(scope)
            if match is Match.FULL:
                scope.update(child)
                response = await self.route.endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
