"""Incremental OpenAI deltas from a growing completion text, never contradicting the final parse.

Why not a separate streaming parser per family: the committed assistant message is `family.parse_reply` of the final
text, and an agent rebuilds its history from the deltas it saw; if the two ever disagreed, the next turn would not
match the stored history. So the deltas are computed with the very same parser, on a prefix of the text that is
already settled: the text minus a held-back tail that later tokens could still reinterpret -- an unclosed tool-call
block, a partial marker (`</thi`, `<tool_ca`), trailing newlines (the separator the parsers strip before a call or
after reasoning), an incomplete UTF-8 character. Whatever the parse of that prefix says beyond what was already sent
is the delta, as long as it extends what was sent; otherwise it waits. `finish` checks the final parse against
everything sent, so a stream can never silently diverge from what is committed.

Pure and synchronous: no I/O, usable from a worker thread or the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajectory import ModelFamily


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StreamDivergedError(Exception):
    """The final parse does not extend what was streamed (an invariant: the parser is not prefix-stable here)."""


def _growth(text: str, sent: str, final: bool, what: str) -> str:
    """What `text` adds to the `sent` prefix ("" for nothing new). Deltas only ever append, so a text that does not
    extend what was sent waits for later tokens -- unless it is the final parse, which must extend it."""
    if text.startswith(sent):
        return text[len(sent):]
    if final:
        raise StreamDivergedError(f"final {what} does not extend the streamed {what}")
    return ""


@dataclass
class DeltaTracker:
    family: ModelFamily
    call_id_prefix: str
    parse_tool_calls: bool = True
    reasoning_sent: str = ""
    content_sent: str = ""
    calls_sent: list[tuple[str, str]] = field(default_factory=list)

    def _markers(self) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
        think = getattr(self.family, "reasoning_markers", None)
        calls = getattr(self.family, "tool_call_markers", None) if self.parse_tool_calls else None
        return think, calls

    def settled(self, text: str) -> str | None:
        """The prefix of `text` whose parse cannot change any more; None when nothing can be said yet."""
        think, calls = self._markers()
        if think is None and calls is None:
            return None  # a family without declared markers: everything is sent at the end
        cut = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD until it is complete
        text = text[:cut]
        if think is not None and len(text) < len(think[0]) and think[0].startswith(text):
            return None  # could still become the reasoning block
        if calls is not None:
            opened = text.rfind(calls[0])
            if opened >= 0 and text.find(calls[1], opened) < 0:
                cut = opened  # an unclosed tool-call block
            else:
                cut -= _partial_suffix(text[:cut], calls[0])
        if think is not None and text.startswith(think[0]) and think[1] not in text:
            cut -= _partial_suffix(text[:cut], think[1])
        while cut > 0 and text[cut - 1] in "\r\n":
            cut -= 1
        return text[:cut]

    def _diff(self, reasoning: str | None, content: str, calls: list[Any], final: bool) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if reasoning:
            grown = _growth(reasoning, self.reasoning_sent, final, "reasoning")
            if grown:
                delta["reasoning_content"] = grown
                self.reasoning_sent = reasoning
        elif final and self.reasoning_sent:
            raise StreamDivergedError("streamed reasoning vanished from the final parse")
        grown = _growth(content, self.content_sent, final, "content")
        if grown:
            delta["content"] = grown
            self.content_sent = content
        seen = [(call.name, call.arguments) for call in calls]
        sent = len(self.calls_sent)
        if seen[:sent] != self.calls_sent:
            if final:
                raise StreamDivergedError("the final tool calls differ from the streamed ones")
        elif len(seen) > sent:
            delta["tool_calls"] = [
                {"index": i, "id": f"{self.call_id_prefix}_{i}", "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(seen) if i >= sent
            ]
            self.calls_sent = seen
        return delta or None

    def update(self, text: str) -> dict[str, Any] | None:
        """The delta for the completion text so far (None: nothing new is settled)."""
        settled = self.settled(text)
        if settled is None:
            return None
        parsed = self.family.parse_reply(settled, self.parse_tool_calls)
        return self._diff(parsed.reasoning_content, parsed.content, parsed.tool_calls, final=False)

    def finish(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The rest of the final, committed message (as `ParsedCompletion.to_message` wrote it)."""
        calls = [_Call(tc["function"]["name"], tc["function"]["arguments"]) for tc in message.get("tool_calls") or []]
        return self._diff(message.get("reasoning_content"), message.get("content") or "", calls, final=True)


@dataclass(frozen=True, slots=True)
class _Call:
    name: str
    arguments: str
