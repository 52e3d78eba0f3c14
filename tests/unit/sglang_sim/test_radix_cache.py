"""The radix cache keeps exact books under any interleaving of insert, match, lock, unlock and evict."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_sim.kv_pool import KVPool
from sglang_sim.radix_cache import RadixCache
from support.examples import examples

CAP = 64

token_seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)
ops = st.lists(st.tuples(st.sampled_from(["insert", "match_lock", "unlock", "evict"]), token_seqs,
                         st.integers(0, 40)), max_size=60)


@settings(max_examples=examples(300), deadline=None)
@given(ops)
def test_random_operations_keep_the_books(operations):
    pool = KVPool(CAP)
    cache = RadixCache(pool)
    locks = []
    for op, seq, n in operations:
        tokens = np.asarray(seq, dtype=np.int32)
        if op == "insert":
            match = cache.match_prefix(tokens)
            cache.lock(match.node)
            need = len(tokens) - match.length
            slots = pool.alloc(need)
            if slots is None:
                cache.evict(need - pool.free)
                slots = pool.alloc(need)
            if slots is not None:
                already = cache.insert(tokens, np.concatenate([match.slots, slots]))
                assert already >= match.length
                pool.release(slots[: already - match.length])
                # the inserted sequence is now fully cached
                assert cache.match_prefix(tokens).length == len(tokens)
            cache.unlock(match.node)
        elif op == "match_lock":
            match = cache.match_prefix(tokens)
            assert match.length <= len(tokens)
            assert np.array_equal(np.sort(match.slots), np.sort(np.unique(match.slots)))
            cache.lock(match.node)
            locks.append(match.node)
        elif op == "unlock" and locks:
            cache.unlock(locks.pop(n % len(locks)))
        elif op == "evict":
            before = cache.evictable_size
            freed = cache.evict(n)
            assert freed <= before
            assert freed >= min(n, before)
        assert cache.check() == []
        assert pool.used == cache.total_size
        assert cache.protected_size == 0 or locks
    for node in locks:
        cache.unlock(node)
    assert cache.protected_size == 0
    cache.evict_all()
    assert pool.used == 0 and cache.total_size == 0 and cache.check() == []


def test_lru_evicts_least_recent_leaf_and_never_locked_ones():
    pool = KVPool(10)
    cache = RadixCache(pool)
    a, b = np.array([1, 2, 3], np.int32), np.array([4, 5, 6], np.int32)
    cache.insert(a, pool.alloc(3))
    cache.insert(b, pool.alloc(3))
    cache.match_prefix(a)  # a is now more recent than b
    assert cache.evict(1) == 3
    assert cache.match_prefix(b).length == 0 and cache.match_prefix(a).length == 3
    locked = cache.match_prefix(a)
    cache.lock(locked.node)
    assert cache.evict(3) == 0
    cache.unlock(locked.node)
    assert cache.evict(3) == 3 and pool.used == 0


def test_split_keeps_locks_and_shares_prefix():
    pool = KVPool(16)
    cache = RadixCache(pool)
    cache.insert(np.array([1, 2, 3, 4], np.int32), pool.alloc(4))
    m = cache.match_prefix(np.array([1, 2, 9], np.int32))
    assert m.length == 2
    cache.lock(m.node)
    assert cache.protected_size == 2 and cache.evictable_size == 2
    cache.evict(10)  # only the unlocked tail [3, 4] can go
    assert cache.total_size == 2 and cache.check() == []
    cache.unlock(m.node)
    assert cache.evict_all() == 2 and pool.used == 0


def test_pool_rejects_double_free():
    pool = KVPool(4)
    slots = pool.alloc(2)
    pool.release(slots)
    try:
        pool.release(slots)
    except AssertionError:
        return
    raise AssertionError("double free went unnoticed")
