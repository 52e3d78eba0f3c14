"""Mistral Nemo (tekken, instruct v3): `[INST]`-delimited turns, a JSON call list after `[TOOL_CALLS]`, no reasoning.

mistral-common's request encoder is the model's template, and it re-renders a conversation rather than appending to
it: it merges consecutive messages of a role, takes every system message out and puts them, joined, at the start of
the *last* user message, and writes the tools (`[AVAILABLE_TOOLS]...`) right before that message. `render` normalizes
the messages as mistral-common does (`instruct_messages`) and the template (templates/mistral_nemo.jinja)
writes them. There is no assistant header: the model answers right after `[/INST]` or `[/TOOL_RESULTS]`, and it stops
on `</s>`, which the template writes after every assistant message.

The TITO rule: what a later turn appends is exactly what mistral-common writes after the last assistant message of the
whole conversation -- the tool results, then the tools and `[INST]` + the system prompt + the new user text. So the
model sees the tools and the system prompt where it was trained to find them, right before the query it answers; the
copies written at earlier turns stay in the stored ids (TITO never rewrites what the model saw). Only a batch with a
user message carries them: appended tool results alone are written as such.

A call list is `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, the whole rest of the reply. Parsed as SGLang
0.5.23's `mistral` detector parses `[TOOL_CALLS] [...]` (the SentencePiece models' spelling; it finds no call in the
tekken spelling without the space, tests/unit/trajectory/families/test_mistral.py); text that is not such a
list stays content,
verbatim. An `id` the model writes into a call is not kept (SGLang drops it too); the template writes the call ids of
the history, as mistral-common does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .base import ToolCall, tool_call_from_json
from .completion_parts import TrailingCallsFamily

TOOL_CALLS = "[TOOL_CALLS]"
EOS = "</s>"
JOIN = "\n\n"  # mistral-common's CHUNK_JOIN_STR: how merged messages and system prompts are joined
_DECODER = json.JSONDecoder()
_TOOL_PROBE: dict[str, str] = {"role": "tool", "content": "anchor probe", "tool_call_id": "anchorprb"}


def _text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a list joined as mistral-common joins chunks."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return JOIN.join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _json_value(text: Any) -> Any:
    """mistral-common's reading of tool arguments and results: empty is `{}`, JSON is parsed, anything else is text."""
    if not isinstance(text, str):
        return text
    if not text:
        return {}
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    out = {"name": function.get("name"), "arguments": _json_value(function.get("arguments"))}
    if call.get("id") and call["id"] != "null":
        out["id"] = call["id"]
    return out


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as mistral-common's `Tool.model_dump()` writes it."""
    function = tool.get("function") or {}
    return {"type": "function", "function": {"name": function.get("name"), "description": function.get(
        "description") or "", "parameters": function.get("parameters") or {}}}


def instruct_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as mistral-common's v3 normalizer makes them from a chat request (system messages stay in place:
    the template joins them)."""
    out: list[dict[str, Any]] = []
    previous = None
    for message in messages:
        role = message.get("role")
        merge = role == previous and role in ("user", "assistant")
        previous = role
        if role == "user":
            user_text = _text(message.get("content")) or ""
            if merge:
                out[-1]["content"] += JOIN + user_text
            else:
                out.append({"role": "user", "content": user_text})
        elif role == "assistant":
            text = _text(message.get("content"))
            calls = [_call(c) for c in message.get("tool_calls") or () if isinstance(c, Mapping)]
            if merge:
                last = out[-1]
                if text is not None:
                    last["content"] = text if last["content"] is None else last["content"] + JOIN + text
                last["tool_calls"] += calls
            else:
                out.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif role == "tool":
            out.append({"role": role, "content": _json_value(_text(message.get("content"))),
                        "tool_call_id": message.get("tool_call_id")})
        else:
            out.append({"role": role, "content": _text(message.get("content"))})
    for message in out:
        if message["role"] == "assistant" and not message["tool_calls"] and message["content"] is not None:
            message["content"] = message["content"].rstrip(" ")
    if next((m["role"] for m in out if m["role"] != "system"), None) != "user":
        out.insert(0, {"role": "user", "content": ""})
    return out


def _calls(text: str) -> list[ToolCall] | None:
    """The call list that makes up all of `text`, or None."""
    try:
        items, end = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items or text[end:].strip():
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        arguments = item.get("arguments", item.get("parameters"))
        call = tool_call_from_json(item.get("name"), arguments)
        if call is None:
            return None
        calls.append(call)
    return calls


class MistralNemoFamily(TrailingCallsFamily):
    name = "mistral-nemo"
    eos_token = EOS
    message_trailer = ""
    assistant_header = ""
    # An assistant message right after a generated one merges into it (mistral-common joins consecutive ones): the
    # anchor check refuses that one (400), not an injected assistant turn after tool results or a user message.
    appendable_roles = frozenset({"user", "tool", "system", "assistant"})
    tool_call_markers = (TOOL_CALLS, EOS)  # a call list runs to the end of the reply
    # SGLang's mistral detector (`structure_info`): a forced call is a one-call list in the SentencePiece spelling
    tool_call_structure = ('[TOOL_CALLS] [{"name":"', '", "arguments":', "}]", TOOL_CALLS)

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        return super().render(instruct_messages(messages), [_tool(t) for t in tools] if tools else None,
                              add_generation_prompt, template_kwargs)

    def anchor_probe(self, appended: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """Tool results alone keep the last user message (and the tools before it) where it was: a tool probe."""
        return super().anchor_probe(appended) if any(m.get("role") == "user" for m in appended) else _TOOL_PROBE

    def appended_messages(self, messages: Sequence[Mapping[str, Any]], start: int) -> list[dict[str, Any]]:
        """A batch with a user message also carries the history's system messages: the template writes the system
        prompt into the last user message."""
        appended = super().appended_messages(messages, start)
        if any(m.get("role") == "user" for m in appended):
            appended = [dict(m) for m in messages[:start] if m.get("role") == "system"] + appended
        return appended

    def split_calls(self, text: str) -> tuple[str, str] | None:
        """The call list is the rest of the reply after the first `[TOOL_CALLS]`."""
        marker = text.find(TOOL_CALLS)
        return None if marker < 0 else (text[:marker], text[marker + len(TOOL_CALLS):])

    def read_calls(self, text: str) -> list[ToolCall] | None:
        return _calls(text)

    def write_calls(self, content: str, tool_calls: Sequence[tuple[str, str]]) -> str:
        calls = [{"name": name, "arguments": json.loads(arguments)} for name, arguments in tool_calls]
        return content + TOOL_CALLS + json.dumps(calls, ensure_ascii=False)
