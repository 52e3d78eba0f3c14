"""The Responses API's stream: `response.created` ... `response.completed` (or `response.incomplete`), built item
by item by reply.py's builder, and `response.failed` for a failure after the first byte.
"""

from __future__ import annotations

from typing import Any

from session_server.errors import EngineRefusedError, engine_message
from session_server.frontend.reply_facts import reply_facts, sse_event
from session_server.frontend.token_ids import turn_tokens
from session_server.responses.protocol import ResponsesTurn
from session_server.responses.reply import ResponseBuilder
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn
from trajectory.errors import SessionError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout", 409: "conflict", 413: "invalid_request_error",
          429: "rate_limit_exceeded"}


def error_payload(err: SessionError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in OpenAI's shape; the engine's own refusal keeps its status and message."""
    status, message = err.status, err.message
    if isinstance(err, EngineRefusedError):
        status, message = err.engine_status, engine_message(err.body)
    error = {"message": message, "type": _TYPES.get(status, "server_error"), "param": None, "code": err.code}
    return status, {"error": error}


class ResponsesStream:
    """The StreamFormat (turns/turn.py) of the Responses API: `response.created` ... `response.completed`."""

    def __init__(self, turn: Turn[ResponsesTurn]) -> None:
        self.turn = turn
        self.builder = ResponseBuilder(turn.rid, turn.model, turn.created, turn.request.api)
        self.last = b""

    def start(self) -> list[bytes]:
        return self.builder.start()

    def delta(self, delta: dict[str, Any] | None, tokens: NewTokens | None) -> list[bytes]:
        return self.builder.delta(delta)

    def finish(self, out: TurnOutput, rest: dict[str, Any] | None, tokens: NewTokens | None) -> list[bytes]:
        turn = self.turn
        events = self.builder.finish(rest, reply_facts(turn.family, out.result, out.message),
                                     turn_tokens(turn.return_token_ids, turn.plan, out))
        self.last = events.pop()  # response.completed: sent once the slot is free again (end)
        return events

    def end(self) -> bytes:
        return self.last

    def error(self, err: SessionError) -> list[bytes]:
        """`response.failed`: the stream's end when the turn failed after its first byte (nothing committed)."""
        builder = self.builder
        failed = builder.response("failed")
        failed["error"] = {"code": err.code, "message": err.message}
        payload = {"type": "response.failed", "sequence_number": builder.sequence, "response": failed}
        builder.sequence += 1
        return [sse_event("response.failed", payload)]
