"""Where do two token sequences differ? A diff that stays fast on long trajectories.

A token-level `difflib` diff is quadratic on 32k-token histories (seconds). Token sequences rendered
from chat templates are punctuated by special tokens, so we first diff chunks that end at a special
token (a few per message, so a few hundred items), then refine each differing chunk run at token
level, where the spans are short.

Both levels take a shortest edit script (Myers), not `difflib`'s longest-block-first matching: a history
of identical turns (`user "0"` answered the same way three times) whose re-render differs in every turn
would otherwise be aligned across turns, the second stored turn against the third re-rendered one,
blaming template glue for what is a per-turn difference inside the replies. Past `_MAX_EDITS` edits
(a re-render that shares little with the stored ids) `difflib` answers instead: coarser, but bounded.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Collection, Hashable, Sequence

import numpy as np

_MAX_REFINE = 4096  # tokens per side beyond which a differing span is reported without refinement
_MAX_EDITS = 512  # edit distance beyond which the shortest-edit search gives way to difflib (its cost is O(D^2))

Opcode = tuple[str, int, int, int, int]


def _chunks(ids: np.ndarray, boundaries: np.ndarray) -> tuple[list[tuple[int, ...]], list[int]]:
    """Split after every boundary token; return the chunks and their start offsets (plus the end)."""
    cuts = np.flatnonzero(np.isin(ids, boundaries)) + 1
    starts = [0, *cuts.tolist()]
    if starts[-1] != len(ids):
        starts.append(len(ids))
    values = ids.tolist()
    return [tuple(values[a:b]) for a, b in itertools.pairwise(starts)], starts


def _shortest_edit_matches(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[int, int, int]] | None:
    """Matching blocks `(i, j, size)` of a shortest edit script turning `a` into `b` (Myers' O(ND) greedy search,
    then a walk back through the saved frontiers), or None past `_MAX_EDITS` edits."""
    n, m = len(a), len(b)
    frontier = {1: 0}  # diagonal k = x - y -> furthest x reached on it
    trace: list[dict[int, int]] = []
    for d in range(min(_MAX_EDITS, n + m) + 1):
        trace.append(dict(frontier))
        for k in range(-d, d + 1, 2):
            x = frontier[k + 1] if k == -d or (k != d and frontier[k - 1] < frontier[k + 1]) else frontier[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            frontier[k] = x
            if x >= n and y >= m:
                return _walk_back(trace, n, m)
    return None


def _walk_back(trace: list[dict[int, int]], x: int, y: int) -> list[tuple[int, int, int]]:
    blocks: list[tuple[int, int, int]] = []
    for d in range(len(trace) - 1, -1, -1):
        frontier, k = trace[d], x - y
        prev_k = k + 1 if k == -d or (k != d and frontier[k - 1] < frontier[k + 1]) else k - 1
        prev_x = frontier[prev_k]
        start_x = prev_x + (prev_k < k)  # where this round's snake began (after a move right or down)
        if x > start_x:
            blocks.append((start_x, start_x - k, x - start_x))
        x, y = prev_x, prev_x - prev_k
    return blocks[::-1]


def _opcodes(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[Opcode]:
    """Non-equal opcodes turning `a` into `b`, from a shortest edit script where one is cheap enough."""
    blocks = _shortest_edit_matches(a, b)
    if blocks is None:
        return [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    out: list[Opcode] = []
    i = j = 0
    for bi, bj, size in [*blocks, (len(a), len(b), 0)]:
        if bi > i or bj > j:
            out.append(("replace" if bi > i and bj > j else "delete" if bi > i else "insert", i, bi, j, bj))
        i, j = bi + size, bj + size
    return out


def _refine(a: Sequence[int], b: Sequence[int], a_off: int, b_off: int) -> list[Opcode]:
    if len(a) > _MAX_REFINE or len(b) > _MAX_REFINE:
        return [("replace", a_off, a_off + len(a), b_off, b_off + len(b))]
    return [(op, a_off + i0, a_off + i1, b_off + j0, b_off + j1) for op, i0, i1, j0, j1 in _opcodes(a, b)]


def diff_tokens(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray,
                boundaries: Collection[int]) -> list[Opcode]:
    """Non-equal opcodes (`replace`/`delete`/`insert`, a-range, b-range) turning `a` into `b`."""
    a_ids, b_ids = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    marks = np.fromiter(boundaries, dtype=np.int64)
    a_chunks, a_starts = _chunks(a_ids, marks)
    b_chunks, b_starts = _chunks(b_ids, marks)
    out: list[Opcode] = []
    for _, i0, i1, j0, j1 in _opcodes(a_chunks, b_chunks):
        ta0, ta1, tb0, tb1 = a_starts[i0], a_starts[i1], b_starts[j0], b_starts[j1]
        out.extend(_refine(a_ids[ta0:ta1].tolist(), b_ids[tb0:tb1].tolist(), ta0, tb0))
    return out
