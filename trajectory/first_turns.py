"""The prompt ids of first turns, kept by their exact inputs: a GRPO group's G samples of one prompt render once.

An RL trainer starts G episodes of every prompt (the samples of a group), and each opens its session with the same
first request: the same system text, task and tool schemas. A first turn renders the whole conversation through the
chat template and tokenizes it -- the costliest turn of an episode: with 8 tools, 1.9 ms of server CPU at p50, and
0.9-1.2 ms for the same first turn served from here (`bench_turn_overhead --group-size 8`) -- so G-1 of those renders
are repeats.

The key is the pickle of everything the render reads: the messages and tools as the template sees them, the
template kwargs and the text-only flag (the family is the cache's owner). Pickle keeps what a JSON encoding would
blur -- an int from a float, NaN and infinities from null, the order of every mapping -- so equal keys mean equal
inputs and the same ids; a key that differs only in how the pickler shared objects is a miss, never a wrong hit.
A template that reads the clock (`strftime_now`, in real Llama 3.x templates) renders differently from day to day:
its family keeps no first turns. The ids are stored read-only and handed out as they are.

A caller on the event loop asks with `cached_only()`: the ids if they are kept, else `NotCached` at once (no render,
no wait for one), so a repeat is served without the CPU pool's hop and anything else goes to the pool as before.

A group's samples are launched together, so its first requests arrive together: one renders, and the others wait
for its ids instead of rendering the same prompt beside it on the CPU pool (where the GIL would run the renders one
after another anyway). A render that fails (a template error) hands nothing on: each waiter renders for itself.

Bounded by tokens (int32 ids: 4 bytes each), least recently used out first; entries are short-lived by nature (a
group starts within seconds), so the budget only needs to hold the prompts in flight. Thread-safe: first turns are
prepared on the CPU pool and on the event loop.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np

DEFAULT_MAX_TOKENS = 4 * 1024 * 1024  # 16 MiB of ids: thousands of first turns of a few thousand tokens
WAIT_SECONDS = 60.0  # a render in flight taking longer than this (it never should): the waiter renders itself


_CACHED_ONLY: ContextVar[bool] = ContextVar("first_turns_cached_only", default=False)


class NotCached(Exception):
    """A first turn asked for inside `cached_only()` is not kept (or is still rendering): prepare it elsewhere."""


@contextlib.contextmanager
def cached_only() -> Iterator[None]:
    """Within the block, a first turn whose ids are not kept raises NotCached instead of being rendered or waited
    for: the event loop serves a repeat itself and must not spend a render's milliseconds."""
    token = _CACHED_ONLY.set(True)
    try:
        yield
    finally:
        _CACHED_ONLY.reset(token)


def refuse_render() -> None:
    """Raise NotCached inside `cached_only()`: a render is about to start."""
    if _CACHED_ONLY.get():
        raise NotCached


class _InFlight:
    """A render running now: its ids once done (None if it failed)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ids: np.ndarray | None = None


class FirstTurnCache:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, *, enabled: bool = True) -> None:
        """`enabled` False: a family whose renders may differ for equal inputs; no budget turns it on."""
        self._ids: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._rendering: dict[bytes, _InFlight] = {}
        self._lock = threading.Lock()
        self.enabled = enabled
        self.max_tokens = max(0, max_tokens)
        self.tokens = 0  # ids held
        self.hits = 0  # first turns answered from the cache or from a render in flight
        self.misses = 0  # renders

    @property
    def active(self) -> bool:
        """Whether first turns are kept at all (a clock-reading template or a zero budget keeps none)."""
        return self.enabled and self.max_tokens > 0

    def resize(self, max_tokens: int) -> None:
        """A new token budget (0 keeps nothing), entries evicted down to it."""
        with self._lock:
            self.max_tokens = max(0, max_tokens)
            self._evict()

    def key(self, messages: Any, tools: Any, template_kwargs: Any, text_only: bool) -> bytes | None:
        """The key of a first turn's render, or None when the cache is off or the inputs do not pickle."""
        if not self.active:
            return None
        try:
            return pickle.dumps((messages, tools, template_kwargs, text_only), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            return None

    def ids(self, key: bytes, render: Callable[[], np.ndarray]) -> np.ndarray:
        """The first turn's ids: kept, or from the same render in flight, or `render()`'s (kept, read-only)."""
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                self.hits += 1
                return ids
            refuse_render()  # inside cached_only(): neither a render nor a wait for one
            flight = self._rendering.get(key)
            if flight is None:
                flight = self._rendering[key] = _InFlight()
                mine = True
            else:
                mine = False
        if not mine:
            if flight.done.wait(WAIT_SECONDS) and flight.ids is not None:
                with self._lock:
                    self.hits += 1
                return flight.ids
            return self._render(render)  # the render failed (its error is the request's, raised there) or hangs
        try:
            ids = self._render(render)
            flight.ids = ids
        finally:
            with self._lock:
                del self._rendering[key]
                if flight.ids is not None and len(flight.ids) <= self.max_tokens and key not in self._ids:
                    self._ids[key] = flight.ids
                    self.tokens += len(flight.ids)
                    self._evict()
            flight.done.set()
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    def _render(self, render: Callable[[], np.ndarray]) -> np.ndarray:
        with self._lock:
            self.misses += 1
        ids = render()
        ids.flags.writeable = False
        return ids

    def _evict(self) -> None:
        while self.tokens > self.max_tokens and self._ids:
            _, old = self._ids.popitem(last=False)
            self.tokens -= len(old)
