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
