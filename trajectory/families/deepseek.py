"""DeepSeek-style family: `<｜User｜>`/`<｜Assistant｜>` turns, `<think>` reasoning, special-token tool calls.

The model stops on `<｜end▁of▁sentence｜>`, which is also what the template writes after an assistant
message, with nothing after it: a stored completion never needs trimming (max_trim 0). The template
allows a system message only first, so user, tool and assistant messages can be appended (an assistant message
the model did not generate is prompt, masked out of the loss), but not system ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .base import ModelFamily, ParsedCompletion, ToolCall, tool_call_from_json
from .completion_parts import cut_calls, join_think, split_think

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
_SECTION = re.compile(re.escape(CALLS_BEGIN) + r"(.*?)" + re.escape(CALLS_END), re.DOTALL)
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(TOOL_SEP) + r"(.*?)\n```json\n(.*?)\n```" + re.escape(CALL_END),
    re.DOTALL,
)


def _parse_call(kind: str, name: str, arguments: str) -> ToolCall | None:
    if kind != "function":
        return None
    try:
        obj = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    return tool_call_from_json(name, obj)


def _read_one(match: re.Match[str]) -> tuple[list[ToolCall], str] | None:
    call = _parse_call(*match.groups())
    return None if call is None else ([call], "")


def _read_section(section: re.Match[str]) -> tuple[list[ToolCall], str] | None:
    """A call section's calls, and its malformed calls and stray text, which stay in the content verbatim; a section
    with no well-formed call is left whole."""
    leftover, calls = cut_calls(section.group(1), _CALL, _read_one)
    return (calls, leftover) if calls else None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """`<think>R</think>C` -> (R, C); an unterminated block (cut by length) is all reasoning."""
    return split_think(text, THINK_OPEN, THINK_CLOSE, padded=False)


class DeepSeekFamily(ModelFamily):
    name = "deepseek"
    eos_token = "<｜end▁of▁sentence｜>"
    message_trailer = ""
    assistant_header = "<｜Assistant｜>"
    appendable_roles = frozenset({"user", "tool", "assistant"})
    tools_only_in_preamble = True  # the template lists tools after the system text, before any message
    content_markup = (THINK_OPEN, THINK_CLOSE)  # the template splits an assistant's reasoning off on them
    reasoning_markers = (THINK_OPEN, THINK_CLOSE)
    # R1's template has no switch: the model always opens its reasoning itself (SGLang's `deepseek-r1` parser).
    thinking_default = True
    sglang_reasoning_parser = "deepseek-r1"
    tool_call_markers = (CALLS_BEGIN, CALLS_END)
    tool_call_structure: ClassVar[tuple[str, str, str, str] | None] = (
        CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP, "\n```json\n", "\n```" + CALL_END + CALLS_END, CALLS_BEGIN)

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text)

    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        reasoning, rest = split_reasoning(text)
        content, calls = cut_calls(rest, _SECTION, _read_section)
        return ParsedCompletion(content=content, reasoning_content=reasoning, tool_calls=calls)

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        parts = [join_think(reasoning_content, THINK_OPEN, THINK_CLOSE, padded=False), content]
        if tool_calls:
            parts.append(CALLS_BEGIN)
            for name, arguments in tool_calls:
                parts.append(f"{CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{arguments}\n```{CALL_END}")
            parts.append(CALLS_END)
        return "".join(parts)
