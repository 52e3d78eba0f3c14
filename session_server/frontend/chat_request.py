"""The chat-shaped turn request every API maps onto: Chat Completions reads its body straight into it, Responses and
Anthropic Messages translate theirs first (their protocol.py) and then share every check from here on -- the fields
by their table (fields.py: sampling keys with SGLang's bounds, logprobs, tool choice and its grammar, response
format, template kwargs, token ids) and the `TurnRequest` the turn pipeline runs (turns/turn.py).

Pure: it runs on the CPU pool with the rest of a turn's parse. What cannot be honoured is a 400 that names the field,
never a silent 200: `n` other than 1, for one, would change the meaning of the reply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from session_server.frontend.fields import (
    RequestOptions,
    check_tool_choice,
    constrain,
    prompt_tools,
    read_fields,
)
from session_server.frontend.images import read_images
from session_server.turns.turn import TurnRequest
from trajectory import ModelFamily
from trajectory.images import NO_IMAGE_LIMITS, Image, ImageLimits
from trajectory.messages import normalize_tools

R = TypeVar("R")


@dataclass(slots=True)
class ChatRequest:
    messages: Any  # raw: validated and normalised once, by the trajectory's prepare (trajectory/messages.py)
    tools: Any
    sampling_params: dict[str, Any]
    stream: bool
    model: str | None
    options: RequestOptions = dataclasses.field(default_factory=RequestOptions)
    messages_json: bytes | None = None  # the messages array's bytes, kept by the trajectory (chat_body.py)
    tools_json: bytes | None = None  # the tools list's bytes, the key of its verdict (chat_body.py)


def chat_request(obj: dict[str, Any], stop_token_ids: tuple[int, ...], vocab_size: int | None = None) -> ChatRequest:
    """The chat request of a decoded request object: Chat Completions reads its body into one
    (chat/protocol.py `parse_chat_request`), the Responses and Anthropic front ends map theirs onto one (their
    protocol.py), and all share every check from here on."""
    fields = read_fields(obj, stop_token_ids, vocab_size)
    request = fields.request
    return ChatRequest(
        messages=request["messages"],
        tools=request["tools"],
        sampling_params=fields.sampling,
        stream=request["stream"],
        model=request["model"],
        options=fields.options,
    )


def turn_tools(chat: ChatRequest, family: ModelFamily) -> list[dict[str, Any]] | None:
    """Validate `tool_choice` against the tools, add the constrained-decoding keys, and return the tools the
    template renders for this turn (none for `tool_choice: none`, only the named one for a named choice)."""
    tools = normalize_tools(chat.tools)
    check_tool_choice(tools, chat.options, chat.tools_json)
    constrain(chat.sampling_params, tools, chat.options, family.tool_call_structure, family.structural_tag_format)
    return prompt_tools(tools, chat.options)


def turn_request(chat: ChatRequest, family: ModelFamily, api: R, images: ImageLimits = NO_IMAGE_LIMITS,
                 known: Mapping[str, Image] | None = None) -> TurnRequest[R]:
    """The turn the pipeline runs for a chat request; `api` is the front end's own reading of it, for its reply.
    Its images are read and checked here, for every API (frontend/images.py; `known`: the session's own)."""
    options = chat.options
    sent = chat.messages_json  # the array's bytes, when read by chat_body.py: no image part without this word in them
    messages = chat.messages if sent is not None and b'"image_url"' not in sent else read_images(
        chat.messages, images, family.vision is not None, family.name, known)
    return TurnRequest(
        messages=messages, tools=turn_tools(chat, family), sampling_params=chat.sampling_params, api=api,
        template_kwargs=options.chat_template_kwargs, stream=chat.stream, model=chat.model,
        top_logprobs=options.top_logprobs, parse_tool_calls=options.parse_tool_calls,
        messages_json=chat.messages_json, return_token_ids=options.return_token_ids,
    )


def read_chat(obj: dict[str, Any], family: ModelFamily, api: R, images: ImageLimits = NO_IMAGE_LIMITS,
              known: Mapping[str, Image] | None = None) -> TurnRequest[R]:
    """The turn of a chat request object that a Responses or Anthropic request was mapped onto."""
    return turn_request(chat_request(obj, family.stop_token_ids, family.vocab_size), family, api, images, known)
