"""Compact, growable token storage: int32 ids, float32 logprobs, uint8 loss mask (9 bytes per token).

Python lists of ints cost ~36 bytes per token per list; a long-lived session server holding thousands of
trajectories cannot afford that. Buffers grow geometrically by 1.1x (amortised O(1) appends: all the copies
together move about 11x the final size, a memcpy), so beyond the small initial capacity the slack is at most ~10%:
under 10 bytes per stored token, docs/design.md 7's bar for the token arrays (1.25x allowed up to 11.25).

Copy on write (a fork, trajectory/forks.py): `share(size)` hands out a buffer that reads this one's arrays. The arrays
are then written by neither below the shared length without a copy first: the child copies before its first write
(it writes where the parent may have appended), the parent only if it writes below the shared length (a rollback
into the forked prefix); appending past it stays in place. A fork of a 32k-token trajectory costs a few hundred bytes
per child, not 9 bytes per token.
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
        self._frozen = 0  # positions [0, _frozen) are read by a buffer `share` handed out: a write there copies first
        self._borrowed = False  # the arrays are another buffer's: any write copies first

    @property
    def capacity(self) -> int:
        return len(self._ids)

    @property
    def nbytes(self) -> int:
        """The bytes this buffer owns: 0 while it reads another's arrays (`share`)."""
        if self._borrowed:
            return 0
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
        other._frozen, other._borrowed = 0, False
        return other

    def share(self, size: int) -> TokenBuffer:
        """A buffer holding the first `size` stored tokens by reference to these arrays (copy on write, see above)."""
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot share {size} of {self.size} tokens")
        other = TokenBuffer.__new__(TokenBuffer)
        other._ids, other._logprobs, other._mask = self._ids, self._logprobs, self._mask
        other.size, other._frozen, other._borrowed = size, size, True
        self._frozen = max(self._frozen, size)
        return other

    def _own(self, start: int, needed: int) -> None:
        """Before writing from `start` on: copy the arrays if another buffer may read what the write would change."""
        if not (self._borrowed or start < self._frozen):
            return
        capacity = max(needed, _MIN_CAPACITY)
        for name in ("_ids", "_logprobs", "_mask"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)
        self._frozen, self._borrowed = 0, False

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, int(self.capacity * _GROWTH) + 1)
        for name in ("_ids", "_logprobs", "_mask"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)
        self._frozen, self._borrowed = 0, False  # fresh arrays: nobody else reads them

    def truncate(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot truncate {self.size} tokens to {size}")
        self.size = size

    def append(self, ids: np.ndarray, logprobs: np.ndarray | None, sampled: bool) -> None:
        """Append ids; `sampled` tokens carry logprobs and loss mask 1, the others 0.0 and 0."""
        n = len(ids)
        self._own(self.size, self.size + n)
        self._reserve(self.size + n)
        end = self.size + n
        self._ids[self.size:end] = ids
        self._logprobs[self.size:end] = 0.0 if logprobs is None else logprobs
        self._mask[self.size:end] = 1 if sampled else 0
        self.size = end
