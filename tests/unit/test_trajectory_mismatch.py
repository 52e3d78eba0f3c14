"""The chunked token diff behind mismatch reports: exact, and aligned on template punctuation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
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
