"""The parts of a completion that several families read and write alike, written once.

A `<think>` block that opens a reply (DeepSeek writes it tight, Qwen3 pads it with newlines); tool-call spans cut out
of the text around them, a span that is not a well-formed call staying in the content verbatim (DeepSeek's call
sections, Qwen3's `<tool_call>` blocks); and the families whose calls are JSON written after a marker at the end of a
reply with no reasoning (Llama 3.1, Mistral Nemo: `TrailingCallsFamily`). Each family keeps its own markers and
rules -- which spans count, how a call is spelled -- and takes these steps through here.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .base import ModelFamily, ParsedCompletion, ToolCall


def split_think(text: str, open_: str, close: str, *, padded: bool) -> tuple[str | None, str]:
    """`OPEN R CLOSE C` -> (R, C); a reply that does not open the block is (None, text), and an unterminated block
    (cut by length) is all reasoning. `padded`: the template writes a newline inside each side of the block and a
    blank line after it (`<think>\\nR\\n</think>\\n\\nC`), which belong to neither R nor C."""
    if not text.startswith(open_):
        return None, text
    end = text.find(close)
    reasoning = text[len(open_):] if end < 0 else text[len(open_):end]
    if padded:
        reasoning = reasoning.removeprefix("\n")
    if end < 0:
        return reasoning, ""
    rest = text[end + len(close):]
    if padded:
        reasoning = reasoning.removesuffix("\n")
        rest = rest[2:] if rest.startswith("\n\n") else rest.removeprefix("\n")
    return reasoning, rest


def join_think(reasoning: str | None, open_: str, close: str, *, padded: bool) -> str:
    """What `split_think` reads back as `reasoning` before the content: nothing when there is none."""
    if reasoning is None:
        return ""
    return f"{open_}\n{reasoning}\n{close}\n\n" if padded else f"{open_}{reasoning}{close}"


# A span's calls and the text of it that stays content (stray text between calls), or None: not a call, left in place.
SpanReader = Callable[[re.Match[str]], tuple[list[ToolCall], str] | None]


def cut_calls(text: str, spans: re.Pattern[str], read: SpanReader, separator: str = "") -> tuple[str, list[ToolCall]]:
    """`text` with every span of `spans` that `read` takes cut out, and the calls read from them, in order. A span
    `read` refuses stays in the content verbatim. `separator`: what the template writes before a span (Qwen3's newline
    before a `<tool_call>`), dropped with it."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    for match in spans.finditer(text):
        taken = read(match)
        if taken is None:
            continue
        found, leftover = taken
        pieces.append(text[pos:match.start()].removesuffix(separator))
        pieces.append(leftover)
        calls.extend(found)
        pos = match.end()
    pieces.append(text[pos:])
    return "".join(pieces), calls


class TrailingCallsFamily(ModelFamily):
    """A family with no reasoning whose calls are JSON written after a marker that ends the reply's content (Llama
    3.1's `<|python_tag|>`, Mistral Nemo's `[TOOL_CALLS]`). A reply is its content when no call text is found or when
    the call text is not wholly calls: then it stays content, verbatim, marker and all."""

    @abstractmethod
    def split_calls(self, text: str) -> tuple[str, str] | None:
        """(content, call text) where the reply writes calls, else None."""

    @abstractmethod
    def read_calls(self, text: str) -> list[ToolCall] | None:
        """The calls that make up all of `text`, or None."""

    @abstractmethod
    def write_calls(self, content: str, tool_calls: Sequence[tuple[str, str]]) -> str:
        """The reply: `content`, then the marker and the (one or more) calls, as the model writes them."""

    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        split = self.split_calls(text)
        calls = None if split is None else self.read_calls(split[1])
        if split is None or calls is None:
            return ParsedCompletion(content=text)
        return ParsedCompletion(content=split[0], tool_calls=calls)

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        return self.write_calls(content, tool_calls) if tool_calls else content
