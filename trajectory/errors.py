"""The pure core's errors: what can go wrong in a request, a template, a trajectory or an engine reply.

Every class carries the HTTP status it maps to, so the server renders any of them without a mapping table; the
errors that exist only because there is a server (unknown session, busy, paused, engine transport, timeouts) live
with the HTTP layer in session_server/errors.py, as subclasses of the same base, whose docstring draws the whole tree.
What any error may say is declared here, on the base, so no reader asks an error for an attribute it may lack.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class AbortReason(enum.Enum):
    """Why a chat was cut off before its commit (its engine request aborted, nothing committed): the reason a claim
    is aborted for, the error the agent hears, and the `cause` label of session_server_aborts_total."""

    DISCONNECT = "disconnect"  # the client went away
    DELETE = "delete"  # DELETE /sessions/{id}
    PAUSE = "pause"  # /admin/pause with mode=abort
    TIMEOUT = "timeout"  # the engine did not answer within --request-timeout
    EXPIRY = "expiry"  # the idle sweep deleted the session (a chat stuck past the request timeout)
    SHUTDOWN = "shutdown"  # SIGTERM
    ENGINE = "engine"  # the engine aborted the request itself (its own pause, a weight update)
    STALE = "stale"  # cut by a push past --max-staleness and refused (--stale-turns refuse)


class SessionError(Exception):
    """Base class: `status` is the HTTP status, `code` the machine-readable error type, `retryable` whether the same
    request may succeed after `retry_after` seconds (sent as Retry-After), `abort_reason` why the chat was cut off
    when it was (counted once, by that reason), else None."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    retryable: ClassVar[bool] = False
    retry_after: int = 0
    abort_reason: AbortReason | None = None

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


class ForkPointError(RequestValidationError):
    """A fork asked for a point that is not a turn boundary of the session's current segment (400)."""

    code = "invalid_fork_point"


class TemplateError(RequestValidationError):
    """The family's chat template cannot express the request incrementally (400)."""

    code = "template_error"




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


