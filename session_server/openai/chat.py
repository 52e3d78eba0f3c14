"""POST /sessions/{id}/v1/chat/completions: the Chat Completions front end over the turn pipeline.

It only translates: the request into the turn's messages, tools and sampling params (protocol.py, fields.py), the
turn's output into a chat completion or, with `stream: true`, chat.completion.chunk events (chat_stream.py), and
errors into the server's JSON error shape. Everything else -- the slot, TITO, the engine call and its race,
validation, the commit -- is session_server/turns.
"""

from __future__ import annotations

from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import error_response
from session_server.openai.chat_stream import ChatStream
from session_server.openai.protocol import ChatRequest, chat_completion, chat_request, parse_chat_request, turn_tools
from session_server.turns.output import TurnOutput
from session_server.turns.pipeline import serve_turn
from session_server.turns.token_ids import turn_tokens
from session_server.turns.turn import Turn, TurnRequest
from trajectory import LinearTrajectory, ModelFamily
from trajectory.errors import SessionError


def turn_request(chat: ChatRequest, family: ModelFamily, api: R) -> TurnRequest[R]:
    options = chat.options
    return TurnRequest(
        messages=chat.messages, tools=turn_tools(chat, family), sampling_params=chat.sampling_params, api=api,
        template_kwargs=options.chat_template_kwargs, stream=chat.stream, model=chat.model,
        top_logprobs=options.top_logprobs, parse_tool_calls=options.parse_tool_calls,
        messages_json=chat.messages_json, return_token_ids=options.return_token_ids,
    )


def read_chat(obj: dict[str, Any], family: ModelFamily, api: R) -> TurnRequest[R]:
    """The ChatReader (turns/turn.py) the Responses and Anthropic front ends map their requests onto."""
    return turn_request(chat_request(obj, family.stop_token_ids, family.vocab_size), family, api)


R = TypeVar("R")


class ChatCompletions:
    """The FrontEnd (turns/turn.py) of OpenAI Chat Completions."""

    name = "chat"

    def parse(self, body: bytes, trajectory: LinearTrajectory) -> TurnRequest[ChatRequest]:
        family = trajectory.family
        chat = parse_chat_request(body, family.stop_token_ids, family.vocab_size, trajectory.sent)
        return turn_request(chat, family, chat)

    def reply(self, turn: Turn[ChatRequest], out: TurnOutput) -> bytes:
        return chat_completion(out, turn.family, turn.rid, turn.model, turn.created, turn.request.api.options,
                               turn_tokens(turn.return_token_ids, turn.plan, out))

    def stream(self, turn: Turn[ChatRequest]) -> ChatStream:
        return ChatStream(turn)

    def error(self, err: SessionError) -> Response:
        return error_response(err)

    def wants_logprobs(self, request: ChatRequest) -> bool:
        return request.options.logprobs


CHAT = ChatCompletions()


async def chat_completions(request: Request) -> Response:
    return await serve_turn(request, request.path_params["session_id"], CHAT)

