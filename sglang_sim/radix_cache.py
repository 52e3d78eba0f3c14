"""Token-level radix tree over the KV pool: prefix reuse, path locking and LRU eviction of unlocked leaves.

Why this shape: it mirrors SGLang's RadixCache closely enough that `cached_tokens`, eviction under pressure and
"nothing leaks" are real, observable properties rather than counters we trust. Each node holds a run of token ids
(`key`) and the KV slots that hold them (`value`), both int32 numpy arrays, so a 4k-token prompt is a handful of
nodes, not 4k Python objects. Locks are path locks: locking a node pins it and every ancestor, which is what a
running request needs (its prefix must not be evicted under it).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from sglang_sim.kv_pool import KVPool

_EMPTY = np.zeros(0, dtype=np.int32)
_tick = itertools.count(1)


@dataclass(eq=False)
class Node:
    """One edge of the tree: a run of tokens and their slots."""

    key: np.ndarray
    value: np.ndarray
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def touch(self) -> None:
        self.last_access = next(_tick)


@dataclass(frozen=True)
class Match:
    """Result of a prefix lookup: the cached slots and the deepest node they end at (lock it to pin them)."""

    slots: np.ndarray
    node: Node

    @property
    def length(self) -> int:
        return len(self.slots)


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixCache:
    """The tree plus its size counters; slots are owned by the tree once inserted."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.root = Node(key=_EMPTY, value=_EMPTY, parent=None, lock_ref=1)
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # -- lookup and insertion -------------------------------------------------------------------------------------

    def match_prefix(self, tokens: np.ndarray) -> Match:
        """Longest cached prefix of `tokens`; splits a node when the match ends inside it."""
        node = self.root
        node.touch()
        parts: list[np.ndarray] = []
        pos = 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            n = _common_len(child.key, tokens[pos:])
            child.touch()
            if n < len(child.key):
                child = self._split(child, n)
                parts.append(child.value)
                node = child
                break
            parts.append(child.value)
            pos += n
            node = child
        slots = np.concatenate(parts) if parts else _EMPTY
        return Match(slots=slots, node=node)

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        """Insert tokens with their slots; returns how many leading tokens were already cached.

        The caller owns `slots[:returned]` still (they duplicate cached ones) and must release those it allocated;
        `slots[returned:]` now belong to the tree.
        """
        if len(tokens) != len(slots):
            raise ValueError("tokens and slots differ in length")
        node = self.root
        pos = 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                leaf = Node(key=tokens[pos:].copy(), value=slots[pos:].copy(), parent=node)
                leaf.touch()
                node.children[int(tokens[pos])] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            n = _common_len(child.key, tokens[pos:])
            child.touch()
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        return pos

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after n tokens; the new upper node inherits the lock count (every path lock passes it)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = Node(key=child.key[:n].copy(), value=child.value[:n].copy(), parent=parent,
                     lock_ref=child.lock_ref, last_access=child.last_access)
        child.key = child.key[n:].copy()
        child.value = child.value[n:].copy()
        child.parent = upper
        upper.children[int(child.key[0])] = child
        parent.children[int(upper.key[0])] = upper
        return upper

    # -- locking --------------------------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            assert node.parent is not None
            node = node.parent

    # -- eviction -------------------------------------------------------------------------------------------------

    def evict(self, n_tokens: int) -> int:
        """Free at least `n_tokens` slots from unlocked leaves, least recently used first; returns slots freed."""
        if n_tokens <= 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.pool.release(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            del parent.children[int(leaf.key[0])]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evict_all(self) -> int:
        """Drop every unlocked node (flush_cache); locked paths (running requests, sessions) stay."""
        return self.evict(self.evictable_size)

    def _leaves(self) -> list[Node]:
        out: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    # -- books ----------------------------------------------------------------------------------------------------

    def all_slots(self) -> np.ndarray:
        parts = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            parts.append(node.value)
            stack.extend(node.children.values())
        return np.concatenate(parts) if parts else _EMPTY

    def check(self) -> list[str]:
        """Recompute sizes and lock counts from the tree; returns the list of broken invariants (empty when sound)."""
        errors: list[str] = []
        evictable = protected = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if len(node.key) == 0 or len(node.key) != len(node.value):
                errors.append("node with empty key or key/value length mismatch")
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < child_locks:
                errors.append("node lock count below the sum of its children's")
            for first, child in node.children.items():
                if child.parent is not node or int(child.key[0]) != first:
                    errors.append("child indexed under the wrong parent or first token")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            stack.extend(node.children.values())
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            errors.append(f"size counters drifted: counted evictable={evictable} protected={protected}, "
                          f"recorded {self.evictable_size}/{self.protected_size}")
        slots = self.all_slots()
        if len(np.unique(slots)) != len(slots):
            errors.append("a KV slot is held by two tree nodes")
        return errors
