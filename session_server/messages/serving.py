"""The Anthropic Messages API as a front end of the turn pipeline (turns/turn.py): the request (protocol.py), the
plain reply (reply.py), the stream (stream.py), and Anthropic's error shape.

Errors are Anthropic's (frontend/errors.py): a retryable refusal is `529 overloaded_error` with `Retry-After`, a 400
keeps its message, which names the refused field (Claude Code answers a 400 by retrying without beta features, so it
must say what it was).
"""

from __future__ import annotations

from starlette.responses import Response

from session_server.frontend.errors import messages_error
from session_server.frontend.reply_facts import encode_json, reply_facts
from session_server.messages.protocol import MessagesTurn, parse_request
from session_server.messages.reply import message_body
from session_server.messages.stream import MessagesStream
from session_server.turns.output import TurnOutput
from session_server.turns.turn import Turn, TurnRequest
from trajectory import LinearTrajectory
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits


class Messages:
    """The FrontEnd of the Anthropic Messages API: its requests map onto the chat request every API shares
    (frontend/chat_request.py)."""

    name = "messages"

    def parse(self, body: bytes, trajectory: LinearTrajectory,
              images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[MessagesTurn]:
        return parse_request(body, trajectory.family, images=images, known=trajectory.images)

    def reply(self, turn: Turn[MessagesTurn], out: TurnOutput) -> bytes:
        facts = reply_facts(turn.family, out.result, out.message, turn.request.api.stop_sequences)
        return encode_json(message_body(turn.rid, turn.model, out.message, facts))

    def stream(self, turn: Turn[MessagesTurn]) -> MessagesStream:
        return MessagesStream(turn)

    def error(self, err: SessionError) -> Response:
        return messages_error(err)

    def wants_logprobs(self, request: MessagesTurn) -> bool:
        return False


MESSAGES = Messages()
