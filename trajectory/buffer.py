"""Compact, growable token storage: int32 ids, float32 logprobs, uint8 loss mask (9 bytes per token).

Python lists of ints cost ~36 bytes per token per list; a long-lived session server holding thousands of
trajectories cannot afford that. Buffers grow geometrically by 1.1x (amortised O(1) appends: all the copies
together move about 11x the final size, a memcpy), so beyond the small initial capacity the slack is at most ~10%:
under 10 bytes per stored token, docs/design.md 7's bar for the token arrays (1.25x allowed up to 11.25).
"""

from __future__ import annotations

import numpy as np

_GROWTH = 1.1
_MIN_CAPACITY = 256


class TokenBuffer:
    """Three parallel arrays with one logical length; views handed out are read-only."""

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self._ids = np.zeros(capacity, dtype=np.int32)
        self._logprobs = np.zeros(capacity, dtype=np.float32)
        self._mask = np.zeros(capacity, dtype=np.uint8)
        self.size = 0

    @property
    def capacity(self) -> int:
        return len(self._ids)

    @property
    def nbytes(self) -> int:
        return self._ids.nbytes + self._logprobs.nbytes + self._mask.nbytes

    def _view(self, array: np.ndarray) -> np.ndarray:
        view = array[: self.size]
        view.flags.writeable = False
        return view

    @property
    def ids(self) -> np.ndarray:
        return self._view(self._ids)

    @property
    def logprobs(self) -> np.ndarray:
        return self._view(self._logprobs)

    @property
    def mask(self) -> np.ndarray:
        return self._view(self._mask)

    def copy(self) -> TokenBuffer:
        """An independent buffer holding exactly the stored tokens (no slack): a memcpy of 9 bytes per token."""
        other = TokenBuffer.__new__(TokenBuffer)
        other._ids = self._ids[: self.size].copy()
        other._logprobs = self._logprobs[: self.size].copy()
        other._mask = self._mask[: self.size].copy()
        other.size = self.size
        return other

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, int(self.capacity * _GROWTH) + 1)
        for name in ("_ids", "_logprobs", "_mask"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)

    def truncate(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot truncate {self.size} tokens to {size}")
        self.size = size

    def append(self, ids: np.ndarray, logprobs: np.ndarray | None, sampled: bool) -> None:
        """Append ids; `sampled` tokens carry logprobs and loss mask 1, the others 0.0 and 0."""
        n = len(ids)
        self._reserve(self.size + n)
        end = self.size + n
        self._ids[self.size:end] = ids
        self._logprobs[self.size:end] = 0.0 if logprobs is None else logprobs
        self._mask[self.size:end] = 1 if sampled else 0
        self.size = end
