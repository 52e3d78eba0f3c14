"""The Responses API as a front end of the turn pipeline (turns/turn.py): the request, with `previous_response_id`
resolved on the session's own trajectory (protocol.py), the plain reply (reply.py), the stream (stream.py) and the
OpenAI error shape (frontend/errors.py).

Responses are never stored apart from the trajectory: a response id is `resp_<rid>` of a committed turn, so the
history it continues is the trajectory's messages up to that turn's checkpoint, and a GET rebuilds the response
from the turn's record (reply.py `stored_response`). An id that is not a turn of this session -- another
session's, a rolled-back one -- is a 404. DELETE is not offered: a response is a turn of a training trajectory,
removed only with its session.
"""

from __future__ import annotations

from starlette.responses import Response

from session_server.frontend.errors import responses_error
from session_server.frontend.reply_facts import encode_json, reply_facts
from session_server.frontend.token_ids import turn_tokens
from session_server.responses.protocol import ResponsesTurn, parse_request
from session_server.responses.reply import response_body
from session_server.responses.stream import ResponsesStream
from session_server.turns.output import TurnOutput
from session_server.turns.turn import Turn, TurnRequest
from trajectory import LinearTrajectory
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits


class Responses:
    """The FrontEnd of the OpenAI Responses API: its requests map onto the chat request every API shares
    (frontend/chat_request.py)."""

    name = "responses"

    def parse(self, body: bytes, trajectory: LinearTrajectory,
              images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[ResponsesTurn]:
        return parse_request(body, trajectory, images)

    def reply(self, turn: Turn[ResponsesTurn], out: TurnOutput) -> bytes:
        facts = reply_facts(turn.family, out.result, out.message)
        return encode_json(response_body(turn.rid, turn.model, turn.created, turn.request.api, out.message, facts,
                                         turn_tokens(turn.return_token_ids, turn.plan, out)))

    def stream(self, turn: Turn[ResponsesTurn]) -> ResponsesStream:
        return ResponsesStream(turn)

    def error(self, err: SessionError) -> Response:
        return responses_error(err)

    def wants_logprobs(self, request: ResponsesTurn) -> bool:
        return False


RESPONSES = Responses()
