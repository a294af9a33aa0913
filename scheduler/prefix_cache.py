"""Automatic prefix caching: the keys of a sequence's full pages, which page holds which key, the
pages' leading tokens under each parent key (partial matches), and the cached pages nobody
holds, in the order they are evicted.

    keys = PageKeys(page_size=64, namespace=b"model", salt=None)
    keys.upto(tokens, pages=4)          # the keys of its first four full pages
    cache = PrefixCache()
    cache.publish(page, key, keys.parent(i), tokens)  # page i's KV is written in full
    cache.publish_tail(page, parent, tokens)  # a sequence's last page, partly written
    hit = cache.lookup(keys)            # the cached pages of a prompt's leading full pages
    page, n = cache.longest(parent, tokens)   # ... then the page after them agreeing longest
    cache.park(page)                    # its last holder let it go: evictable, still cached
    cache.unpark(page)                  # ... held again (a hit took it)
    page, key = cache.evict()           # the page released longest ago; its prefix forgotten
    cache.drop(page)                    # a parked page out of the cache now (erased on request)

Pages are content-addressed (vLLM v1's design). A full page's key chains its parent page's key
with the page's token ids (`PageKeys`), so equal keys mean equal tokens at equal positions after
an equal prefix, and so equal KV. The whole pages of a prompt are found by their keys; after
them, the prompt's next tokens are looked up among the cached pages under the last hit's key
(the parent), full ones and the partly written last pages of finished sequences alike: the
page whose leading tokens agree with them longest lends its KV for those positions (the
scheduler copies it into a page of the sequence's own, `scheduler.kv_manager`). So a prompt
that repeats an earlier one, or a system prompt shorter than a page, reuses all it shares to
the token, as llama.cpp's slots and SGLang's radix tree do. Under a parent the pages are kept
sorted by their tokens, and the longest agreement with a query is at one of its two neighbours
in that order: a lookup is a binary search.

A page nobody holds keeps its key and its KV, and waits in the eviction queue, least recently
released first and, of one sequence, its tail before its head. The page allocator
(`scheduler.pages`) owns the reference counts and decides when a page is parked, taken back or
evicted; this module only keeps the maps.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
from collections.abc import Sequence

import numpy as np


class PageKeys:
    """The cache keys of one sequence's full pages, computed as its tokens become known.

    key(i) = blake2b-256(key(i - 1) || page i's token ids), and key(-1) is a digest of the
    namespace (what else the KV depends on: the model, its weights, the compute dtype), the
    request's cache salt and its LoRA adapters (`lora`: (bank slot, scale, the slot's version)
    entries, which change every layer's KV). So a page's key names its whole prefix, not only
    its own tokens."""

    def __init__(self, page_size: int, namespace: bytes = b"", salt: str | None = None,
                 lora: tuple[tuple[int, float, int], ...] = ()):
        self.page_size = page_size
        self.namespace, self.salt, self.lora = namespace, salt, lora  # (what the root folds in)
        root = hashlib.blake2b(b"cadence-kv-prefix\0" + namespace, digest_size=32)
        if salt is not None:
            root.update(b"\0salt\0" + salt.encode("utf-8", "surrogatepass"))
        if lora:  # (none: the keys of the base model, as before adapters)
            root.update(b"\0lora\0" + repr(sorted((int(i), float(s), int(v)) for i, s, v in lora)).encode())
        self.root = root.digest()  # the parent of the first page
        self.keys: list[bytes] = []

    def parent(self, page: int) -> bytes:
        """The key page `page` chains from: the root for the first (computed by `upto`)."""
        return self.keys[page - 1] if page else self.root

    def upto(self, tokens: Sequence[int], pages: int) -> list[bytes]:
        """The keys of the first `pages` full pages of `tokens` (which must hold that many)."""
        if pages * self.page_size > len(tokens):
            raise ValueError(f"{len(tokens)} tokens fill {len(tokens) // self.page_size} pages, not {pages}")
        size = self.page_size
        while len(self.keys) < pages:
            i = len(self.keys)
            h = hashlib.blake2b(self.keys[-1] if self.keys else self.root, digest_size=32)
            h.update(np.asarray(tokens[i * size : (i + 1) * size], np.int64).tobytes())
            self.keys.append(h.digest())
        return self.keys[:pages]


class PrefixCache:
    """The published pages (page -> key and key -> page), every cached page's place under its
    parent (for partial matches) and, of the cached pages, the ones nobody holds."""

    def __init__(self):
        self._key: dict[int, bytes] = {}  # page -> key, for published full pages (held or not)
        self._page: dict[bytes, int] = {}  # key -> page, the inverse
        # Cached pages findable by their leading tokens: page -> (parent key, tokens), and per
        # parent its pages as (tokens, page), sorted. Full pages published with their tokens,
        # and partly written last pages (`publish_tail`), which have no key.
        self._under: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self._children: dict[bytes, list[tuple[tuple[int, ...], int]]] = {}
        self._tails = 0  # of those, the partly written pages
        # Cached pages nobody holds, in eviction order: the first is evicted first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0  # pages evicted since the start (their prefix forgotten)

    def __contains__(self, page: int) -> bool:
        """Whether `page` holds a cached prefix (a full page's or a partial one's)."""
        return page in self._key or page in self._under

    @property
    def cached_count(self) -> int:
        """Pages holding a cached prefix, held or not."""
        return len(self._key) + self._tails

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

    def longest(self, parent: bytes, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The cached page under `parent` whose leading tokens agree with `tokens` longest, and
        for how many (at most len(tokens)); (None, 0) if none agrees on the first. Changes
        nothing."""
        children = self._children.get(parent)
        if not children or not tokens:
            return None, 0
        query = tuple(int(t) for t in tokens)
        at = bisect.bisect_left(children, (query,))
        best, agreed = None, 0
        for theirs, page in children[max(0, at - 1) : at + 1]:
            n = _agreement(query, theirs)
            if n > agreed:
                best, agreed = page, n
        return best, agreed

    def publish(self, page: int, key: bytes, parent: bytes | None = None,
                tokens: Sequence[int] | None = None) -> None:
        """`page` (held, its KV written in full, neither it nor `key` published) holds `key`;
        with its `parent` key and `tokens`, it is also found by partial matches (`longest`)."""
        self._key[page] = key
        self._page[key] = page
        if parent is not None and tokens is not None:
            self._place(page, parent, tokens)

    def publish_tail(self, page: int, parent: bytes, tokens: Sequence[int]) -> None:
        """`page` (held by the sequence that wrote it, not cached) holds the KV of `tokens`
        after the prefix `parent` names, in its leading positions: found by partial matches."""
        self._place(page, parent, tokens)
        self._tails += 1

    def _place(self, page: int, parent: bytes, tokens: Sequence[int]) -> None:
        entry = tuple(int(t) for t in tokens)
        self._under[page] = (parent, entry)
        bisect.insort(self._children.setdefault(parent, []), (entry, page))

    def park(self, page: int) -> None:
        """A cached page nobody holds any more: last in the eviction queue."""
        self._evictable[page] = None

    def unpark(self, page: int) -> None:
        """A parked page held again: out of the eviction queue, still cached."""
        del self._evictable[page]

    def evict(self) -> tuple[int, bytes | None]:
        """Takes the page parked longest ago out of the cache; its prefix is forgotten. Returns
        the page and the key it held (None: a partly written page, which has none)."""
        page, _ = self._evictable.popitem(last=False)
        self.evictions += 1
        return page, self._forget(page)

    def drop(self, page: int) -> None:
        """Takes a parked page out of the cache at once (its prefix erased on request)."""
        del self._evictable[page]
        self._forget(page)

    def _forget(self, page: int) -> bytes | None:
        key = self._key.pop(page, None)
        if key is not None:
            del self._page[key]
        elif page in self._under:
            self._tails -= 1
        if page in self._under:
            parent, entry = self._under.pop(page)
            children = self._children[parent]
            children.pop(bisect.bisect_left(children, (entry, page)))
            if not children:
                del self._children[parent]
        return key

    def clear(self) -> list[int]:
        """Forgets every prefix; returns the pages that were parked (nobody holds them)."""
        parked = list(self._evictable)
        self._evictable.clear()
        self._key.clear()
        self._page.clear()
        self._under.clear()
        self._children.clear()
        self._tails = 0
        return parked

    def check(self, free: set[int]) -> set[int]:
        """Raises AssertionError if the maps disagree, or a parked page is uncached or among
        `free` (key-less free pages); returns the parked pages."""
        evictable = set(self._evictable)
        assert not free & evictable, "a page is both free and cached"
        for page in free:
            assert page not in self, f"free page {page} is cached"
        for page in evictable:
            assert page in self, f"evictable page {page} is not cached"
        assert {self._page[k]: k for k in self._page} == self._key, "the key maps disagree"
        placed = {page: (parent, entry) for parent, children in self._children.items()
                  for entry, page in children}
        assert placed == self._under, "the partial-match index disagrees with its pages"
        assert self._tails == sum(1 for page in self._under if page not in self._key), "tails miscounted"
        for children in self._children.values():
            assert children and children == sorted(children), "a parent's pages are not sorted"
        return evictable


def _agreement(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
