"""The server's errors and their rendering: every SessionError carries its status, we only render it.

The pure core's errors (bad request, template, rollback, invariant, engine reply that breaks a rule) come from
trajectory/errors.py; the failure modes that exist only because there is a server -- unknown, busy or paused
sessions, an engine that cannot be reached or does not answer in time, a body too large, a client gone, admin auth --
are defined here as subclasses of the same base. What an error may say is declared on the base (trajectory/errors.py):
`status`, `code`, `retryable` with `retry_after`, and `abort_reason` (why a chat was cut off: `AbortReason`, the
label it is counted by). A handler lets them escape: the error boundary (http/front_door.py) renders the server's own
routes' errors here; the three APIs render theirs in their own shapes (frontend/errors.py). The whole tree:

    SessionError                       500 internal_error          (trajectory/errors.py: the base)
    ├── RequestValidationError         400 invalid_request
    │   ├── RollbackLimitError         400 rollback_limit_exceeded
    │   ├── ForkPointError             400 invalid_fork_point
    │   ├── TemplateError              400 template_error
    │   └── LimitExceededError         400 limit_exceeded          (+ `limit`, the refusal's metric label)
    ├── InvariantError                 500 invariant_violation
    ├── TokenizationError              500 tokenization_error
    ├── UpstreamError                  502 upstream_error          (+ `rule`, the engine reply's broken rule)
    ├── SessionNotFoundError           404 session_not_found
    ├── RouteNotFoundError             404 not_found
    ├── MethodNotAllowedError          405 method_not_allowed
    ├── AdminAuthError                 401 unauthorized
    ├── RequestTimeoutError            408 request_timeout
    ├── SessionBusyError               409 session_busy
    ├── RequestTooLargeError           413 request_too_large
    ├── ClientDisconnectedError        499 client_disconnected
    ├── EngineUnavailableError         502 engine_unavailable
    ├── EngineTimeoutError             504 engine_timeout
    ├── EngineRefusedError             the engine's own status     engine_refused (its body passed on)
    └── RetryLaterError                503, retryable: Retry-After: `retry_after`
        ├── SessionPausedError         503 session_paused
        ├── TooManySessionsError       503 too_many_sessions
        │   └── ForkCapacityError      429 too_many_sessions       (a fork's N children do not fit now)
        └── EngineAbortedError         503 engine_aborted          (abort_reason ENGINE; + `partial`)

An abort is any of them with an `abort_reason` (`tag_abort`): a client gone (ClientDisconnectedError), a DELETE or
an expiry (SessionNotFoundError), a pause or a shutdown (SessionPausedError), the deadline (EngineTimeoutError), the
engine's own abort (EngineAbortedError).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from trajectory import GenerateResult
from trajectory.errors import AbortReason as AbortReason
from trajectory.errors import RequestValidationError, SessionError, UpstreamError


def tag_abort(err: SessionError, reason: AbortReason) -> SessionError:
    """Mark an error as the end of an aborted chat, so the handler counts it once, by reason (metrics.abort)."""
    err.abort_reason = reason
    return err


class SessionNotFoundError(SessionError):
    status = 404
    code = "session_not_found"


class SessionBusyError(SessionError):
    """A second concurrent chat on one session; refused at once so it never reaches the engine (409)."""

    status = 409
    code = "session_busy"


class EngineUnavailableError(SessionError):
    """The engine could not be reached or the connection failed mid-request (502)."""

    status = 502
    code = "engine_unavailable"


class RetryLaterError(SessionError):
    """A 503 that says when to come back: `retry_after` seconds, sent as the Retry-After header (retry_headers)."""

    status = 503
    retryable = True

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SessionPausedError(RetryLaterError):
    """Generation is paused (e.g. a weight update); the client should retry after `retry_after` seconds (503)."""

    code = "session_paused"


class EngineAbortedError(RetryLaterError):
    """The engine ended the request itself (its own pause, a weight update, an abort in its queue): nothing was
    generated that could be committed, and the same turn can be retried (503). Counted as an abort by the engine."""

    code = "engine_aborted"
    abort_reason = AbortReason.ENGINE

    def __init__(self, message: str, retry_after: int = 1, partial: GenerateResult | None = None) -> None:
        super().__init__(message, retry_after)
        self.partial = partial  # what the engine sampled before the abort (turns/resume.py may continue from it)


class EngineRefusedError(SessionError):
    """The engine's own non-2xx reply (e.g. a prompt longer than its context): the agent gets it as it came, with the
    engine's status and body, and nothing is recorded."""

    code = "engine_refused"

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"engine answered HTTP {status}")
        self.engine_status = status
        self.body = body
        self.content_type = content_type


class LimitExceededError(RequestValidationError):
    """A request over a token limit (the engine's context, --max-session-tokens): a 400 that names the limit."""

    code = "limit_exceeded"

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit  # the label of metrics' limit_refusals


class TooManySessionsError(RetryLaterError):
    """--max-sessions live sessions exist; the client should retry after `retry_after` seconds (503)."""

    code = "too_many_sessions"


class ForkCapacityError(TooManySessionsError):
    """A fork's N children would take the server past --max-sessions now (429 + Retry-After; N larger than the limit
    itself is a 400). Not a 503: the server is up and serves every other request; this request asked for more
    sessions at once than it has room for, and a proxy that retries a 503 on another upstream (nginx's
    proxy_next_upstream) would carry the fork away from the replica that holds its parent."""

    status = 429


class AdminAuthError(SessionError):
    status = 401
    code = "unauthorized"


class RequestTooLargeError(SessionError):
    status = 413
    code = "request_too_large"


class RequestTimeoutError(SessionError):
    """The request body did not arrive within the upload deadline (408; the request itself may be fine)."""

    status = 408
    code = "request_timeout"


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


def error_body(err: BaseException) -> dict[str, Any]:
    """The server's own routes' error JSON (miles' session server's shape: `type` the code, `code` the status);
    anything that is not a SessionError is an opaque 500 (no internals leak)."""
    if isinstance(err, SessionError):
        error: dict[str, Any] = {"message": err.message, "type": err.code, "code": err.status}
        if isinstance(err, UpstreamError):
            error["rule"] = err.rule
        return {"error": error}
    return {"error": {"message": "internal server error", "type": SessionError.code, "code": SessionError.status}}


_json = msgspec.json.Encoder()


def json_response(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(payload), status_code=status, headers=headers, media_type="application/json")


def engine_message(body: bytes) -> str:
    """The message of an engine error body (SGLang's native `{"error": {"message"}}` or OpenAI's shape), else its
    text: what another API's error shape carries of the engine's own refusal."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        obj = None
    error = obj.get("error", obj) if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else body.decode("utf-8", "replace")[:2000]


def retry_headers(err: SessionError) -> dict[str, str] | None:
    """`Retry-After` for the refusals that say when to come back (pause, full, drain, an engine abort)."""
    if err.retryable:
        return {"Retry-After": str(max(1, int(err.retry_after)))}
    return None


def error_response(err: SessionError) -> Response:
    if isinstance(err, EngineRefusedError):
        return Response(err.body, status_code=err.engine_status, media_type=err.content_type)
    return json_response(error_body(err), err.status, retry_headers(err))


async def not_found(request: Request, exc: Exception) -> Response:
    """Any path the route table does not know, including engine paths under a session URL."""
    return error_response(RouteNotFoundError(f"no route for {request.method} {request.url.path}"))


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(MethodNotAllowedError(f"method {request.method} not allowed on {request.url.path}"))
