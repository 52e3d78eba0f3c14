"""Qwen3.5 / Qwen3.6: ChatML, XML tool calls, and a generation prompt that already opens the reasoning block.

What differs from Qwen3, and why it matters to TITO:
- Thinking is on by default and the generation prompt ends with `<think>\\n`: the model's text starts inside the
  reasoning block. `opened_reply` tells the parser (and the emulated engine) that the prompt wrote the opener.
- Tool calls are XML with bare-text values (xml_tool_calls.py): parsing needs the turn's tool schemas.
- The template keeps an assistant turn's `<think>` block only after the last real user query (and writes an empty one
  there): after a generated turn followed by tool results, the anchor assistant message renders with the block, after
  a user message without it. `anchor_probe` picks the probe that puts the anchor on the same side of that line.
- Tool results go into a user turn (`<tool_response>`); a system message may only come first.
Qwen3.6 differs from 3.5 only in how the template writes non-string tool arguments (JSON instead of Python's str).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .base import ParsedCompletion
from .qwen3 import THINK_CLOSE, THINK_OPEN, Qwen3Family
from .qwen3 import split_reasoning as split_closed_reasoning
from .qwen3_vl import vision_of
from .xml_tool_calls import CALL_CLOSE, CALL_OPEN, format_call, parse_calls

_TOOL_PROBE: dict[str, str] = {"role": "tool", "content": "anchor probe"}


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Qwen3's split, plus SGLang's rule for Qwen3.5: a `<tool_call>` inside an unclosed block closes it."""
    if text.startswith(THINK_OPEN) and THINK_CLOSE not in text:
        call = text.find(CALL_OPEN)
        if call >= 0:
            return text[len(THINK_OPEN):call].removeprefix("\n"), text[call:]
    return split_closed_reasoning(text)


def _is_user_query(message: Mapping[str, Any]) -> bool:
    """A user message that is not a wrapped tool result (the template's own test for the last query)."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else ""
    return message.get("role") == "user" and not (
        text.startswith("<tool_response>") and text.endswith("</tool_response>"))


def _arguments_as_objects(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as objects, as SGLang hands them to the template (OpenAI sends JSON text; the template
    writes one element per key). Text that is not a JSON object is left for the template to skip."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        arguments = json.loads(function["arguments"])
                    except (ValueError, RecursionError):
                        arguments = function["arguments"]
                    call = {**call, "function": {**function, "arguments": arguments}}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


class Qwen35Family(Qwen3Family):
    """Qwen3's ChatML boundaries, stop tokens, reasoning markup and thinking switch; its own roles, calls, opening."""

    name = "qwen3.5"
    # The template refuses a system message anywhere but first.
    appendable_roles = frozenset({"user", "tool", "assistant"})
    tool_call_markers = (CALL_OPEN, CALL_CLOSE)
    tool_call_structure = None  # SGLang's qwen3_coder detector has no JSON-arguments structure: a native tag
    structural_tag_format = "qwen_3_coder"
    reply_opening = THINK_OPEN + "\n"
    json_scalars: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.vision = vision_of(tokenizer)  # natively multimodal: images like Qwen3-VL's (qwen3_vl.py)

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        return super().render(_arguments_as_objects(messages), tools, add_generation_prompt, template_kwargs)

    def anchor_probe(self, appended: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        return super().anchor_probe(appended) if any(map(_is_user_query, appended)) else _TOOL_PROBE

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text)

    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        reasoning, rest = split_reasoning(text)
        content, calls = parse_calls(rest, tools)
        if CALL_OPEN in rest and content.strip():  # cut at a call opener: drop the separator the template writes
            content = content.removesuffix("\n\n")
        return ParsedCompletion(content=content, reasoning_content=reasoning, tool_calls=calls)

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        parts = [] if reasoning_content is None else [f"{THINK_OPEN}\n{reasoning_content}\n{THINK_CLOSE}\n\n"]
        parts.append(content)
        for i, (name, arguments) in enumerate(tool_calls):
            parts.append("\n" if i else "\n\n" if content.strip() else "")
            parts.append(format_call(name, json.loads(arguments), self.json_scalars))
        return "".join(parts)


class Qwen36Family(Qwen35Family):
    name = "qwen3.6"
    json_scalars = True
