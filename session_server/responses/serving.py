"""The Responses API as a front end of the turn pipeline (turns/turn.py): parse, with `previous_response_id` resolved
on the session's own trajectory; the plain reply and the stream (reply.py); the OpenAI error shape; and the response
of a committed turn for `GET /v1/responses/{id}`.

Responses are never stored apart from the trajectory: a response id is `resp_<rid>` of a committed turn, so the
history it continues is the trajectory's messages up to that turn's checkpoint (the matcher meets the stored
messages themselves and appends: nothing is re-rendered), and a GET rebuilds the response from the turn's record.
An id that is not a turn of this session -- another session's, a rolled-back one -- is a 404. DELETE is not
offered: a response is a turn of a training trajectory, removed only with its session.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from session_server.errors import (
    EngineRefusedError,
    SessionNotFoundError,
    engine_message,
    json_response,
    retry_headers,
)
from session_server.frontend.chat_request import read_chat
from session_server.frontend.reply_facts import encode_json, reply_facts, sse_event, turn_facts
from session_server.frontend.token_ids import turn_tokens
from session_server.http.body import decode_object
from session_server.responses.protocol import ResponsesTurn, parse_responses
from session_server.responses.reply import ResponseBuilder, response_body
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn, TurnRequest
from trajectory import LinearTrajectory
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits

RESPONSE_PREFIX = "resp_"
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


def turn_of_response(trajectory: LinearTrajectory, response_id: str) -> int:
    """The index of the committed turn that answered `response_id`, else a 404."""
    if response_id.startswith(RESPONSE_PREFIX):
        rid = response_id[len(RESPONSE_PREFIX):]
        for k, record in enumerate(trajectory.records):
            if record.rid == rid:
                return k
    raise SessionNotFoundError(f"response {response_id} is not a turn of this session")


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


class Responses:
    """The FrontEnd of the OpenAI Responses API: its requests map onto the chat request every API shares
    (frontend/chat_request.py)."""

    name = "responses"

    def parse(self, body: bytes, trajectory: LinearTrajectory,
              images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[ResponsesTurn]:
        obj = decode_object(body)
        previous = obj.get("previous_response_id")
        history = None
        if isinstance(previous, str):
            turn = turn_of_response(trajectory, previous)
            history = trajectory.messages[: trajectory.checkpoints[turn].num_messages]
        mapped = parse_responses(obj, trajectory.family.thinking_switch, history)
        request = read_chat(mapped.chat, trajectory.family, mapped, images, trajectory.images)
        request.ignored = mapped.ignored
        return request

    def reply(self, turn: Turn[ResponsesTurn], out: TurnOutput) -> bytes:
        facts = reply_facts(turn.family, out.result, out.message)
        return encode_json(response_body(turn.rid, turn.model, turn.created, turn.request.api, out.message, facts,
                                         turn_tokens(turn.return_token_ids, turn.plan, out)))

    def stream(self, turn: Turn[ResponsesTurn]) -> ResponsesStream:
        return ResponsesStream(turn)

    def error(self, err: SessionError) -> Response:
        status, body = error_payload(err)
        return json_response(body, status, retry_headers(err))

    def wants_logprobs(self, request: ResponsesTurn) -> bool:
        return False


def stored_response(trajectory: LinearTrajectory, response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id}: the response of a committed turn, rebuilt from its record (the request's echo
    fields are not kept, only what the turn produced)."""
    k = turn_of_response(trajectory, response_id)
    record = trajectory.records[k]
    ids, _ = trajectory.turn_tokens(k)
    family = trajectory.family
    facts = turn_facts(family, record.finish_reason, record.prompt_tokens, record.cached_tokens,
                       ids[record.prompt_len:], record.message)
    return response_body(record.rid or "", family.name, 0, ResponsesTurn(chat={}), record.message, facts)
