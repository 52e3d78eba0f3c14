"""A mapping whose values are made on first lookup: a test process pays only for what its tests read."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


class OnFirstUse(Mapping[str, T]):
    """A read-only mapping over fixed keys whose values are made on their first lookup, then kept: a test process
    pays only for what its tests read."""

    def __init__(self, keys: tuple[str, ...], make: Callable[[str], T]) -> None:
        self._keys = keys
        self._make = make
        self._made: dict[str, T] = {}

    def __getitem__(self, key: str) -> T:
        if key not in self._made:
            if key not in self._keys:
                raise KeyError(key)
            self._made[key] = self._make(key)
        return self._made[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
