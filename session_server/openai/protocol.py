"""The OpenAI side of a turn: the chat-completion request (decoded once, mapped to SGLang sampling params) and the
client reply (built from the turn's output: the validated engine reply and the family's parse of it, turns/output.py).
The engine's side of the wire -- the /generate body, the routed-experts cut, the strict decode -- is engine/wire.py.

Everything here is a pure function of its arguments, so it runs on the CPU pool. The request is decoded once (msgspec,
straight to builtins); the fields beyond messages, tools and basic sampling are honoured as SGLang's own OpenAI
server honours them (openai/fields.py), and what cannot be honoured is refused with a 400 naming the field, as is
`n` other than 1, which would silently change the meaning of the reply. The reply is encoded once, from the already
parsed completion, and never carries the heavy replay payloads (routed experts stay in the trajectory's records).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from session_server.openai.chat_body import read_chat_body
from session_server.openai.fields import (
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
from session_server.openai.logprobs import openai_logprobs
from session_server.turns.output import TurnOutput
from session_server.turns.reply_facts import reasoning_token_count
from session_server.turns.token_ids import TurnTokens
from trajectory import GenerateResult, ModelFamily
from trajectory.linear import SentHistory
from trajectory.messages import normalize_tools

_encoder = msgspec.json.Encoder()


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


def chat_request(obj: dict[str, Any], stop_token_ids: tuple[int, ...], vocab_size: int | None = None) -> ChatRequest:
    """`parse_chat_request` of an already decoded request object: the Responses and Anthropic front ends map
    theirs onto one (their protocol.py) and share every check from here on."""
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


def finish_reason(result: GenerateResult, message: dict[str, Any]) -> str:
    if result.finish_reason.get("type") == "length":
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def system_fingerprint(family: ModelFamily, result: GenerateResult) -> str:
    """What produced the reply: the model family and the engine's weight version (changes with every update)."""
    return f"{family.name}-{result.weight_version or 'default'}"


def usage(out: TurnOutput, family: ModelFamily) -> dict[str, Any]:
    """OpenAI's usage; the reasoning's tokens in `completion_tokens_details` when there are some (SGLang's
    UsageProcessor sets that field only then)."""
    result = out.result
    body: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }
    reasoning = reasoning_token_count(family, result.output_ids, out.message.get("reasoning_content"))
    if reasoning:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body


def chat_completion(
    out: TurnOutput, family: ModelFamily, rid: str, model: str, created: int, options: RequestOptions,
    tokens: TurnTokens | None = None,
) -> bytes:
    """The client reply of a plain turn, encoded once. It never carries the heavy replay payloads (routed experts
    stay in the trajectory's records). `tokens`: the turn's ids, as vLLM writes them for `return_token_ids`
    (`prompt_token_ids` beside the choices, `token_ids` in the choice)."""
    result, message = out.result, out.message
    logprobs = (openai_logprobs(family.tokenizer, result.output_ids, result.logprobs, result.top_logprobs,
                                options.top_logprobs) if options.logprobs else None)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason(result, message),
                              "logprobs": logprobs}
    body: dict[str, Any] = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint(family, result),
        "choices": [choice],
        "usage": usage(out, family),
    }
    if tokens is not None:
        body["prompt_token_ids"] = tokens.prompt_token_ids
        choice["token_ids"] = tokens.token_ids
    return _encoder.encode(body)
