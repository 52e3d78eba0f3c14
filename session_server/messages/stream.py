"""Anthropic Messages' stream: `message_start` ... `message_stop`, built block by block by reply.py's builder, and an
`error` event for a failure after the first byte.
"""

from __future__ import annotations

from typing import Any

from session_server.errors import EngineRefusedError, RetryLaterError, engine_message
from session_server.frontend.reply_facts import reply_facts, sse_event
from session_server.messages.protocol import MessagesTurn
from session_server.messages.reply import MessageBuilder
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn
from trajectory.errors import SessionError

OVERLOADED = 529
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
          413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", OVERLOADED: "overloaded_error"}


def error_payload(err: SessionError) -> tuple[int, dict[str, Any]]:
    status, message = err.status, err.message
    if isinstance(err, EngineRefusedError):
        status, message = err.engine_status, engine_message(err.body)
    elif isinstance(err, RetryLaterError):
        status = OVERLOADED
    return status, {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


class MessagesStream:
    """The StreamFormat (turns/turn.py) of Anthropic Messages: `message_start` ... `message_stop`."""

    def __init__(self, turn: Turn[MessagesTurn]) -> None:
        self.turn = turn
        self.builder = MessageBuilder(turn.rid, turn.model)
        self.last = b""

    def start(self) -> list[bytes]:
        return self.builder.start(len(self.turn.plan.prompt_ids))

    def delta(self, delta: dict[str, Any] | None, tokens: NewTokens | None) -> list[bytes]:
        return self.builder.delta(delta)

    def finish(self, out: TurnOutput, rest: dict[str, Any] | None, tokens: NewTokens | None) -> list[bytes]:
        facts = reply_facts(self.turn.family, out.result, out.message, self.turn.request.api.stop_sequences)
        events = self.builder.finish(rest, facts)
        self.last = events.pop()  # message_stop: sent once the slot is free again (end)
        return events

    def end(self) -> bytes:
        return self.last

    def error(self, err: SessionError) -> list[bytes]:
        return [sse_event("error", error_payload(err)[1])]
