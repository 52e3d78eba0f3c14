"""Where do two token sequences differ? A diff that stays fast on long trajectories.

A token-level `difflib` diff is quadratic on 32k-token histories (seconds). Token sequences rendered
from chat templates are punctuated by special tokens, so we first diff chunks that end at a special
token (a few per message, so a few hundred items), then refine each differing chunk run at token
level, where the spans are short.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Collection, Sequence

import numpy as np

_MAX_REFINE = 4096  # tokens per side beyond which a differing span is reported without refinement

Opcode = tuple[str, int, int, int, int]


def _chunks(ids: np.ndarray, boundaries: np.ndarray) -> tuple[list[tuple[int, ...]], list[int]]:
    """Split after every boundary token; return the chunks and their start offsets (plus the end)."""
    cuts = np.flatnonzero(np.isin(ids, boundaries)) + 1
    starts = [0, *cuts.tolist()]
    if starts[-1] != len(ids):
        starts.append(len(ids))
    values = ids.tolist()
    return [tuple(values[a:b]) for a, b in itertools.pairwise(starts)], starts


def _refine(a: Sequence[int], b: Sequence[int], a_off: int, b_off: int) -> list[Opcode]:
    if len(a) > _MAX_REFINE or len(b) > _MAX_REFINE:
        return [("replace", a_off, a_off + len(a), b_off, b_off + len(b))]
    return [
        (op, a_off + i0, a_off + i1, b_off + j0, b_off + j1)
        for op, i0, i1, j0, j1 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
        if op != "equal"
    ]


def diff_tokens(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray,
                boundaries: Collection[int]) -> list[Opcode]:
    """Non-equal opcodes (`replace`/`delete`/`insert`, a-range, b-range) turning `a` into `b`."""
    a_ids, b_ids = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    marks = np.fromiter(boundaries, dtype=np.int64)
    a_chunks, a_starts = _chunks(a_ids, marks)
    b_chunks, b_starts = _chunks(b_ids, marks)
    out: list[Opcode] = []
    for op, i0, i1, j0, j1 in difflib.SequenceMatcher(None, a_chunks, b_chunks, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        ta0, ta1, tb0, tb1 = a_starts[i0], a_starts[i1], b_starts[j0], b_starts[j1]
        out.extend(_refine(a_ids[ta0:ta1].tolist(), b_ids[tb0:tb1].tolist(), ta0, tb0))
    return out
