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

A shared head (`adopt_head`, a GRPO group's primed prompt, trajectory/forks.py): the first H positions are read from
arrays the buffer never writes and many buffers hold (the prompt's ids and its zero logprobs and mask), and the
buffer's own arrays hold positions H on. Every child of a fork at the prompt appends its own turns after the same
head, so the prompt is stored once however many children take their turns. Views then join the head and the rest (a
copy per read, as large as the history); a truncation into the head makes the buffer whole again.
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
        # A shared read-only prefix (ids, logprobs, mask) of `_start` positions; the own arrays hold the rest.
        self._head: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._start = 0

    @property
    def capacity(self) -> int:
        return len(self._ids)

    @property
    def shared_head(self) -> int:
        """The first stored positions held by reference (`adopt_head`), not in this buffer's own arrays."""
        return self._start

    @property
    def nbytes(self) -> int:
        """The bytes this buffer owns: 0 while it reads another's arrays (`share`)."""
        if self._borrowed:
            return 0
        return self._ids.nbytes + self._logprobs.nbytes + self._mask.nbytes

    def _view(self, slot: int, array: np.ndarray) -> np.ndarray:
        if self._head is None:
            view = array[: self.size]
        else:
            view = np.concatenate([self._head[slot], array[: self.size - self._start]])
        view.flags.writeable = False
        return view

    @property
    def ids(self) -> np.ndarray:
        return self._view(0, self._ids)

    @property
    def logprobs(self) -> np.ndarray:
        return self._view(1, self._logprobs)

    @property
    def mask(self) -> np.ndarray:
        return self._view(2, self._mask)

    def copy(self) -> TokenBuffer:
        """An independent buffer holding exactly the stored tokens (no slack): a memcpy of 9 bytes per token."""
        other = TokenBuffer.__new__(TokenBuffer)
        other._ids, other._logprobs, other._mask = self.ids.copy(), self.logprobs.copy(), self.mask.copy()
        other.size = self.size
        other._frozen, other._borrowed, other._head, other._start = 0, False, None, 0
        return other

    def share(self, size: int) -> TokenBuffer:
        """A buffer holding the first `size` stored tokens by reference to these arrays (copy on write, see above)."""
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot share {size} of {self.size} tokens")
        if size < self._start:  # inside the shared head: a whole copy of those tokens (no turn boundary lies there)
            other = self.copy()
            other.truncate(size)
            return other
        other = TokenBuffer.__new__(TokenBuffer)
        other._ids, other._logprobs, other._mask = self._ids, self._logprobs, self._mask
        other.size, other._frozen, other._borrowed = size, size, True
        other._head, other._start = self._head, self._start
        self._frozen = max(self._frozen, size)
        return other

    def adopt_head(self, ids: np.ndarray, logprobs: np.ndarray, mask: np.ndarray) -> None:
        """Hold `ids` (with their `logprobs` and `mask`, all read-only and never written) as the first stored tokens,
        by reference: an empty buffer's first prompt when many buffers begin with it (see above)."""
        if self.size:
            raise ValueError("a shared head is adopted by an empty buffer")
        if not len(ids) == len(logprobs) == len(mask):
            raise ValueError("the head's arrays differ in length")
        self._head, self._start = (ids, logprobs, mask), len(ids)
        self.size = len(ids)
        self._frozen = 0

    def _rebase(self, size: int) -> None:
        """Leave the shared head: own arrays holding the first `size` stored tokens."""
        ids, logprobs, mask = self.ids[:size], self.logprobs[:size], self.mask[:size]
        capacity = max(size, _MIN_CAPACITY)
        for name, old in (("_ids", ids), ("_logprobs", logprobs), ("_mask", mask)):
            new = np.zeros(capacity, dtype=old.dtype)
            new[:size] = old
            setattr(self, name, new)
        self._head, self._start, self.size = None, 0, size
        self._frozen, self._borrowed = 0, False

    def _own(self, start: int, needed: int) -> None:
        """Before writing from `start` on: copy the arrays if another buffer may read what the write would change."""
        if not (self._borrowed or start < self._frozen):
            return
        # After a shared head the own arrays start at the size they need: a group's children append short replies
        capacity = max(needed - self._start, _MIN_CAPACITY if self._head is None else 0)
        held = self.size - self._start
        for name in ("_ids", "_logprobs", "_mask"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[:held] = old[:held]
            setattr(self, name, new)
        self._frozen, self._borrowed = 0, False

    def _reserve(self, needed: int) -> None:
        needed -= self._start
        if needed <= self.capacity:
            return
        capacity = max(needed, int(self.capacity * _GROWTH) + 1)
        held = self.size - self._start
        for name in ("_ids", "_logprobs", "_mask"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            new[:held] = old[:held]
            setattr(self, name, new)
        self._frozen, self._borrowed = 0, False  # fresh arrays: nobody else reads them

    def truncate(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot truncate {self.size} tokens to {size}")
        if size < self._start:
            self._rebase(size)
        self.size = size

    def append(self, ids: np.ndarray, logprobs: np.ndarray | None, sampled: bool) -> None:
        """Append ids; `sampled` tokens carry logprobs and loss mask 1, the others 0.0 and 0."""
        n = len(ids)
        self._own(self.size, self.size + n)
        self._reserve(self.size + n)
        begin, end = self.size - self._start, self.size - self._start + n
        self._ids[begin:end] = ids
        self._logprobs[begin:end] = 0.0 if logprobs is None else logprobs
        self._mask[begin:end] = 1 if sampled else 0
        self.size += n
