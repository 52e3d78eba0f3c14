"""Llama 3.1: header-delimited messages, JSON tool calls, no reasoning.

A message is `<|start_header_id|>ROLE<|end_header_id|>\\n\\n...<|eot_id|>`; the model stops on `<|eot_id|>` (what the
template writes), on `<|eom_id|>` (after a call whose `ipython` result it waits for: Meta's format closes such a
message with it, so it stays) or on `<|end_of_text|>`, which the next prompt replaces by `<|eot_id|>` (max_trim 1).
Tool results are `ipython` messages. The template puts the tool schemas in the first user message (Meta's default): an
appended turn never carries them.

A call is a JSON object `{"name": ..., "parameters": {...}}` (or `"arguments"`) that is the whole reply, or follows
`<|python_tag|>` after some text; several are `;`-separated. Parsed as SGLang 0.5.23's `llama3` detector parses them,
except where it would lose text: a reply whose JSON objects are not all calls is content, verbatim (SGLang drops a
JSON answer that starts the reply, or a malformed call after the tag).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import ToolCall, tool_call_from_json
from .completion_parts import TrailingCallsFamily
from .qwen35 import _arguments_as_objects

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_DECODER = json.JSONDecoder()


def _calls(text: str) -> list[ToolCall] | None:
    """`;`-separated call objects making up all of `text`, or None."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict):
            return None
        arguments = obj.get("parameters") or obj.get("arguments", {})
        call = tool_call_from_json(obj.get("name"), arguments)
        if call is None:
            return None
        calls.append(call)
        rest = text[pos:].strip()
        if not rest:
            return calls
        if not rest.startswith(SEPARATOR):
            return None
        pos = text.index(SEPARATOR, pos) + 1


class Llama31Family(TrailingCallsFamily):
    name = "llama-3.1"
    eos_token = "<|eot_id|>"
    extra_stop_tokens = ("<|eom_id|>", "<|end_of_text|>")
    closing_stop_tokens = ("<|eom_id|>",)
    message_trailer = ""
    assistant_header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    # A system message after the first renders as a header message of its own; an injected assistant one as prompt.
    appendable_roles = frozenset({"user", "tool", "system", "assistant"})
    tools_only_in_preamble = True  # the schemas are written into the first user message (or the system block)
    # SGLang's llama3 detector (`structure_info`): a forced call is `<|python_tag|>` + one call object
    tool_call_structure = ('<|python_tag|>{"name":"', '", "arguments":', "}", PYTHON_TAG)

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        return super().render(_arguments_as_objects(messages), tools, add_generation_prompt, template_kwargs)

    def split_calls(self, text: str) -> tuple[str, str] | None:
        """Calls follow `<|python_tag|>`, or are the whole reply when it starts with an object."""
        if PYTHON_TAG in text:
            content, action = text.split(PYTHON_TAG, 1)
            return content, action
        return ("", text) if text.startswith("{") else None

    def read_calls(self, text: str) -> list[ToolCall] | None:
        return _calls(text)

    def write_calls(self, content: str, tool_calls: Sequence[tuple[str, str]]) -> str:
        calls = SEPARATOR.join(f'{{"name": "{name}", "parameters": {arguments}}}' for name, arguments in tool_calls)
        return f"{content}{PYTHON_TAG}{calls}" if content else calls
