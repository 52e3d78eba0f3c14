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

Bounded by tokens (int32 ids: 4 bytes each), least recently used out first; entries are short-lived by nature (a
group starts within seconds), so the budget only needs to hold the prompts in flight. Thread-safe: first turns are
prepared on the CPU pool.
"""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

DEFAULT_MAX_TOKENS = 4 * 1024 * 1024  # 16 MiB of ids: thousands of first turns of a few thousand tokens


class FirstTurnCache:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, *, enabled: bool = True) -> None:
        """`enabled` False: a family whose renders may differ for equal inputs; no budget turns it on."""
        self._ids: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.enabled = enabled
        self.max_tokens = max(0, max_tokens)
        self.tokens = 0  # ids held
        self.hits = 0
        self.misses = 0

    def resize(self, max_tokens: int) -> None:
        """A new token budget (0 keeps nothing), entries evicted down to it."""
        with self._lock:
            self.max_tokens = max(0, max_tokens)
            self._evict()

    def key(self, messages: Any, tools: Any, template_kwargs: Any, text_only: bool) -> bytes | None:
        """The key of a first turn's render, or None when the cache is off or the inputs do not pickle."""
        if not self.enabled or self.max_tokens <= 0:
            return None
        try:
            return pickle.dumps((messages, tools, template_kwargs, text_only), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            return None

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._ids.move_to_end(key)
            self.hits += 1
            return ids

    def put(self, key: bytes, ids: np.ndarray) -> np.ndarray:
        """Keep `ids` (made read-only: every hit shares the array) unless it alone exceeds the budget; returns it."""
        ids.flags.writeable = False
        with self._lock:
            if len(ids) > self.max_tokens or key in self._ids:
                return ids
            self._ids[key] = ids
            self.tokens += len(ids)
            self._evict()
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    def _evict(self) -> None:
        while self.tokens > self.max_tokens and self._ids:
            _, old = self._ids.popitem(last=False)
            self.tokens -= len(old)
