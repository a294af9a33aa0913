"""What the server keeps in memory for its clients between requests (stored responses,
conversations), bounded in count and in size:

    kept = Bounded(capacity=1024, chars=64 * 2**20)
    kept.add(key, value, size)     # the most recently used now; past a bound, the least go
    kept.get(key)                  # the value (now the most recently used), or None
    kept.peek(key)                 # the same, leaving the order as it is
    kept.grow(key, by)             # its size changed by `by` (characters); the most recently used
    kept.pop(key)                  # forgets it: the value, or None

Sizes are what the caller counts (characters of JSON, here). The most recently used entry is
never evicted, even past a bound alone: what a client was just given stays readable.
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class Bounded(Generic[T]):
    def __init__(self, capacity: int, chars: int):
        self.capacity, self.chars = capacity, chars
        self._entries: collections.OrderedDict[str, list] = collections.OrderedDict()  # key -> [value, size]
        self.size = 0  # every entry's size, together

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: str, value: T, size: int) -> None:
        self.pop(key)
        self._entries[key] = [value, 0]
        self.grow(key, size)

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def peek(self, key: str) -> T | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def grow(self, key: str, by: int) -> None:
        """`key`'s size is `by` more (or less), and it is the most recently used; one already
        gone counts no more."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry[1] += by
        self.size += by
        self._entries.move_to_end(key)
        while len(self._entries) > 1 and (len(self._entries) > self.capacity or self.size > self.chars):
            self.pop(next(iter(self._entries)))

    def pop(self, key: str) -> T | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.size -= entry[1]
        return entry[0]
