"""TokenBuffer's shared head (adopt_head, a forked GRPO group's primed prompt): buffers that hold it by reference
read, write, share, copy and truncate exactly as a buffer that holds the same tokens itself, never write the head,
and own only what they appended after it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from trajectory.buffer import TokenBuffer

OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just(False)),
    st.tuples(st.just("share"), st.floats(0, 1), st.booleans()),
), max_size=12)


def state(buffer: TokenBuffer) -> tuple[list[int], list[float], list[int]]:
    return buffer.ids.tolist(), buffer.logprobs.tolist(), buffer.mask.tolist()


@settings(max_examples=examples(80), deadline=None)
@given(head=st.integers(1, 300), ops=OPS)
def test_a_buffer_on_a_shared_head_is_a_buffer_that_holds_it(head: int, ops: list[tuple[str, float, bool]]) -> None:
    ids = np.arange(1000, 1000 + head, dtype=np.int32)
    zeros_f, zeros_u = np.zeros(head, np.float32), np.zeros(head, np.uint8)
    for a in (ids, zeros_f, zeros_u):
        a.flags.writeable = False  # a write into the head would raise
    shared, plain = TokenBuffer(), TokenBuffer()
    shared.adopt_head(ids, zeros_f, zeros_u)
    plain.append(ids, None, sampled=False)
    pairs = [(shared, plain)]
    counter = 0
    for op, amount, flag in ops:
        a, b = pairs[-1] if not flag else pairs[0]
        if op == "append":
            n = int(amount)
            new = np.arange(counter, counter + n, dtype=np.int32)
            counter += n
            lp = np.full(n, -0.5, np.float32) if flag else None
            a.append(new, lp, sampled=flag)
            b.append(new, lp, sampled=flag)
        elif op == "truncate":
            size = int(amount * a.size)
            a.truncate(size)
            b.truncate(size)
        else:
            size = int(amount * a.size)
            pairs.append((a.share(size), b.share(size)))
        for x, y in pairs:
            assert state(x) == state(y)
            assert state(x.copy()) == state(y)
    assert ids.tolist() == list(range(1000, 1000 + head))  # the head was never written


def test_a_group_stores_its_prompt_once() -> None:
    head = 4096
    ids = np.arange(head, dtype=np.int32)
    zeros_f, zeros_u = np.zeros(head, np.float32), np.zeros(head, np.uint8)
    children = [TokenBuffer().share(0) for _ in range(8)]
    for k, child in enumerate(children):
        child.adopt_head(ids, zeros_f, zeros_u)
        child.append(np.full(20, k, np.int32), np.full(20, -0.1, np.float32), sampled=True)
        assert child.ids[:head].tolist() == ids.tolist() and child.ids[head:].tolist() == [k] * 20
    own = sum(c.nbytes for c in children)
    assert own <= 8 * 20 * 9  # each owns its reply only (exactly sized): the 4096-token prompt is held once
    first = children[0]
    first.truncate(100)  # a rollback into the head: the buffer holds its tokens itself again
    assert first.ids.tolist() == list(range(100)) and first.nbytes >= 100 * 9
