"""frontend/errors.py: every error shape of the three APIs, plain and streamed, with each API's status -> type table
as the real API writes it (OpenAI: `{"error": {"message", "type", "param", "code"}}`; Anthropic: `{"type": "error",
"error": {"type", "message"}}`, 529 for a retryable refusal)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from session_server import errors as server_errors
from session_server.frontend import errors as api_errors
from session_server.responses.protocol import ResponsesTurn
from session_server.responses.reply import ResponseBuilder
from trajectory import errors

# (error, its status, OpenAI's type, Anthropic's status, Anthropic's type): every error a front end can answer with.
CASES: list[tuple[errors.SessionError, int, str, int, str]] = [
    (errors.RequestValidationError("bad field"), 400, "invalid_request_error", 400, "invalid_request_error"),
    (errors.RollbackLimitError("too far"), 400, "invalid_request_error", 400, "invalid_request_error"),
    (server_errors.LimitExceededError("too long", "context"), 400, "invalid_request_error", 400,
     "invalid_request_error"),
    (server_errors.AdminAuthError("no"), 401, "invalid_request_error", 401, "authentication_error"),
    (server_errors.SessionNotFoundError("gone"), 404, "invalid_request_error", 404, "not_found_error"),
    (server_errors.RouteNotFoundError("no route"), 404, "invalid_request_error", 404, "not_found_error"),
    (server_errors.MethodNotAllowedError("no"), 405, "invalid_request_error", 405, "invalid_request_error"),
    (server_errors.RequestTimeoutError("slow body"), 408, "invalid_request_error", 408, "invalid_request_error"),
    (server_errors.SessionBusyError("busy"), 409, "invalid_request_error", 409, "invalid_request_error"),
    (server_errors.RequestTooLargeError("big"), 413, "invalid_request_error", 413, "request_too_large"),
    (server_errors.ClientDisconnectedError("gone"), 499, "invalid_request_error", 499, "invalid_request_error"),
    (errors.InvariantError("bug"), 500, "server_error", 500, "api_error"),
    (errors.TokenizationError("bad"), 500, "server_error", 500, "api_error"),
    (errors.UpstreamError("bad reply", rule="nan_logprob"), 502, "server_error", 502, "api_error"),
    (server_errors.EngineUnavailableError("down"), 502, "server_error", 502, "api_error"),
    (server_errors.SessionPausedError("paused", 7), 503, "service_unavailable_error", 529, "overloaded_error"),
    (server_errors.TooManySessionsError("full", 7), 503, "service_unavailable_error", 529, "overloaded_error"),
    (server_errors.EngineAbortedError("aborted", 7), 503, "service_unavailable_error", 529, "overloaded_error"),
    (server_errors.EngineTimeoutError("slow"), 504, "server_error", 504, "timeout_error"),
]
IDS = [type(case[0]).__name__ for case in CASES]


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "invalid_request_error"), (403, "invalid_request_error"),
    (404, "invalid_request_error"), (405, "invalid_request_error"), (408, "invalid_request_error"),
    (409, "invalid_request_error"), (413, "invalid_request_error"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (499, "invalid_request_error"), (500, "server_error"), (502, "server_error"),
    (503, "service_unavailable_error"), (504, "server_error"), (507, "server_error"),
])
def test_openai_types_by_status(status: int, kind: str) -> None:
    assert api_errors.openai_type(status) == kind


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (408, "invalid_request_error"),
    (409, "invalid_request_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "api_error"), (504, "timeout_error"),
    (529, "overloaded_error"),
])
def test_anthropic_types_by_status(status: int, kind: str) -> None:
    assert api_errors.anthropic_type(status) == kind


def _json(response: Any) -> Any:
    return json.loads(bytes(response.body))


def _sse(event: bytes) -> tuple[str | None, Any]:
    lines = event.decode().split("\n")
    assert event.endswith(b"\n\n") and lines[-2:] == ["", ""]
    name = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
    return name, json.loads(lines[-3].removeprefix("data: "))


@pytest.mark.parametrize(("err", "status", "openai", "a_status", "anthropic"), CASES, ids=IDS)
def test_both_openai_apis_write_one_shape(err: errors.SessionError, status: int, openai: str, a_status: int,
                                          anthropic: str) -> None:
    expected: dict[str, Any] = {"message": err.message, "type": openai, "param": None, "code": err.code}
    if isinstance(err, errors.UpstreamError):
        expected["rule"] = "nan_logprob"
    retry = {"retry-after": "7"} if status == 503 else {}
    for render in (api_errors.chat_error, api_errors.responses_error):
        response = render(err)
        assert response.status_code == status and _json(response) == {"error": expected}
        assert response.headers.get("retry-after") == retry.get("retry-after")
        assert response.media_type == "application/json"


@pytest.mark.parametrize(("err", "status", "openai", "a_status", "anthropic"), CASES, ids=IDS)
def test_messages_shape(err: errors.SessionError, status: int, openai: str, a_status: int, anthropic: str) -> None:
    response = api_errors.messages_error(err)
    assert response.status_code == a_status
    assert _json(response) == {"type": "error", "error": {"type": anthropic, "message": err.message}}
    assert response.headers.get("retry-after") == ("7" if status == 503 else None)
    assert _sse(api_errors.messages_stream_error(err)) == ("error", _json(response))


def test_codes_are_the_errors_own() -> None:
    assert [case[0].code for case in CASES] == [
        "invalid_request", "rollback_limit_exceeded", "limit_exceeded", "unauthorized", "session_not_found",
        "not_found", "method_not_allowed", "request_timeout", "session_busy", "request_too_large",
        "client_disconnected", "invariant_violation", "tokenization_error", "upstream_error", "engine_unavailable",
        "session_paused", "too_many_sessions", "engine_aborted", "engine_timeout"]


REFUSED = server_errors.EngineRefusedError(
    400, b'{"error": {"message": "The input (5000 tokens) is longer than the context"}}', "application/json")


def test_an_engine_refusal_passes_through_chat_and_keeps_its_status_elsewhere() -> None:
    chat = api_errors.chat_error(REFUSED)
    assert (chat.status_code, bytes(chat.body)) == (400, REFUSED.body)
    responses = api_errors.responses_error(REFUSED)
    assert responses.status_code == 400 and _json(responses) == {"error": {
        "message": "The input (5000 tokens) is longer than the context", "type": "invalid_request_error",
        "param": None, "code": "engine_refused"}}
    messages = api_errors.messages_error(REFUSED)
    assert messages.status_code == 400 and _json(messages) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "The input (5000 tokens) is longer than the context"}}
    unavailable = server_errors.EngineRefusedError(503, b"overloaded", "text/plain")
    assert _json(api_errors.messages_error(unavailable))["error"] == {"type": "api_error", "message": "overloaded"}
    assert _json(api_errors.responses_error(unavailable))["error"]["type"] == "service_unavailable_error"


def test_chat_stream_error_chunk() -> None:
    paused = server_errors.SessionPausedError("paused", retry_after=0)
    assert _sse(api_errors.chat_stream_error(paused)) == (None, {"error": {
        "message": "paused", "type": "service_unavailable_error", "param": None, "code": "session_paused",
        "retry_after": 1}})  # at least a second
    aborted = server_errors.EngineAbortedError("aborted", retry_after=4)
    assert _sse(api_errors.chat_stream_error(aborted))[1]["error"]["retry_after"] == 4
    bad = errors.UpstreamError("engine failed mid-stream", rule="stream_error")
    assert _sse(api_errors.chat_stream_error(bad)) == (None, {"error": {
        "message": "engine failed mid-stream", "type": "server_error", "param": None, "code": "upstream_error",
        "rule": "stream_error"}})


def test_responses_stream_ends_with_response_failed() -> None:
    builder = ResponseBuilder("r1", "m", 1700000000, ResponsesTurn(chat={}))
    started = builder.start()
    assert builder.sequence == len(started) == 2
    event = api_errors.response_failed(server_errors.SessionNotFoundError("session s was deleted"),
                                       builder.response("failed"), builder.sequence)
    name, payload = _sse(event)
    assert name == "response.failed" and payload["type"] == "response.failed" and payload["sequence_number"] == 2
    failed = payload["response"]
    assert failed["id"] == "resp_r1" and failed["status"] == "failed" and failed["output"] == []
    assert failed["error"] == {"code": "session_not_found", "message": "session s was deleted"}
    assert list(failed) == list(builder.response("failed"))  # the response object's own fields, in its order
