"""The Anthropic Messages request, mapped onto the chat turn every API shares.

`system` (a string or text blocks) is the system message; a user message's `tool_result` blocks are tool messages
(their `tool_use_id` is the stored tool call's id) and its text blocks a user message, in block order; an assistant
message's `thinking` block is its `reasoning_content`, its text blocks its content and its `tool_use` blocks its
`tool_calls` (`input` as JSON arguments, matched as JSON against the stored ones). So a turn carried by Messages
matches and renders exactly like the same turn carried by Chat Completions
(tests/unit/session_server/frontend/test_api_mapping.py).

The result is a Chat Completions request object (`MessagesTurn.chat`), validated further by the chat front end's
own parser. Checked here with Anthropic's field names: tools (`input_schema`), `tool_choice` (auto / any / tool /
none, `disable_parallel_tool_use`), `thinking` (the family's switch), `stop_sequences`, `max_tokens`,
`output_config.format`. What does not change the tokens -- `cache_control` anywhere, `context_management`,
`metadata`, betas, `thinking.budget_tokens`, `output_config.effort` -- is accepted and reported in `ignored` (Claude
Code sends all of it and answers a 400 by retrying without features), never a 400; `image` blocks (in a user message
or a tool result) become the chat image parts every API's images become (frontend/images.py); documents,
`redacted_thinking` (encrypted reasoning no local template can render) and server tools are a 400 naming the
block or field. Which keys of the request, a tool and `output_config` are mapped, ignored or refused are rows of the
tables MESSAGES_KEYS, MESSAGES_TOOL_KEYS and MESSAGES_OUTPUT_CONFIG_KEYS (frontend/fields.py). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from session_server.frontend.chat_request import read_chat
from session_server.frontend.fields import (
    MESSAGES_KEYS,
    MESSAGES_OUTPUT_CONFIG_KEYS,
    MESSAGES_TOOL_KEYS,
    reply_limit,
)
from session_server.frontend.request_items import bad, non_empty_string, objects
from session_server.http.body import decode_object
from session_server.turns.turn import TurnRequest
from trajectory import LinearTrajectory, ModelFamily
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, Image, ImageLimits

_UNSUPPORTED_BLOCKS = {
    "document": "document blocks are not supported: this server's model takes text only",
    "redacted_thinking": "redacted_thinking blocks hold encrypted reasoning that this model's template cannot render",
}


@dataclass(slots=True)
class MessagesTurn:
    """One Messages request as the shared turn sees it, plus what only the Anthropic reply needs."""

    chat: dict[str, Any]  # a Chat Completions request object (messages, tools, sampling)
    stop_sequences: list[str] | None = None
    ignored: list[str] = field(default_factory=list)  # accepted fields without effect on the tokens


def _block_kind(where: str, block: dict[str, Any], ignored: list[str]) -> str:
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad(f"{where}.type", "must be a string")
    if kind in _UNSUPPORTED_BLOCKS:
        raise bad(f"{where}.type", _UNSUPPORTED_BLOCKS[kind])
    if "cache_control" in block:
        ignored.append("cache_control")
    return kind


def _text(where: str, block: dict[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text", "must be a string")
    return text


def _image(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """An `image` block as the chat `image_url` part every API's images become (frontend/images.py reads and checks
    it, naming `where`): a base64 source as a data URL, a url source as it is (fetched only if the operator allows)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad(f"{where}.source", "must have 'media_type' and 'data' strings")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        assert isinstance(source, dict)
        link = source.get("url")
        if not isinstance(link, str):
            raise bad(f"{where}.source.url", "must be a string")
        url = link
    else:
        raise bad(f"{where}.source.type", "must be 'base64' or 'url'")
    return {"type": "image_url", "image_url": {"url": url}, "where": where}


def _text_blocks(where: str, content: Any, ignored: list[str], images: bool = False) -> Any:
    """A string, or text blocks as chat text parts (the chat normaliser joins them, as it does for any chat); with
    `images` (a tool result's content) image blocks as well."""
    if isinstance(content, str):
        return content
    parts = []
    for here, block in objects(content, where):
        kind = _block_kind(here, block, ignored)
        if kind == "image" and images:
            parts.append(_image(here, block))
            continue
        if kind != "text":
            raise bad(f"{here}.type", f"must be 'text' here, got {kind!r}")
        parts.append({"type": "text", "text": _text(here, block)})
    return parts


def _user(out: list[dict[str, Any]], where: str, content: list[Any], ignored: list[str]) -> None:
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": list(parts)})
            parts.clear()

    for here, block in objects(content, f"{where}.content"):
        kind = _block_kind(here, block, ignored)
        if kind == "text":
            parts.append({"type": "text", "text": _text(here, block)})
        elif kind == "image":
            parts.append(_image(here, block))
        elif kind == "tool_result":
            call_id = non_empty_string(block, "tool_use_id", here)
            if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
                raise bad(f"{here}.is_error", "must be a boolean")
            flush()
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text_blocks(f"{here}.content", "" if result is None else result, ignored,
                                                images=True)})
        else:
            raise bad(f"{here}.type", f"{kind!r} blocks are not supported in a user message")
    flush()


def _assistant(where: str, content: list[Any], ignored: list[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    reasoning: list[str] = []
    for here, block in objects(content, f"{where}.content"):
        kind = _block_kind(here, block, ignored)
        if kind == "text":
            message["content"] += _text(here, block)
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise bad(f"{here}.thinking", "must be a string")
            reasoning.append(thinking)
        elif kind == "tool_use":
            call_id, name = non_empty_string(block, "id", here), non_empty_string(block, "name", here)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{here}.input", "must be an object")
            message.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:
            raise bad(f"{here}.type", f"{kind!r} blocks are not supported in an assistant message")
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def chat_messages(system: Any, messages: Any, ignored: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text_blocks("system", system, ignored)
        if isinstance(text, list):  # blocks: one system message, the blocks a line each
            text = "\n".join(part["text"] for part in text)
        out.append({"role": "system", "content": text})
    if not messages:
        raise bad("messages", "must be a non-empty list")
    for where, message in objects(messages, "messages"):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad(f"{where}.content", "must be a string or a list of content blocks")
        elif role == "user":
            _user(out, where, content, ignored)
        elif role == "assistant":
            out.append(_assistant(where, content, ignored))
        else:
            out.append({"role": "system", "content": _text_blocks(f"{where}.content", content, ignored)})
    return out


def chat_tools(tools: Any, ignored: list[str]) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for where, tool in objects(tools, "tools"):
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{where}.type", f"{tool['type']!r}: server tools are not supported, only custom tools")
        ignored += MESSAGES_TOOL_KEYS.read(tool, where)
        name, schema = non_empty_string(tool, "name", where), tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{where}.input_schema", "must be a JSON Schema object")
        function: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = schema
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise bad("tool_choice", "must be an object with a 'type'")
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
    allow_parallel = None if parallel is None else not parallel
    if kind == "auto":
        return "auto", allow_parallel
    if kind == "any":
        return "required", allow_parallel
    if kind == "none":
        return "none", allow_parallel
    if kind == "tool":
        name = non_empty_string(choice, "name", "tool_choice")
        return {"type": "function", "function": {"name": name}}, allow_parallel
    raise bad("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")


def _thinking(thinking: Any, thinking_switch: str | None, ignored: list[str]) -> dict[str, Any] | None:
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise bad("thinking", "must be an object")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type", f"must be enabled, disabled or adaptive, got {kind!r}")
    budget = thinking.get("budget_tokens")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad("thinking.budget_tokens", "must be a positive integer")
        ignored.append("thinking.budget_tokens")  # a template switch has no budget; max_tokens still bounds it
    if thinking_switch is None:
        ignored.append("thinking")
        return None
    return {thinking_switch: kind != "disabled"}


def _output_config(config: Any, ignored: list[str]) -> dict[str, Any] | None:
    """The response format of `output_config.format`; `effort` and `task_budget` are hints no template takes."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("output_config", "must be an object")
    ignored += MESSAGES_OUTPUT_CONFIG_KEYS.read(config, "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise bad("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt["schema"]}}


def parse_messages(obj: dict[str, Any], thinking_switch: str | None, count_only: bool = False) -> MessagesTurn:
    """Map a decoded Messages request (or, with `count_only`, a count_tokens request) onto the chat turn."""
    ignored = MESSAGES_KEYS.read(obj)
    max_tokens = reply_limit(obj.get("max_tokens"), "max_tokens", required=not count_only)
    stop = obj.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad("stop_sequences", "must be a list of non-empty strings")
    tool_choice, parallel = chat_tool_choice(obj.get("tool_choice"))
    chat: dict[str, Any] = {
        "messages": chat_messages(obj.get("system"), obj.get("messages"), ignored),
        "tools": chat_tools(obj.get("tools"), ignored),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "max_tokens": max_tokens,
        "temperature": obj.get("temperature"),
        "top_p": obj.get("top_p"),
        "top_k": obj.get("top_k"),
        "stop": stop or None,
        "response_format": _output_config(obj.get("output_config"), ignored),
        "chat_template_kwargs": _thinking(obj.get("thinking"), thinking_switch, ignored),
        "stream": obj.get("stream"),
        "model": obj.get("model"),
    }
    return MessagesTurn(chat={k: v for k, v in chat.items() if v is not None}, stop_sequences=stop or None,
                        ignored=sorted(set(ignored)))


def parse_request(body: bytes, family: ModelFamily, count_only: bool = False, images: ImageLimits = NO_IMAGE_LIMITS,
                  known: Mapping[str, Image] | None = None) -> TurnRequest[MessagesTurn]:
    """A Messages (or count_tokens) request body as the turn's request; `known`: the session's images."""
    mapped = parse_messages(decode_object(body), family.thinking_switch, count_only)
    request = read_chat(mapped.chat, family, mapped, images, known)
    request.ignored = mapped.ignored
    return request


def count_tokens(body: bytes, trajectory: LinearTrajectory, images: ImageLimits = NO_IMAGE_LIMITS) -> int:
    """The length of the prompt a count_tokens request would get on this trajectory (a snapshot; pure): the stored
    tokens plus the appended messages when it continues the stored history, else the conversation rendered afresh."""
    turn = parse_request(body, trajectory.family, count_only=True, images=images, known=trajectory.images)
    try:
        plan = trajectory.prepare(turn.messages, turn.tools, turn.template_kwargs)
    except SessionError:  # not a continuation of the stored history
        fresh = LinearTrajectory(trajectory.family, special_tokens="text" if trajectory.text_only else "engine")
        plan = fresh.prepare(turn.messages, turn.tools, turn.template_kwargs)
    return len(plan.prompt_ids)
