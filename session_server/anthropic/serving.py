"""The Anthropic Messages API as a front end of the turn pipeline (turns/turn.py): parse, the plain reply and the
stream (reply.py), and Anthropic's error shape.

Errors are `{"type": "error", "error": {"type", "message"}}` with Anthropic's types. A retryable refusal -- the
engine aborted the turn, generation is paused, too many sessions -- is `529 overloaded_error` with `Retry-After`:
Claude Code retries a 529 with growing waits, where a 503 could end the episode. A 400 keeps its message, which
names the refused field (Claude Code answers a 400 by retrying without beta features, so it must say what it was).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from session_server.anthropic.protocol import MessagesTurn, parse_messages
from session_server.anthropic.reply import MessageBuilder, message_body
from session_server.errors import (
    EngineRefusedError,
    RetryLaterError,
    engine_message,
    json_response,
    retry_headers,
)
from session_server.frontend.chat_request import read_chat
from session_server.frontend.reply_facts import encode_json, reply_facts, sse_event
from session_server.http.body import decode_object
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn, TurnRequest
from trajectory import LinearTrajectory, ModelFamily
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, Image, ImageLimits

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


def parse_body(body: bytes, family: ModelFamily, count_only: bool = False, images: ImageLimits = NO_IMAGE_LIMITS,
               known: Mapping[str, Image] | None = None) -> TurnRequest[MessagesTurn]:
    """A Messages (or count_tokens) request body as the turn's request; `known`: the session's images."""
    mapped = parse_messages(decode_object(body), family.thinking_switch, count_only)
    request = read_chat(mapped.chat, family, mapped, images, known)
    request.ignored = mapped.ignored
    return request


class Messages:
    """The FrontEnd of the Anthropic Messages API: its requests map onto the chat request every API shares
    (frontend/chat_request.py)."""

    name = "messages"

    def parse(self, body: bytes, trajectory: LinearTrajectory,
              images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[MessagesTurn]:
        return parse_body(body, trajectory.family, images=images, known=trajectory.images)

    def reply(self, turn: Turn[MessagesTurn], out: TurnOutput) -> bytes:
        facts = reply_facts(turn.family, out.result, out.message, turn.request.api.stop_sequences)
        return encode_json(message_body(turn.rid, turn.model, out.message, facts))

    def stream(self, turn: Turn[MessagesTurn]) -> MessagesStream:
        return MessagesStream(turn)

    def error(self, err: SessionError) -> Response:
        status, body = error_payload(err)
        return json_response(body, status, retry_headers(err))

    def wants_logprobs(self, request: MessagesTurn) -> bool:
        return False
