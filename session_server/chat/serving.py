"""Chat Completions as a front end of the turn pipeline (turns/turn.py): the request (protocol.py), the plain reply
(reply.py), the chat.completion.chunk stream (stream.py) and the error shape (frontend/errors.py). Everything else
-- the slot, TITO, the engine call and its race, validation, the commit -- is session_server/turns.
"""

from __future__ import annotations

from starlette.responses import Response

from session_server.chat.protocol import parse_request
from session_server.chat.reply import chat_completion
from session_server.chat.stream import ChatStream
from session_server.frontend.chat_request import ChatRequest
from session_server.frontend.errors import chat_error
from session_server.frontend.token_ids import turn_tokens
from session_server.turns.output import TurnOutput
from session_server.turns.turn import Turn, TurnRequest
from trajectory import LinearTrajectory
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits


class ChatCompletions:
    """The FrontEnd (turns/turn.py) of OpenAI Chat Completions."""

    name = "chat"

    def parse(self, body: bytes, trajectory: LinearTrajectory,
              images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[ChatRequest]:
        return parse_request(body, trajectory, images)

    def reply(self, turn: Turn[ChatRequest], out: TurnOutput) -> bytes:
        return chat_completion(out, turn.family, turn.rid, turn.model, turn.created, turn.request.api.options,
                               turn_tokens(turn.return_token_ids, turn.plan, out), turn.adapter)

    def stream(self, turn: Turn[ChatRequest]) -> ChatStream:
        return ChatStream(turn)

    def error(self, err: SessionError) -> Response:
        return chat_error(err)

    def wants_logprobs(self, request: ChatRequest) -> bool:
        return request.options.logprobs


CHAT = ChatCompletions()
