"""When a streamed reply's text goes out to the agent: the chunk rules of engine/pacing.py over what the engine's
events added (engine/reader.py).

The rules: the first text goes on at once; then what is held goes on `chunk_seconds` after the last hand-on, or as
soon as it fills a chunk of `chunk_tokens` tokens, whichever comes first (the server's defaults make the time decide
at a GPU's pace: --stream-chunk-ms, --stream-chunk-tokens); and all of it when the engine's final event comes
(nothing is held past it). What arrives faster than that is cut into chunks of `chunk_tokens` tokens
that go out together (a Progress's `cuts`, one write). An event is never cut: an engine whose events hold more tokens
than a chunk gets a chunk per event. A cumulative event's text cannot be cut by tokens (its tokens are unknown): it
goes on at once, one chunk per read.

Why a class of its own, with the clock injected: the rules are the agent's contract and are tested by the clock the
test moves, never the wall clock; and the stream loop (engine/sse.py) asks it how long reading may wait (`due`,
`events_wanted`), so that it wakes once per chunk, not once per engine event.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from session_server.engine.pacing import CHUNK_SECONDS, CHUNK_TOKENS
from session_server.engine.reader import Added, Tokens


@dataclass(slots=True)
class Progress:
    """What goes out to the agent now: the new text and, when logprobs are wanted, the new tokens (validated).
    `cuts` (delta events): where the agent's chunks end, as (characters of `text`, tokens) from its start, the last
    one at its end; None (cumulative events): one chunk of unknown tokens."""

    text: str
    tokens: Tokens | None = None
    cuts: list[tuple[int, int]] | None = None


class Chunker:
    """The text of one stream held for the agent, one unit per delta event (its text and the reply's tokens at its
    end), and what of it goes out when."""

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS, chunk_seconds: float = CHUNK_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.chunk_tokens = chunk_tokens
        self.chunk_seconds = chunk_seconds
        self.clock = clock
        self._texts: list[str] = []  # held delta events: their texts, the reply's tokens at each one's end, tokens
        self._counts: list[int] = []
        self._tokens: list[Tokens] = []
        self._at_once: list[Added] = []  # cumulative batches: they go on as they came
        self._by_reads = False  # the events are cumulative: each read's text is a chunk
        self.handed = 0  # the reply's tokens handed on
        self.handed_at: float | None = None  # clock time of the last hand-on (None: none yet)
        self.texted = False  # some text was handed on: until then, everything goes on at once

    @property
    def holding(self) -> bool:
        return bool(self._counts or self._at_once)

    def hold(self, added: Added) -> None:
        if added.counts is None:
            self._at_once.append(added)
            self._by_reads = True
            return
        self._texts += added.texts
        self._counts += added.counts
        if added.tokens is not None:
            self._tokens.append(added.tokens)

    def due(self) -> float | None:
        """When what is held, or what arrives from now on, must go out at the latest (None: at once, or never)."""
        return None if self.handed_at is None else self.handed_at + self.chunk_seconds

    def events_wanted(self, event_tokens: int) -> int:
        """How many more engine events of `event_tokens` tokens fill the next chunk (1 until the first text is out):
        reading sooner than that (and than `due`) would hand nothing on."""
        if not self.texted or self._by_reads:
            return 1
        missing = self.chunk_tokens - (self._counts[-1] - self.handed if self._counts else 0)
        return max(1, math.ceil(missing / max(1, event_tokens)))

    def take(self, final: bool = False) -> Progress | None:
        """What goes out now (None: nothing): every full chunk, and the rest too when it is the first text, the
        engine's final event has come (`final`) or the time is up."""
        if self._at_once:
            return self._cumulative()
        counts = self._counts
        if not counts:
            return None
        everything = (final or not self.texted or self.handed_at is None
                      or self.clock() >= self.handed_at + self.chunk_seconds)
        base = self.handed
        cuts: list[tuple[int, int]] = []
        chars = at = 0
        texts = self._texts
        while at < len(counts):
            end = bisect.bisect_right(counts, base + self.chunk_tokens, at)
            if end == at:
                end = at + 1  # one event of more tokens than a chunk holds
            if not everything and end == len(counts) and counts[end - 1] - base < self.chunk_tokens:
                break  # the last chunk is not full: it waits
            chars += sum(map(len, texts[at:end]))
            cuts.append((chars, counts[end - 1] - self.handed))
            base = counts[end - 1]
            at = end
        if not cuts:
            return None
        text = "".join(texts[:at])
        tokens = self._take_tokens(base - self.handed)
        del texts[:at]
        del counts[:at]
        self.handed = base
        return self._out(Progress(text, tokens, cuts))

    def _take_tokens(self, n: int) -> Tokens | None:
        """The first n held tokens (the entries of the events handed on)."""
        if not self._tokens:
            return None
        held = _joined(self._tokens)
        taken, rest = held.part(0, n), held.part(n, len(held))
        self._tokens = [rest] if len(rest) else []
        return taken

    def _cumulative(self) -> Progress | None:
        batches, self._at_once = self._at_once, []
        text = "".join(t for b in batches for t in b.texts)
        parts = [b.tokens for b in batches if b.tokens is not None]
        return self._out(Progress(text, _joined(parts) if parts else None, None))

    def _out(self, progress: Progress) -> Progress | None:
        if not progress.text and progress.tokens is None:
            return None
        self.handed_at = self.clock()
        self.texted = self.texted or bool(progress.text)
        return progress


def _joined(parts: list[Tokens]) -> Tokens:
    """Tokens of several events as one (top rows only where every part has them)."""
    if len(parts) == 1:
        return parts[0]
    tops = [t.top for t in parts]
    return Tokens(np.concatenate([t.ids for t in parts]), np.concatenate([t.logprobs for t in parts]),
                  None if any(top is None for top in tops) else [row for top in tops for row in top or ()])
