"""A fixed pool of KV token slots.

Why a numpy free-list: the real engine owns a fixed tensor of KV slots, and leaks show up as slots that never come
back. Keeping the free slots in one int32 stack (and an ownership bitmap that catches double frees) makes
alloc/free vector operations and lets `used` be an exact, checkable number instead of a running estimate.
"""

from __future__ import annotations

import numpy as np


class KVPool:
    """Hands out and takes back slot indices in [0, capacity)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("KV capacity must be positive")
        self.capacity = capacity
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int32)
        self._n_free = capacity
        self._in_use = np.zeros(capacity, dtype=bool)

    @property
    def free(self) -> int:
        return self._n_free

    @property
    def used(self) -> int:
        return self.capacity - self._n_free

    def alloc(self, n: int) -> np.ndarray | None:
        """Return `n` slots, or None when fewer are free (the caller evicts or waits)."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of slots")
        if n > self._n_free:
            return None
        start = self._n_free - n
        slots = self._free[start : self._n_free].copy()
        self._n_free = start
        self._in_use[slots] = True
        return slots

    def release(self, slots: np.ndarray) -> None:
        """Give slots back; releasing a slot that is not in use is a bookkeeping bug and raises."""
        n = len(slots)
        if n == 0:
            return
        if not self._in_use[slots].all() or len(np.unique(slots)) != n:
            raise AssertionError("KV slot released twice or never allocated")
        self._in_use[slots] = False
        self._free[self._n_free : self._n_free + n] = slots
        self._n_free += n

    def in_use_mask(self) -> np.ndarray:
        """Copy of the ownership bitmap, for invariant checks."""
        return self._in_use.copy()
