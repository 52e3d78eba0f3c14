"""First turns prepared on the event loop when they repeat one already kept (a GRPO group's later samples).

A first turn goes to the CPU pool: rendering it holds the loop for milliseconds. But the G samples of a GRPO group
send the same first request, and once the family keeps its ids (trajectory/first_turns.py) preparing a repeat costs
a parse and a lookup, less than the pool's hop (two thread switches and a GIL hand-off, about a third of such a
turn's server CPU here). Which first turn is a repeat is known only after parsing it, so the body's bytes predict it:
a body seen before as a first turn is tried on the loop with `cached_only()`, and one whose ids are not kept (or
still rendering) raises NotCached there and goes to the pool as any first turn does, prepared from scratch (prepare
changes nothing). A trainer that varies the body within a group (a per-sample `seed`) is never predicted: its
repeats still hit the cache, on the pool. Only bodies below `--inline-below-bytes` are tried here, so the parse on
the loop is no larger than any other small body's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import xxhash

from trajectory.first_turns import NotCached, cached_only

T = TypeVar("T")
MAX_BODIES = 16_384  # digests remembered (8 bytes each, in a dict): the first requests of the groups in flight


class RepeatedFirstTurns:
    def __init__(self, max_bodies: int = MAX_BODIES) -> None:
        self._seen: dict[int, None] = {}
        self._max = max_bodies
        self.on_loop = 0  # first turns prepared on the loop from kept ids

    def prepare(self, body: bytes, prepare: Callable[[], T]) -> T | None:
        """`prepare()` on the loop if `body` came before as a first turn and its prompt ids are kept; None when the
        caller must prepare it on the pool. Either way the body is remembered."""
        digest = xxhash.xxh3_64_intdigest(body)
        if digest not in self._seen:
            self._remember(digest)
            return None
        try:
            with cached_only():
                prepared = prepare()
        except NotCached:
            return None
        self.on_loop += 1
        return prepared

    def _remember(self, digest: int) -> None:
        if len(self._seen) >= self._max:
            del self._seen[next(iter(self._seen))]  # the oldest
        self._seen[digest] = None
