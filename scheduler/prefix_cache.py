"""Automatic prefix caching: the keys of a sequence's full pages, which page holds which key, and
the cached pages nobody holds, in the order they are evicted.

    keys = PageKeys(page_size=64, namespace=b"model", salt=None).upto(tokens, pages=4)
    cache = PrefixCache()
    cache.publish(page, key)            # a full page's KV is written: reusable under its key
    hit = cache.lookup(keys)            # the cached pages of a prompt's leading full pages
    cache.park(page)                    # its last holder let it go: evictable, still cached
    cache.unpark(page)                  # ... held again (a hit took it)
    page = cache.evict()                # the page released longest ago; its prefix forgotten

Pages are content-addressed (vLLM v1's design). A full page's key chains its parent page's key
with the page's token ids (`PageKeys`), so equal keys mean equal tokens at equal positions after
an equal prefix, and so equal KV. A page nobody holds keeps its key and its KV, and waits in the
eviction queue, least recently released first and, of one sequence, its tail before its head.
The page allocator (`scheduler.pages`) owns the reference counts and decides when a page is
parked, taken back or evicted; this module only keeps the maps.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


class PageKeys:
    """The cache keys of one sequence's full pages, computed as its tokens become known.

    key(i) = blake2b-256(key(i - 1) || page i's token ids), and key(-1) is a digest of the
    namespace (what else the KV depends on: the model, its weights, the compute dtype) and the
    request's cache salt. So a page's key names its whole prefix, not only its own tokens."""

    def __init__(self, page_size: int, namespace: bytes = b"", salt: str | None = None):
        self.page_size = page_size
        root = hashlib.blake2b(b"cadence-kv-prefix\0" + namespace, digest_size=32)
        if salt is not None:
            root.update(b"\0salt\0" + salt.encode("utf-8", "surrogatepass"))
        self._root = root.digest()
        self.keys: list[bytes] = []

    def upto(self, tokens: Sequence[int], pages: int) -> list[bytes]:
        """The keys of the first `pages` full pages of `tokens` (which must hold that many)."""
        if pages * self.page_size > len(tokens):
            raise ValueError(f"{len(tokens)} tokens fill {len(tokens) // self.page_size} pages, not {pages}")
        size = self.page_size
        while len(self.keys) < pages:
            i = len(self.keys)
            h = hashlib.blake2b(self.keys[-1] if self.keys else self._root, digest_size=32)
            h.update(np.asarray(tokens[i * size : (i + 1) * size], np.int64).tobytes())
            self.keys.append(h.digest())
        return self.keys[:pages]


class PrefixCache:
    """The published pages (page -> key and key -> page) and, of those, the ones nobody holds."""

    def __init__(self):
        self._key: dict[int, bytes] = {}  # page -> key, for published pages (held or not)
        self._page: dict[bytes, int] = {}  # key -> page, the inverse
        # Published pages nobody holds, in eviction order: the first is evicted first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0  # pages evicted since the start (their prefix forgotten)

    def __contains__(self, page: int) -> bool:
        """Whether `page` holds a published prefix."""
        return page in self._key

    @property
    def cached_count(self) -> int:
        """Pages holding a published prefix, held or not."""
        return len(self._key)

    @property
    def evictable_count(self) -> int:
        return len(self._evictable)

    def has_key(self, key: bytes) -> bool:
        return key in self._page

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the first. Changes nothing."""
        hit = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            hit.append(page)
        return hit

    def publish(self, page: int, key: bytes) -> None:
        """`page` (held, its KV written in full, neither it nor `key` published) holds `key`."""
        self._key[page] = key
        self._page[key] = page

    def park(self, page: int) -> None:
        """A published page nobody holds any more: last in the eviction queue."""
        self._evictable[page] = None

    def unpark(self, page: int) -> None:
        """A parked page held again: out of the eviction queue, still published."""
        del self._evictable[page]

    def evict(self) -> int:
        """Takes the page parked longest ago out of the cache; its prefix is forgotten."""
        page, _ = self._evictable.popitem(last=False)
        del self._page[self._key.pop(page)]
        self.evictions += 1
        return page

    def clear(self) -> list[int]:
        """Forgets every prefix; returns the pages that were parked (nobody holds them)."""
        parked = list(self._evictable)
        self._evictable.clear()
        self._key.clear()
        self._page.clear()
        return parked

    def check(self, free: set[int]) -> set[int]:
        """Raises AssertionError if the maps disagree, or a parked page is unpublished or among
        `free` (key-less free pages); returns the parked pages."""
        evictable = set(self._evictable)
        assert not free & evictable, "a page is both free and cached"
        for page in free:
            assert page not in self._key, f"free page {page} has a key"
        for page in evictable:
            assert page in self._key, f"evictable page {page} has no key"
        assert {self._page[k]: k for k in self._page} == self._key, "the key maps disagree"
        return evictable
