"""The Responses API's stream: `response.created` ... `response.completed` (or `response.incomplete`), built item
by item by reply.py's builder, and `response.failed` for a failure after the first byte.
"""

from __future__ import annotations

from typing import Any

from session_server.frontend.errors import response_failed
from session_server.frontend.reply_facts import reply_facts
from session_server.frontend.token_ids import turn_tokens
from session_server.responses.protocol import ResponsesTurn
from session_server.responses.reply import ResponseBuilder
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn
from trajectory.errors import SessionError


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
        builder.sequence += 1
        return [response_failed(err, builder.response("failed"), builder.sequence - 1)]
