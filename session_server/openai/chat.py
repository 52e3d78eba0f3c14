"""POST /sessions/{id}/v1/chat/completions: the Chat Completions front end over the turn pipeline.

It only translates: the request into the turn's messages, tools and sampling params (protocol.py, fields.py), the
turn's output into a chat completion or, with `stream: true`, chat.completion.chunk events (chat_stream.py), and
errors into the server's JSON error shape. Everything else -- the slot, TITO, the engine call and its race,
validation, the commit -- is session_server/turns.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import error_response
from session_server.openai.chat_stream import ChatStream
from session_server.openai.protocol import ChatRequest, chat_completion, parse_chat_request, turn_tools
from session_server.turns.output import TurnOutput
from session_server.turns.pipeline import serve_turn
from session_server.turns.turn import Turn, TurnRequest
from trajectory import ModelFamily
from trajectory.errors import SessionError


class ChatCompletions:
    """The FrontEnd (turns/turn.py) of OpenAI Chat Completions."""

    def parse(self, body: bytes, family: ModelFamily) -> TurnRequest[ChatRequest]:
        chat = parse_chat_request(body, family.stop_token_ids, family.vocab_size)
        options = chat.options
        return TurnRequest(
            messages=chat.messages, tools=turn_tools(chat, family), sampling_params=chat.sampling_params, api=chat,
            template_kwargs=options.chat_template_kwargs, stream=chat.stream, model=chat.model,
            top_logprobs=options.top_logprobs, parse_tool_calls=options.parse_tool_calls,
        )

    def reply(self, turn: Turn[ChatRequest], out: TurnOutput) -> bytes:
        return chat_completion(out, turn.family, turn.rid, turn.model, turn.created, turn.request.api.options)

    def stream(self, turn: Turn[ChatRequest]) -> ChatStream:
        return ChatStream(turn)

    def error(self, err: SessionError) -> Response:
        return error_response(err)

    def wants_logprobs(self, request: ChatRequest) -> bool:
        return request.options.logprobs


CHAT = ChatCompletions()


async def chat_completions(request: Request) -> Response:
    return await serve_turn(request, request.path_params["session_id"], CHAT)


async def serve_chat(request: Request, session_id: str) -> Response:
    """One chat on the session `session_id`, however the request addressed it (URL path or X-Session-ID)."""
    return await serve_turn(request, session_id, CHAT)
