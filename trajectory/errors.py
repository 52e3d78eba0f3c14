"""One error hierarchy for the whole project; every class carries the HTTP status it maps to.

The pure core raises these and the HTTP adapter turns them into responses with `error_body`, so the
mapping from "what went wrong" to "which status the client sees" lives in exactly one place.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SessionError(Exception):
    """Base class: `status` is the HTTP status, `code` the machine-readable error type."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestValidationError(SessionError):
    """The client's request is malformed or cannot be served as asked (400)."""

    status = 400
    code = "invalid_request"


class RollbackLimitError(RequestValidationError):
    """The request's history diverges further back than the session may roll back (400)."""

    code = "rollback_limit_exceeded"


class TemplateError(RequestValidationError):
    """The family's chat template cannot express the request incrementally (400)."""

    code = "template_error"


class SessionNotFoundError(SessionError):
    status = 404
    code = "session_not_found"


class SessionBusyError(SessionError):
    """A second concurrent chat on one session; refused at once so it never reaches the engine (409)."""

    status = 409
    code = "session_busy"


class InvariantError(SessionError):
    """A broken internal invariant: a bug, never the client's fault (500)."""

    status = 500
    code = "invariant_violation"


class TokenizationError(SessionError):
    status = 500
    code = "tokenization_error"


class UpstreamError(SessionError):
    """The engine answered something we refuse to record (502); `rule` names the broken rule."""

    status = 502
    code = "upstream_error"

    def __init__(self, message: str, rule: str = "upstream") -> None:
        super().__init__(message)
        self.rule = rule


class EngineUnavailableError(SessionError):
    """The engine could not be reached or the connection failed mid-request (502)."""

    status = 502
    code = "engine_unavailable"


class SessionPausedError(SessionError):
    """Generation is paused (e.g. a weight update); the client should retry after `retry_after` seconds (503)."""

    status = 503
    code = "session_paused"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def error_body(err: BaseException) -> dict[str, Any]:
    """OpenAI-style error JSON; anything that is not a SessionError is an opaque 500 (no internals leak)."""
    if isinstance(err, SessionError):
        error: dict[str, Any] = {"message": err.message, "type": err.code, "code": err.status}
        if isinstance(err, UpstreamError):
            error["rule"] = err.rule
        return {"error": error}
    return {"error": {"message": "internal server error", "type": SessionError.code, "code": SessionError.status}}
