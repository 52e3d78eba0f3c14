"""Exceptions of the rollout client: one base class, HTTP failures carry the status and the server's body.

A trainer mostly needs to tell apart "the session is gone" (404: nothing to clean up), "try again later"
(503 with `Retry-After`), other server answers, and "could not talk to the server at all".
"""

from __future__ import annotations

import json
from typing import Any


class RolloutError(Exception):
    """Base class of every error raised by the rollout client."""


class ServerConnectionError(RolloutError):
    """The request never got an HTTP answer (refused connection, timeout, dropped connection)."""

    def __init__(self, method: str, url: str, cause: BaseException) -> None:
        super().__init__(f"{method} {url}: {type(cause).__name__}: {cause}")
        self.method = method
        self.url = url
        self.cause = cause


class UnknownSessionError(RolloutError, KeyError):
    """A session id this client did not create (or already deleted), so it does not know its server."""

    def __str__(self) -> str:
        return f"unknown session id {self.args[0]!r} (not created by this client, or already deleted)"


class SessionServerError(RolloutError):
    """The session server answered with a non-success status; `body` is its JSON body when it sent one."""

    def __init__(self, method: str, url: str, status: int, body: Any, retry_after: float | None = None) -> None:
        self.method = method
        self.url = url
        self.status = status
        self.body = body
        self.retry_after = retry_after
        super().__init__(f"{method} {url} -> {status}: {self.server_message}")

    @property
    def server_message(self) -> str:
        """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the raw body."""
        if isinstance(self.body, dict):
            error = self.body.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return error["message"]
            if isinstance(self.body.get("message"), str):
                return self.body["message"]
        return self.body if isinstance(self.body, str) else json.dumps(self.body)


class SessionNotFoundError(SessionServerError):
    """404: the session is unknown to its server, closing, or already deleted."""


class ServerBusyError(SessionServerError):
    """503 (server paused for a weight update, or not ready) or 429 (a fork's children do not fit under
    --max-sessions now): retry after `retry_after` seconds."""


def error_for_status(method: str, url: str, status: int, body: Any, retry_after: float | None) -> SessionServerError:
    """The most precise exception class for an HTTP error answer."""
    cls = {404: SessionNotFoundError, 429: ServerBusyError, 503: ServerBusyError}.get(status, SessionServerError)
    return cls(method, url, status, body, retry_after)
