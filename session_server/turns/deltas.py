"""Incremental OpenAI deltas from a growing completion text, never contradicting the final parse, in work proportional
to the new text.

Why not a separate streaming parser per family: the committed assistant message is `family.parse_reply` of the final
text, and an agent rebuilds its history from the deltas it saw; if the two ever disagreed, the next turn would not
match the stored history. So the deltas are computed with the very same parser, on a prefix of the text that is
already settled: the text minus a held-back tail that later tokens could still reinterpret -- an unclosed tool-call
block, a partial marker (`</thi`, `<tool_ca`), trailing newlines (the separator the parsers strip before a call or
after reasoning), an incomplete UTF-8 character. Whatever the parse of that prefix says beyond what was already sent
is the delta, as long as it extends what was sent; otherwise it waits. `finish` checks the final parse against
everything sent, so a stream can never silently diverge from what is committed.

Why it stays linear: re-parsing the whole settled text on every engine event costs O(n) per event, O(n^2) per reply
(a 16k-token reply streamed one token per event re-parsed megabytes per token). But between markers a reply is plain
text that the parser copies verbatim into one field (reasoning or content). So after each full parse the tracker
asks the parser itself whether the settled text ends in such a quiet place: it parses the settled text with a probe
of plain text and whitespace appended, and if exactly that probe lands at the end of one field (and everything sent
equals the parse), later text that brings no marker is appended to that field without parsing, holding back
trailing whitespace (a parser may strip it at the end of a field) and any partial marker. Text that brings a
marker goes through the full parse again; text inside an unclosed tool-call block waits for the block's end without
parsing. Parses are then proportional to the markers in a reply, not to its events, and the property tests
(tests/unit/session_server/turns/test_deltas.py) hold every registered family to "the deltas assemble to the
final message".

Pure and synchronous: no I/O, usable from a worker thread or the loop.
"""

from __future__ import annotations

from typing import Any

from trajectory import ModelFamily

# Plain text the quiet check appends: whitespace of every kind a parser might strip next to a marker, then a letter.
_PROBE = "\n\n \t\r\nx"
_HELD = "\r\n \t\ufffd"  # trailing characters the quick path holds back (whitespace, an incomplete character)


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


class _Pieces:
    """A string built by appending, O(new) per append; joined (once) only when the whole is read."""

    __slots__ = ("_pieces", "length")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)

    def set(self, text: str) -> None:
        self._pieces = [text] if text else []
        self.length = len(text)

    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def tail(self, start: int) -> str:
        """The text from `start` on, reading only the pieces that hold it."""
        need = self.length - max(0, start)
        taken: list[str] = []
        got = 0
        for piece in reversed(self._pieces):
            if got >= need:
                break
            taken.append(piece)
            got += len(piece)
        joined = "".join(reversed(taken))
        return joined[len(joined) - need:] if need > 0 else ""


class DeltaTracker:
    """The deltas of one streamed reply: feed it the text as it grows (`extend` a piece, or `update` with the whole
    text so far), then `finish` with the committed message."""

    def __init__(self, family: ModelFamily, call_id_prefix: str, parse_tool_calls: bool = True, opening: str = "",
                 tools: list[dict[str, Any]] | None = None) -> None:
        """`opening` is the start of the reply the prompt already wrote (TurnPlan.reply_opening): the engine's text
        continues it. `tools` are the turn's (XML tool-call arguments are typed by them)."""
        self.family = family
        self.call_id_prefix = call_id_prefix
        self.parse_tool_calls = parse_tool_calls
        self.opening = opening
        self.tools = tools
        self._reasoning = _Pieces()
        self._content = _Pieces()
        self.calls_sent: list[tuple[str, str]] = []
        self._text = _Pieces()  # everything received, after the opening
        self._text.append(opening)
        self._think = getattr(family, "reasoning_markers", None)
        self._calls = getattr(family, "tool_call_markers", None) if parse_tool_calls else None
        # A family's reasoning may end where a tool call opens even when calls are not parsed (Qwen3.5): the opening
        # marker stays a place where text can change meaning either way.
        call_markers = getattr(family, "tool_call_markers", None)
        self._markers = tuple(dict.fromkeys(
            m for pair in (self._think, self._calls, call_markers[:1] if call_markers else None,
                           getattr(family, "stream_markers", ())) if pair for m in pair))
        self._overlap = max((len(m) for m in self._markers), default=1) - 1
        self._prefixes = frozenset(m[:n] for m in self._markers for n in range(1, len(m)))  # partial markers
        self._starts = frozenset(m[0] for m in self._markers)
        self._settled_end = 0  # the text up to here is sent (as far as its parse says)
        self._quiet: str | None = None  # the field plain text after _settled_end extends verbatim, if known
        self._open_call: int | None = None  # where an unclosed tool-call block starts, while waiting for its end

    @property
    def reasoning_sent(self) -> str:
        return self._reasoning.text()

    @property
    def content_sent(self) -> str:
        return self._content.text()

    # -- feeding --------------------------------------------------------------------------------------------------

    def update(self, text: str) -> dict[str, Any] | None:
        """The delta for the completion text so far (None: nothing new is settled). `text` extends every earlier
        one, except that a trailing incomplete character (U+FFFD) may be completed later."""
        known = self._text.length
        if known and self._text.tail(known - 1) == "\ufffd":  # the character it stood for may have arrived:
            known -= self._drop_last()  # take the text from there again
        known -= len(self.opening)  # `text` does not repeat the opening (and is not copied to prepend it)
        return self.extend(text[known:]) if len(text) > known else None

    def _drop_last(self) -> int:
        text = self._text.text()
        kept = text.rstrip("\ufffd")
        self._text.set(kept)
        self._settled_end = min(self._settled_end, len(kept))
        return len(text) - len(kept)

    def extend(self, piece: str) -> dict[str, Any] | None:
        """The delta after `piece` is appended to the completion text (None: nothing new is settled)."""
        if not piece:
            return None
        start = self._text.length
        self._text.append(piece)
        if not self._markers:
            return None  # a family without declared markers: everything is sent at the end
        if self._open_call is not None:  # only the new text is read while a block is held back (however long)
            if self._calls is None:  # a message the family's own rule holds back whole: only a marker may end it
                fresh = self._text.tail(start - self._overlap)
                return self._parse() if any(m in fresh for m in self._markers) else None
            if self._calls[1] not in self._text.tail(max(self._open_call, start - self._overlap)):
                return None  # the block is still open: nothing before it changes, nothing in it is sent yet
            self._open_call = None
        # After a quiet place: everything not yet settled (a held-back tail may hold a whole marker: an opener that
        # ends reasoning is never settled past) and enough before it to see a marker that straddles the settled end.
        elif self._quiet is not None and not self._holds_marker(
                self._text.tail(min(start, self._settled_end) - self._overlap)):
            return self._plain()
        return self._parse()

    def _holds_marker(self, text: str) -> bool:
        """Whether `text` holds a marker: first by the markers' first characters (one search each, `<` for most
        families, where plain text rarely has one), then by the markers themselves."""
        return any(c in text for c in self._starts) and any(m in text for m in self._markers)

    def _plain(self) -> dict[str, Any] | None:
        """Text without markers after a quiet place: appended to the quiet field as it is, trailing whitespace,
        incomplete characters and partial markers held back."""
        assert self._quiet is not None
        fresh = self._text.tail(self._settled_end)
        cut = len(fresh.rstrip(_HELD))
        cut -= self._partial_marker(fresh[:cut])
        cut = len(fresh[:cut].rstrip(_HELD))  # the separator before a marker is the parser's to drop
        if cut <= 0:
            return None
        added = fresh[:cut]
        self._settled_end += cut
        if self._quiet == "reasoning":
            self._reasoning.append(added)
            return {"reasoning_content": added}
        self._content.append(added)
        return {"content": added}

    def _partial_marker(self, text: str) -> int:
        """Length of the longest proper prefix of any marker that `text` ends with."""
        end = text[-self._overlap:]
        if not any(c in end for c in self._starts):
            return 0
        return next((n for n in range(min(self._overlap, len(text)), 0, -1) if text[-n:] in self._prefixes), 0)

    def _parse(self) -> dict[str, Any] | None:
        """The full parse of the settled text; afterwards, whether the next plain text can skip it."""
        self._quiet = None
        settled, self._open_call = self._settle(self._text.text())
        if settled is None:
            return None
        parsed = self.family.parse_reply(settled, self.parse_tool_calls, self.tools)
        delta = self._diff(parsed.reasoning_content, parsed.content, parsed.tool_calls, final=False)
        self._settled_end = len(settled)
        if self._open_call is None and self._sent_is(parsed):
            self._quiet = self._quiet_field(settled, parsed)
        return delta

    def _sent_is(self, parsed: Any) -> bool:
        return (self.reasoning_sent == (parsed.reasoning_content or "") and self.content_sent == parsed.content
                and self.calls_sent == [(c.name, c.arguments) for c in parsed.tool_calls])

    def _quiet_field(self, settled: str, parsed: Any) -> str | None:
        """The field that plain text appended to `settled` extends verbatim, as the parser itself says."""
        probe = self.family.parse_reply(settled + _PROBE, self.parse_tool_calls, self.tools)
        if [(c.name, c.arguments) for c in probe.tool_calls] != self.calls_sent:
            return None
        if probe.reasoning_content == parsed.reasoning_content and probe.content == parsed.content + _PROBE:
            return "content"
        if (parsed.reasoning_content is not None and probe.content == parsed.content
                and probe.reasoning_content == parsed.reasoning_content + _PROBE):
            return "reasoning"
        return None

    def settled(self, text: str) -> str | None:
        """The prefix of `text` whose parse cannot change any more; None when nothing can be said yet."""
        return self._settle(text)[0]

    def _settle(self, text: str) -> tuple[str | None, int | None]:
        """`settled(text)`, and where an unclosed tool-call block starts (None: no such block)."""
        cut = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD until it is complete
        own = self.family.stream_settled(text[:cut])
        if own is not None:
            end, holding = own
            return text[:end], (end if holding else None)
        think, calls = self._think, self._calls
        if think is None and calls is None:
            return None, None  # a family without declared markers: everything is sent at the end
        text = text[:cut]
        if think is not None and len(text) < len(think[0]) and think[0].startswith(text):
            return None, None  # could still become the reasoning block
        open_call = None
        if calls is not None:
            opened = text.rfind(calls[0])
            if opened >= 0 and text.find(calls[1], opened) < 0:
                cut = open_call = opened  # an unclosed tool-call block
            else:
                cut -= _partial_suffix(text[:cut], calls[0])
        elif self._markers:
            cut -= max(_partial_suffix(text[:cut], m) for m in self._markers)
        if think is not None and text.startswith(think[0]) and think[1] not in text:
            cut -= _partial_suffix(text[:cut], think[1])
            # A tool-call opener inside an unclosed reasoning block ends it (Qwen3.5, as SGLang parses it) unless the
            # block closes later: wait for which.
            opener = getattr(self.family, "tool_call_markers", None)
            inside = text.find(opener[0], len(think[0])) if opener is not None else -1
            if inside >= 0:
                cut = min(cut, inside)
        while cut > 0 and text[cut - 1] in "\r\n":
            cut -= 1
        return text[:cut], open_call

    # -- deltas ---------------------------------------------------------------------------------------------------

    def _diff(self, reasoning: str | None, content: str, calls: list[Any], final: bool) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if reasoning:
            grown = _growth(reasoning, self.reasoning_sent, final, "reasoning")
            if grown:
                delta["reasoning_content"] = grown
                self._reasoning.set(reasoning)
        elif final and self._reasoning.length:
            raise StreamDivergedError("streamed reasoning vanished from the final parse")
        grown = _growth(content, self.content_sent, final, "content")
        if grown:
            delta["content"] = grown
            self._content.set(content)
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

    def finish(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The rest of the final, committed message (as `ParsedCompletion.to_message` wrote it)."""
        calls = [_Call(tc["function"]["name"], tc["function"]["arguments"]) for tc in message.get("tool_calls") or []]
        return self._diff(message.get("reasoning_content"), message.get("content") or "", calls, final=True)


class _Call:
    __slots__ = ("arguments", "name")

    def __init__(self, name: str, arguments: str) -> None:
        self.name = name
        self.arguments = arguments
