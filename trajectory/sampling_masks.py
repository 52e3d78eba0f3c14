"""Sampling masks: per sampled token, the token ids the engine's sampler kept (top-k / top-p / min-p), stored compactly.

Why: with truncated sampling the engine samples from the kept set renormalised, while a trainer's recompute is
normalised over the whole vocabulary, so every importance ratio is biased unless the trainer renormalises over the
same set (SGLang's `return_sampling_mask`, docs/design.md 5.1). The sets are ragged (one to `top_k` ids per token), so
they travel and are stored as CSR: int32 ids and int64 offsets with one row per token, beside the engine's own
support-normalised logprob of the sampled token (`output_token_sampling_logprobs` in mode "selected"), which is what
a support-renormalised recompute is compared with.

`SamplingMasks` is one reply's rows (validated from the engine's lists by `from_engine`, joined across a continued
reply by `concat`). `MaskBuffer` holds a trajectory's rows by stored position, parallel to `TokenBuffer`: a position
the model did not sample (prompt, tool output, template glue) has an empty row, so rollback and trims are a
truncation of both buffers, and the rows survive whatever the token arrays survive.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import UpstreamError

_GROWTH = 1.1


@dataclass(frozen=True, slots=True, eq=False)
class SamplingMasks:
    """Rows of kept ids (CSR: `ids[offsets[i]:offsets[i+1]]` is row i) and each row's sampled-token logprob
    normalised over the row (`logprobs`, float32, one per row)."""

    ids: np.ndarray       # int32
    offsets: np.ndarray   # int64, len(rows) + 1, offsets[0] == 0
    logprobs: np.ndarray  # float32, one per row

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def rows(self, start: int, end: int) -> SamplingMasks:
        """Rows [start, end) as masks of their own (offsets rebased to 0)."""
        offsets = self.offsets[start:end + 1]
        return SamplingMasks(self.ids[offsets[0]:offsets[-1]].copy(), offsets - offsets[0],
                             self.logprobs[start:end].copy())

    @classmethod
    def empty(cls) -> SamplingMasks:
        return cls(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.float32))

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]], logprobs: Sequence[float]) -> SamplingMasks:
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
        return cls(ids.astype(np.int32), offsets, np.asarray(logprobs, dtype=np.float32))

    @classmethod
    def from_engine(cls, rows: list[list[int]] | None, logprobs: list[float] | None, output_ids: np.ndarray,
                    vocab_size: int, max_row: int) -> SamplingMasks:
        """The engine's `output_token_sampling_mask` and `output_token_sampling_logprobs` (mode "selected"), held to
        docs/design.md 5.3's mask rules: one non-empty row per output token, ids in the vocabulary and unique in
        their row, the sampled id in its row, at most `max_row` ids (the request's top-k bound), one finite logprob
        <= 0 per row. Raises UpstreamError (a 502, nothing committed) naming the broken rule."""
        n = len(output_ids)
        if n == 0 and not rows and not logprobs:  # a request aborted before its first token has no mask keys
            return cls.empty()
        if rows is None or logprobs is None:
            raise UpstreamError("engine reply has no output_token_sampling_mask / output_token_sampling_logprobs "
                                "though sampling masks were asked for", rule="sampling_mask")
        if len(rows) != n or len(logprobs) != n:
            raise UpstreamError(f"engine reply has {len(rows)} sampling-mask rows and {len(logprobs)} sampling "
                                f"logprobs for {n} output tokens", rule="sampling_mask")
        try:
            masks = cls.from_rows(rows, logprobs)
        except (OverflowError, TypeError, ValueError):
            raise UpstreamError("engine sampling mask holds an id outside int64", rule="sampling_mask_range") from None
        _check(masks, output_ids, vocab_size, max_row)
        return masks

    @staticmethod
    def concat(parts: Sequence[SamplingMasks]) -> SamplingMasks:
        """The rows of `parts` one after another (a reply continued after an engine-wide abort)."""
        offsets = [np.zeros(1, np.int64)]
        at = 0
        for part in parts:
            offsets.append(part.offsets[1:] + at)
            at += int(part.offsets[-1])
        return SamplingMasks(np.concatenate([p.ids for p in parts] or [np.zeros(0, np.int32)]).astype(np.int32),
                             np.concatenate(offsets),
                             np.concatenate([p.logprobs for p in parts] or [np.zeros(0, np.float32)]
                                            ).astype(np.float32))


def _check(masks: SamplingMasks, output_ids: np.ndarray, vocab_size: int, max_row: int) -> None:
    lengths = np.diff(masks.offsets)
    if len(lengths) and lengths.min() < 1:
        i = int(np.flatnonzero(lengths < 1)[0])
        raise UpstreamError(f"output_token_sampling_mask[{i}] is empty", rule="sampling_mask")
    if len(lengths) and lengths.max() > max_row:
        i = int(np.flatnonzero(lengths > max_row)[0])
        raise UpstreamError(f"output_token_sampling_mask[{i}] keeps {int(lengths[i])} ids, more than the request's "
                            f"bound {max_row}", rule="sampling_mask_bound")
    ids = masks.ids
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        at = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        i = int(np.searchsorted(masks.offsets, at, side="right")) - 1
        raise UpstreamError(f"output_token_sampling_mask[{i}] holds id {int(ids[at])} outside [0, {vocab_size})",
                            rule="sampling_mask_range")
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    hits = np.zeros(len(lengths), dtype=np.int64)
    np.add.at(hits, row_of, ids == np.repeat(np.asarray(output_ids, np.int32), lengths))
    if len(hits) and hits.min() < 1:
        i = int(np.flatnonzero(hits < 1)[0])
        raise UpstreamError(f"output_token_sampling_mask[{i}] does not hold the sampled id {int(output_ids[i])}",
                            rule="sampling_mask_sampled")
    order = np.lexsort((ids, row_of))
    same = (row_of[order][1:] == row_of[order][:-1]) & (ids[order][1:] == ids[order][:-1])
    if same.any():
        i = int(row_of[order][1:][same][0])
        raise UpstreamError(f"output_token_sampling_mask[{i}] repeats an id", rule="sampling_mask")
    lp = masks.logprobs.astype(np.float64)
    bad = ~np.isfinite(lp) | (lp > 1e-4)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UpstreamError(f"output_token_sampling_logprobs[{i}] {masks.logprobs[i]} is not a finite logprob <= 0",
                            rule="sampling_mask_logprob")


class MaskBuffer:
    """A trajectory's rows by stored position: int64 offsets (one more than positions), int32 ids, float32 sampled
    logprob per position (0.0 on empty rows). Grows like TokenBuffer; views handed out are read-only."""

    def __init__(self, size: int = 0) -> None:
        self._offsets = np.zeros(max(size, 255) + 1, np.int64)
        self._ids = np.zeros(256, np.int32)
        self._logprobs = np.zeros(max(size, 255), np.float32)
        self.size = size  # positions, all with empty rows at first

    @property
    def nbytes(self) -> int:
        return self._offsets.nbytes + self._ids.nbytes + self._logprobs.nbytes

    @staticmethod
    def _grown(array: np.ndarray, used: int, needed: int) -> np.ndarray:
        if needed <= len(array):
            return array
        new = np.zeros(max(needed, int(len(array) * _GROWTH) + 1), array.dtype)
        new[:used] = array[:used]
        return new

    def truncate(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ValueError(f"cannot truncate {self.size} positions to {size}")
        self.size = size

    def append(self, count: int, masks: SamplingMasks | None) -> None:
        """`count` positions: the rows of `masks` (len(masks) == count), or empty rows (None)."""
        if masks is not None and len(masks) != count:
            raise ValueError(f"{len(masks)} mask rows for {count} positions")
        start, end = self.size, self.size + count
        used = int(self._offsets[start])
        added = 0 if masks is None else int(masks.offsets[-1])
        self._offsets = self._grown(self._offsets, start + 1, end + 1)
        self._logprobs = self._grown(self._logprobs, start, end)
        self._ids = self._grown(self._ids, used, used + added)
        if masks is None:
            self._offsets[start + 1:end + 1] = used
            self._logprobs[start:end] = 0.0
        else:
            self._offsets[start + 1:end + 1] = masks.offsets[1:] + used
            self._ids[used:used + added] = masks.ids
            self._logprobs[start:end] = masks.logprobs
        self.size = end

    def masks(self, end: int | None = None) -> SamplingMasks:
        """Copies of the rows of positions [0, end)."""
        end = self.size if end is None else end
        offsets = self._offsets[:end + 1].copy()
        return SamplingMasks(self._ids[:int(offsets[-1])].copy(), offsets, self._logprobs[:end].copy())

    def copy(self) -> MaskBuffer:
        other = MaskBuffer.__new__(MaskBuffer)
        other._offsets = self._offsets[:self.size + 1].copy()
        other._ids = self._ids[:int(self._offsets[self.size])].copy()
        other._logprobs = self._logprobs[:self.size].copy()
        other.size = self.size
        return other

