"""SGLang's API-key rules (`--api-key`, `--admin-api-key`), as an ASGI middleware around the sim's routes.

Copied from sglang 0.5.23 `srt/utils/auth.py` (`decide_request_auth`) and the `@auth_level` marks in
`srt/entrypoints/http_server.py`: `/health*`, `/ready*` and `/metrics*` are always open; ADMIN_OPTIONAL endpoints
(abort, pause/continue, flush, weight updates) want the admin key when one is set (the api key is then refused),
else the api key; every other endpoint (NORMAL: /generate, sessions, info, models) wants the api key when one is
set. A refusal is `{"error": "Unauthorized"}` with 401. The `/sim/*` test hooks are not SGLang's and stay open.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from sglang_sim import wire

ADMIN_OPTIONAL_PATHS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/update_weight_version",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/sim/")


def _bearer_matches(header: str | None, expected: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)


def allowed(method: str, path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """`decide_request_auth` for the two levels the sim's endpoints have (it has no ADMIN_FORCE endpoint)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_OPTIONAL_PATHS:
        if admin_api_key:
            return _bearer_matches(authorization, admin_api_key)
        return _bearer_matches(authorization, api_key) if api_key else True
    return _bearer_matches(authorization, api_key) if api_key else True


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            if not allowed(scope["method"], scope["path"], authorization, self.api_key, self.admin_api_key):
                body = wire.encode({"error": "Unauthorized"})
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
