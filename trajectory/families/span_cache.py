"""Token ids of repeated prompt spans, tokenized once: the tool schemas and system text every first turn carries.

A first turn renders the whole conversation and tokenizes it; with a few tool schemas most of that text is the same
preamble in every episode of a run (4 KB -> 1k tokens, ~1-5 ms of tokenizer time per first turn here, measured). A
tokenizer splits its input at the spellings of its non-normalized added tokens (`<|im_start|>`, `<｜User｜>`, ...)
before anything else, and tokenizes the text between them independently -- the same fact TITO's appended turns rely
on. So a long span between two such spellings (or the text's ends) has the same ids wherever it appears, and its
ids can be reused: the text is cut at those boundaries, long spans seen before come from the cache, and the rest
is tokenized in as few calls as possible. Exactness is a property test
(tests/unit/trajectory/families/test_span_cache.py).

Only spans seen twice are kept (a unique user prompt never evicts the shared preamble), their size is bounded, and
the cache holds a bounded number of them, least recently used out first.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable

MIN_SPAN_CHARS = 1024
MAX_SPAN_CHARS = 64 * 1024
MAX_SPANS = 256
_SIGHTINGS = 4096


class SpanCache:
    def __init__(self, boundary: re.Pattern[str], encode: Callable[[str], list[int]]) -> None:
        self._boundary = boundary
        self._encode = encode
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of long spans seen once
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """The ids `encode(text)` would give, with long repeated spans taken from the cache."""
        ids: list[int] = []
        start = 0  # text[start:] is not tokenized yet
        span_start = 0  # the current span begins here (after the previous boundary)
        for match in self._boundary.finditer(text):
            start = self._take(text, start, span_start, match.start(), ids)
            span_start = match.end()
        start = self._take(text, start, span_start, len(text), ids)
        if start < len(text):
            ids += self._encode(text[start:])
        return ids

    def _take(self, text: str, start: int, a: int, b: int, ids: list[int]) -> int:
        """If text[a:b] is a long span known to the cache, flush text[start:a] and append its ids."""
        if not MIN_SPAN_CHARS <= b - a <= MAX_SPAN_CHARS:
            return start
        cached = self._lookup(text[a:b])
        if cached is None:
            return start
        if start < a:
            ids += self._encode(text[start:a])
        ids += cached
        return b

    def _lookup(self, span: str) -> tuple[int, ...] | None:
        with self._lock:
            cached = self._ids.get(span)
            if cached is not None:
                self._ids.move_to_end(span)
                return cached
            key = hash(span)
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > _SIGHTINGS:
                    self._seen.popitem(last=False)
                return None
        ids = tuple(self._encode(span))  # the second sighting: tokenize it on its own once, keep it
        with self._lock:
            self._ids[span] = ids
            if len(self._ids) > MAX_SPANS:
                self._ids.popitem(last=False)
        return ids
