"""One error hierarchy across layers: pure-core errors (trajectory.errors) and the server's own
(session_server.errors) share the base, each carries its status, and one renderer turns any of them into the
OpenAI-style body without leaking internals."""

from __future__ import annotations

import pytest

from session_server import errors as server_errors
from session_server.errors import error_body
from trajectory import errors


@pytest.mark.parametrize(("cls", "status"), [
    (errors.RequestValidationError, 400), (errors.RollbackLimitError, 400), (errors.TemplateError, 400),
    (server_errors.SessionNotFoundError, 404), (server_errors.SessionBusyError, 409), (errors.InvariantError, 500),
    (errors.TokenizationError, 500), (errors.UpstreamError, 502), (server_errors.EngineUnavailableError, 502),
    (server_errors.SessionPausedError, 503), (server_errors.AdminAuthError, 401),
    (server_errors.RequestTooLargeError, 413), (server_errors.EngineTimeoutError, 504),
])
def test_error_statuses_and_body(cls, status):
    err = cls("what went wrong")
    assert err.status == status and isinstance(err, errors.SessionError)
    body = error_body(err)["error"]
    assert (body["message"], body["type"], body["code"]) == ("what went wrong", cls.code, status)


def test_error_details():
    assert error_body(errors.UpstreamError("bad", rule="token_range"))["error"]["rule"] == "token_range"
    assert server_errors.SessionPausedError("paused", retry_after=5).retry_after == 5
    assert issubclass(errors.RollbackLimitError, errors.RequestValidationError)
    assert error_body(KeyError("secret internals")) == {
        "error": {"message": "internal server error", "type": "internal_error", "code": 500}}


def test_what_an_error_may_say_is_declared_on_the_base():
    plain = errors.RequestValidationError("bad")
    assert (plain.retryable, plain.retry_after, plain.abort_reason) == (False, 0, None)
    assert server_errors.tag_abort(plain, server_errors.AbortReason.DISCONNECT) is plain
    assert plain.abort_reason is server_errors.AbortReason.DISCONNECT
    assert errors.RequestValidationError("fresh").abort_reason is None  # a tag marks one error, not its class
    for cls in (server_errors.SessionPausedError, server_errors.TooManySessionsError, server_errors.EngineAbortedError):
        err = cls("later", retry_after=3)
        assert err.retryable and err.status == 503 and server_errors.retry_headers(err) == {"Retry-After": "3"}
    assert server_errors.retry_headers(server_errors.EngineUnavailableError("down")) is None


def test_an_engine_abort_is_its_own_retryable_refusal_not_a_pause():
    aborted = server_errors.EngineAbortedError("aborted", retry_after=2)
    assert isinstance(aborted, server_errors.RetryLaterError)
    assert not isinstance(aborted, server_errors.SessionPausedError)
    assert aborted.code == "engine_aborted" and aborted.abort_reason is server_errors.AbortReason.ENGINE
    assert aborted.partial is None


def test_the_docstring_draws_every_error_class():
    classes = {cls.__name__ for cls in (*vars(server_errors).values(), *vars(errors).values())
               if isinstance(cls, type) and issubclass(cls, errors.SessionError)}
    doc = server_errors.__doc__ or ""
    drawn = {word for word in doc.split() if word in classes}
    assert drawn == classes
