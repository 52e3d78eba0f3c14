"""Every error shape of the three APIs, plain and streamed, rendered in one place from one error.

An error carries its status, its machine-readable `code` and whether it is worth retrying (session_server/errors.py);
what each API makes of that is a table here, one per API, matching what the real API returns:

    OpenAI (Chat Completions, Responses)    {"error": {"message", "type", "param", "code"}}
        type by status (OPENAI_TYPES: every 4xx an `invalid_request_error`, as OpenAI answers an unknown model,
        response or API key; 5xx `server_error`, 503 `service_unavailable_error`), `code` the error's own code
        (`session_not_found`, `session_paused`, ...), `param` null. An engine reply that broke a rule adds the
        `rule` it broke. A retryable refusal is its 503 with `Retry-After`.
        - Chat passes the engine's own refusal through as it came (docs/design.md 3); Responses renders its message
          in the shape above with the engine's status.
        - Chat streamed: one `data: {"error": {...}}` chunk ends the stream, with `retry_after` (seconds) when the
          turn may be retried (no header can say it after the 200).
        - Responses streamed: `response.failed`, the response object with `error: {"code", "message"}`.
    Anthropic (Messages)                    {"type": "error", "error": {"type", "message"}}
        type by status (ANTHROPIC_TYPES: 400 and every unlisted 4xx `invalid_request_error`, 401 `authentication_error`,
        403 `permission_error`, 404 `not_found_error`, 413 `request_too_large`, 429 `rate_limit_error`, 504
        `timeout_error`, 529 `overloaded_error`, every other 5xx `api_error`). A retryable refusal is `529
        overloaded_error` with `Retry-After`: Claude Code retries a 529 with growing waits, where a 503 could end the
        episode. The engine's own refusal keeps its status and message.
        - streamed: an `event: error` with the same body.

The status codes are the error's own (the e2e tests pin them); only the Anthropic retryable refusal is a 529.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from session_server.errors import EngineRefusedError, engine_message, json_response, retry_headers
from session_server.frontend.reply_facts import sse_event
from trajectory.errors import SessionError, UpstreamError

# -- OpenAI: Chat Completions and Responses --------------------------------------------------------------------------

OPENAI_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
    404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
    409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 502: "server_error", 503: "service_unavailable_error", 504: "server_error",
}


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


def openai_error(err: SessionError, status: int | None = None, message: str | None = None) -> dict[str, Any]:
    """The error object of both OpenAI APIs; `status` and `message` where they are not the error's own (an engine's
    refusal)."""
    error: dict[str, Any] = {"message": err.message if message is None else message,
                             "type": openai_type(err.status if status is None else status), "param": None,
                             "code": err.code}
    if isinstance(err, UpstreamError):
        error["rule"] = err.rule
    return error


def chat_error(err: SessionError) -> Response:
    """Chat Completions' error before the first byte; the engine's own refusal as it came."""
    if isinstance(err, EngineRefusedError):
        return Response(err.body, status_code=err.engine_status, media_type=err.content_type)
    return json_response({"error": openai_error(err)}, err.status, retry_headers(err))


def chat_stream_error(err: SessionError) -> bytes:
    """The chunk that ends a Chat Completions stream which failed after its first byte."""
    error = openai_error(err)
    if err.retryable:
        error["retry_after"] = max(1, int(err.retry_after))
    return sse_event(None, {"error": error})


def responses_error(err: SessionError) -> Response:
    """The Responses API's error before the first byte; the engine's own refusal with its status and message."""
    status, message = err.status, None
    if isinstance(err, EngineRefusedError):
        status, message = err.engine_status, engine_message(err.body)
    return json_response({"error": openai_error(err, status, message)}, status, retry_headers(err))


def response_failed(err: SessionError, response: dict[str, Any], sequence: int) -> bytes:
    """`response.failed`: the end of a Responses stream whose turn failed after the first byte (`response` is the
    response object so far, `sequence` the event's number)."""
    failed = {**response, "status": "failed", "error": {"code": err.code, "message": err.message}}
    return sse_event("response.failed", {"type": "response.failed", "sequence_number": sequence, "response": failed})


# -- Anthropic: Messages ----------------------------------------------------------------------------------------------

OVERLOADED = 529
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
    OVERLOADED: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def messages_payload(err: SessionError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in Anthropic's shape."""
    status, message = err.status, err.message
    if isinstance(err, EngineRefusedError):
        status, message = err.engine_status, engine_message(err.body)
    elif err.retryable:
        status = OVERLOADED
    return status, {"type": "error", "error": {"type": anthropic_type(status), "message": message}}


def messages_error(err: SessionError) -> Response:
    """The Messages API's error before the first byte."""
    status, body = messages_payload(err)
    return json_response(body, status, retry_headers(err))


def messages_stream_error(err: SessionError) -> bytes:
    """The `error` event that ends a Messages stream which failed after its first byte."""
    return sse_event("error", messages_payload(err)[1])
