"""Anthropic Messages' stream: `message_start` ... `message_stop`, built block by block by reply.py's builder, and an
`error` event for a failure after the first byte.
"""

from __future__ import annotations

from typing import Any

from session_server.frontend.errors import messages_stream_error
from session_server.frontend.reply_facts import reply_facts
from session_server.messages.protocol import MessagesTurn
from session_server.messages.reply import MessageBuilder
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn
from trajectory.errors import SessionError


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
        return [messages_stream_error(err)]
