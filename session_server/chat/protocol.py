"""Chat Completions' request: its body read into the chat request every API shares (frontend/chat_request.py), and
that into the turn's request.

Pure, so it runs on the CPU pool. The body is decoded once (msgspec, straight to builtins; chat_body.py keeps the
bytes of a history the session already holds).
"""

from __future__ import annotations

from session_server.chat.chat_body import read_chat_body
from session_server.frontend.chat_request import ChatRequest, chat_request, turn_request
from session_server.turns.turn import TurnRequest
from trajectory import LinearTrajectory
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits
from trajectory.linear import SentHistory


def parse_chat_request(
    body: bytes, stop_token_ids: tuple[int, ...], vocab_size: int | None = None, sent: SentHistory | None = None,
) -> ChatRequest:
    """Decode the body and map the sampling fields to SGLang's `sampling_params`.

    `messages` and `tools` are passed on raw: the trajectory's prepare, which runs right after this in the same
    step, owns their validation (one check, one set of error messages) and rejects bad ones with a 400 as well. The
    tools list's depth and integers are checked with its schemas, once per distinct list (`turn_tools`). `sent`:
    the session's last request messages, whose bytes this body may repeat (chat_body.py).
    """
    read = read_chat_body(body, sent)
    chat = chat_request(read.obj, stop_token_ids, vocab_size)
    chat.messages_json, chat.tools_json = read.messages_json, read.tools_json
    return chat


def parse_request(body: bytes, trajectory: LinearTrajectory,
                  images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[ChatRequest]:
    """A Chat Completions body as the turn's request, on the session's trajectory (its family, last messages and
    images)."""
    family = trajectory.family
    chat = parse_chat_request(body, family.stop_token_ids, family.vocab_size, trajectory.sent)
    return turn_request(chat, family, chat, images, trajectory.images)
