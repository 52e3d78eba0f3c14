"""The chunked token diff behind mismatch reports: exact, and aligned on template punctuation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from trajectory.mismatch import diff_tokens

SPECIAL = {0, 1}
TOKENS = st.lists(st.integers(0, 6), max_size=60)


def apply(a: list[int], b: list[int], opcodes) -> list[int]:
    """Rebuild b from a using only the opcodes (equal spans are whatever lies between them)."""
    out, pos = [], 0
    for _, a0, a1, b0, b1 in opcodes:
        assert a0 >= pos
        out.extend(a[pos:a0])
        out.extend(b[b0:b1])
        pos = a1
    return out + a[pos:]


@settings(max_examples=examples(300), deadline=None)
@given(a=TOKENS, b=TOKENS)
def test_diff_is_exact(a, b):
    opcodes = diff_tokens(a, b, SPECIAL)
    assert apply(a, b, opcodes) == b
    assert (not opcodes) == (a == b)
    assert all(op in ("replace", "delete", "insert") for op, *_ in opcodes)


def test_diff_pinpoints_a_dropped_block():
    a = [5, 6, 0, 2, 3, 3, 1, 4, 4, 0, 5, 5, 1]
    b = [5, 6, 0, 4, 4, 0, 5, 5, 1]  # the "2 3 3 <1>" block is gone
    assert diff_tokens(a, b, SPECIAL) == [("delete", 3, 7, 3, 3)]


def _lcs(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        diag, row[0] = 0, 0
        for j, y in enumerate(b, 1):
            diag, row[j] = row[j], diag + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


@settings(max_examples=examples(300), deadline=None)
@given(a=TOKENS, b=TOKENS)
def test_diff_is_a_shortest_edit(a, b):
    """What the opcodes leave unmatched is exactly what a longest common subsequence leaves (no special tokens here:
    one chunk per token)."""
    opcodes = diff_tokens(a, b, set(range(7)))
    changed = sum((a1 - a0) + (b1 - b0) for _, a0, a1, b0, b1 in opcodes)
    assert changed == len(a) + len(b) - 2 * _lcs(a, b)
    assert apply(a, b, opcodes) == b


def test_identical_turns_are_aligned_turn_by_turn():
    """Three identical turns whose re-render differs in each: every difference stays in its own turn. (`difflib`
    matched the second stored turn with the third re-rendered one, since those two are longest alike, and reported
    the glue between them as deleted.)"""
    stored_turn, canonical_turn = [0, 5, 1, 0, 6, 2, 3, 1], [0, 5, 1, 0, 6, 3, 1]
    stored = stored_turn * 3
    canonical = canonical_turn * 2 + stored_turn
    assert diff_tokens(stored, canonical, SPECIAL) == [("delete", 5, 6, 5, 5), ("delete", 13, 14, 12, 12)]
