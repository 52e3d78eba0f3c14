"""DeepSeek V4: `<｜User｜>` / `<｜Assistant｜>` turns with DeepSeek's own V4 conventions and DSML tool calls.

What matters to TITO: after a query the template writes `<｜Assistant｜>` and then `<think>` (thinking mode,
`chat_template_kwargs: {"thinking": true}`) or `</think>` (chat mode, the default): in thinking mode the reply starts
inside the reasoning block (`reply_opening`). A message ends with `<｜end▁of▁sentence｜>`, which is also the stop token
(nothing trimmed). Tool results are merged into a user turn (`<tool_result>`). DSML calls carry each argument's type
(`string="true|false"`), so they parse without the tool schemas, as SGLang 0.5.23's `deepseekv4` detector parses them
(string values stripped, other values JSON or else text, an unclosed or malformed invoke dropped, the content is the
text before the calls without the template's blank line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import ParsedCompletion, ToolCall
from .deepseek import THINK_CLOSE, THINK_OPEN, DeepSeekFamily, split_reasoning
from .qwen35 import _arguments_as_objects

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"
_INVOKE_OPEN = f"<{DSML}invoke"
_SECTION = re.compile(re.escape(CALLS_OPEN) + r"(.*?)" + re.escape(CALLS_CLOSE), re.DOTALL)
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="(?P<name>[^"]+)"\s*(?:(?P<self_close>/>)|>(?P<body>.*?)'
                     rf"(?P<end>(?:</{DSML}invoke>|$)))", re.DOTALL)
_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"]+)"\s+string="([^"]+)"\s*>(.*?)</{DSML}parameter>', re.DOTALL)


def _no_constants(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def _arguments(body: str) -> dict[str, Any] | None:
    """An invoke's arguments: a JSON object, or parameter elements (None: malformed)."""
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped, parse_constant=_no_constants)
        except (ValueError, RecursionError):
            return None
        return value if isinstance(value, dict) else None
    arguments: dict[str, Any] = {}
    leftover, end = [], 0
    matches = list(_PARAMETER.finditer(body))
    for match in matches:
        leftover.append(body[end:match.start()])
        end = match.end()
        name, is_string, value = match.groups()
        if is_string == "true":
            arguments[name] = value.strip()
            continue
        try:
            arguments[name] = json.loads(value.strip(), parse_constant=_no_constants)
        except (ValueError, RecursionError):
            arguments[name] = value.strip()
    rest = "".join([*leftover, body[end:]])
    if DSML in rest or (not matches and rest.strip()):
        return None
    return arguments


def _before_dsml(text: str) -> str:
    idx = text.find(DSML)
    if idx >= 2 and text[idx - 2:idx] == "</":
        idx -= 2
    elif idx >= 1 and text[idx - 1] == "<":
        idx -= 1
    return text[:idx].removesuffix("\n\n")


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the text after the reasoning block."""
    start = text.find(CALLS_OPEN)
    if start >= 0:
        content, sections = text[:start].removesuffix("\n\n"), _SECTION.findall(text)
    else:
        bare = text.find(_INVOKE_OPEN)
        if bare < 0:
            return text, []
        content, sections = _before_dsml(text), [text[bare:]]
    calls: list[ToolCall] = []
    for section in sections:
        for match in _INVOKE.finditer(section):
            if not (match.group("self_close") or match.group("end")):
                continue  # cut off before its end
            arguments = {} if match.group("self_close") else _arguments(match.group("body"))
            if arguments is not None:
                calls.append(ToolCall(match.group("name").strip(), json.dumps(arguments, ensure_ascii=False)))
    return content, calls


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    params = "\n".join(
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</{DSML}parameter>"
        for key, value in arguments.items())
    return f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>'


class DeepSeekV4Family(DeepSeekFamily):
    """The DeepSeek turn tokens, stop token, roles (a system message renders as bare text: only first) and reasoning
    markup; V4's own template conventions, DSML calls and thinking-mode opening."""

    name = "deepseek-v4"
    tool_call_markers = (CALLS_OPEN, CALLS_CLOSE)
    tool_call_structure = None  # SGLang's structural tag for DSML is not the JSON-arguments shape: a native one
    structural_tag_format = "deepseek_v4"
    reply_opening = THINK_OPEN
    thinking_switch = "thinking"  # SGLang's deepseek-v4 reasoning parser: explicit `thinking: true`
    thinking_default = False
    sglang_reasoning_parser = "deepseek-v4"
    inline_message_starts = ("<tool_result>",)

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        return super().render(_arguments_as_objects(messages), tools, add_generation_prompt, template_kwargs)

    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        reasoning, rest = split_reasoning(text)
        content, calls = parse_calls(rest)
        return ParsedCompletion(content=content, reasoning_content=reasoning, tool_calls=calls)

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        parts = [] if reasoning_content is None else [f"{THINK_OPEN}{reasoning_content}{THINK_CLOSE}"]
        parts.append(content)
        if tool_calls:
            invokes = "\n".join(format_call(name, json.loads(arguments)) for name, arguments in tool_calls)
            parts.append(f"\n\n{CALLS_OPEN}\n{invokes}\n{CALLS_CLOSE}")
        return "".join(parts)
