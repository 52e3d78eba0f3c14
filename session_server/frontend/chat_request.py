"""The chat-shaped turn request every API maps onto: Chat Completions reads its body straight into it, Responses and
Anthropic Messages translate theirs first (their protocol.py) and then share every check from here on -- the
sampling fields mapped to SGLang's `sampling_params` (SGLang's bounds, penalties, stop strings, seed), the options
beyond sampling (fields.py: logprobs, tool choice and its grammar, response format, template kwargs, token ids) and
the `TurnRequest` the turn pipeline runs (turns/turn.py).

Pure: it runs on the CPU pool with the rest of a turn's parse. What cannot be honoured is a 400 that names the field,
never a silent 200: `n` other than 1, for one, would change the meaning of the reply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from session_server.frontend.fields import (
    MAX_INT32,
    RequestOptions,
    bad_request,
    check_tool_choice,
    constrain,
    is_int,
    number,
    parse_options,
    penalty_params,
    prompt_tools,
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
    n = obj.get("n")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported: a session holds one linear trajectory")
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean")
    model = obj.get("model")
    options = parse_options(obj)
    sp = sampling_params(obj, stop_token_ids)
    penalty_params(obj, sp, vocab_size)
    return ChatRequest(
        messages=obj.get("messages"),
        tools=obj.get("tools"),
        sampling_params=sp,
        stream=stream,
        model=model if isinstance(model, str) else None,
        options=options,
    )


def turn_tools(chat: ChatRequest, family: ModelFamily) -> list[dict[str, Any]] | None:
    """Validate `tool_choice` against the tools, add the constrained-decoding keys, and return the tools the
    template renders for this turn (none for `tool_choice: none`, only the named one for a named choice)."""
    tools = normalize_tools(chat.tools)
    check_tool_choice(tools, chat.options, chat.tools_json)
    constrain(chat.sampling_params, tools, chat.options, family.tool_call_structure, family.structural_tag_format)
    return prompt_tools(tools, chat.options)


def sampling_params(obj: dict[str, Any], stop_token_ids: tuple[int, ...]) -> dict[str, Any]:
    sp: dict[str, Any] = {
        "stop_token_ids": list(stop_token_ids),
        "skip_special_tokens": False,  # tool-call markup of some families is made of special tokens
        "no_stop_trim": False,
    }
    max_tokens = obj.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or not 1 <= max_tokens <= MAX_INT32):
        raise bad_request(f"'max_tokens' / 'max_completion_tokens' must be an integer in [1, {MAX_INT32}]")
    # No limit from the agent: an explicit null, as SGLang's own chat endpoint sends (up to the context length).
    # Leaving the key out would mean SamplingParams' default of 128 tokens.
    sp["max_new_tokens"] = max_tokens
    temperature = number(obj, "temperature", 0, 1e6)
    if temperature is not None:
        sp["temperature"] = temperature
    top_p = number(obj, "top_p", 0, 1, lo_open=True)
    if top_p is not None:
        sp["top_p"] = top_p
    top_k = obj.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or (top_k < 1 and top_k != -1) or top_k > MAX_INT32:
            raise bad_request(f"'top_k' must be an integer in [1, {MAX_INT32}] or -1")
        sp["top_k"] = top_k
    stop = obj.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request("'stop' must be a non-empty string or a list of them")
        if len(stop) > 32:  # SGLang's MAX_STOP_COUNT
            raise bad_request("'stop' may have at most 32 entries")
        if stop:
            sp["stop"] = stop
    seed = obj.get("seed")
    if seed is not None:
        if not is_int(seed) or not -(2**63) <= seed < 2**63:
            raise bad_request("'seed' must be a 64-bit integer")
        sp["sampling_seed"] = seed
    return sp


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
