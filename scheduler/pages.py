"""The KV page allocator: which pages of the engine's pool each sequence holds, and which pages
hold a prefix that another sequence may reuse (automatic prefix caching).

    pages = PageAllocator(num_pages=1024, page_size=64, caching=True)
    got = pages.grow(seq_pages, to_tokens=300)   # pages added so 300 tokens fit, or None
    hit = pages.lookup(keys)                     # cached pages of a prompt's leading full pages
    pages.share(seq_pages, hit)                  # ... now held by this sequence too
    page, n = pages.longest(parent, tokens)      # the cached page after them agreeing longest
    pages.publish(page, key, parent, tokens)     # a full page's KV is written: reusable
    pages.publish_tail(page, parent, tokens)     # a finished sequence's last, partial page
    pages.release(seq_pages)                     # all back, at the end or on preemption
    pages.drop(page)                             # a cached page nobody holds, freed now
    pages.take_evicted()                         # full pages evicted since, with their keys
                                                 # (with `keep_evicted`: a host tier saves them)

Pure host-side bookkeeping, in plain Python. The scheduler asks for pages as a prompt's chunks
are admitted and as decode crosses a page boundary, and gives them all back when a request ends,
is cancelled or is preempted. Growth is all-or-nothing (a request never holds half of what a
step needs), so a failed `grow` changes nothing and the scheduler can preempt and retry.

With `caching`, pages are content-addressed (`scheduler.prefix_cache`: the keys, the key-page
maps and the eviction queue). Every page has a reference count: the sequences holding it. A
published page whose count falls to 0 keeps its key and its KV, and waits in the eviction queue.
An allocation takes a page that holds no key first, and evicts only when there is none. A page
is only ever written by the one sequence that allocated it, before it is full or (a partial
page, `publish_tail`) before it is cached: a shared page is full, a page lent for a partial
match is only read (copied), and a cached page's KV is never written again until it is evicted
and allocated afresh.

Page 0 is the null page (vLLM's null_block): it is never handed to a sequence, so nothing but
padding ever points at it. Free slots' rows of the page table, and every entry past a sequence's
last page, point there; a program may read it (the reads are masked), never write it. So a pool
of N pages serves N - 1 (`usable`); `num_pages` counts them all. Page 1 upward are the pages
sequences hold; the lowest key-less free ones are handed out first, so a fresh engine fills its
pool from the front (easy to read in a trace, nothing depends on it).

Saving evicted pages to host memory is the caller's (`scheduler.host_cache`): this module
only lists them. Non-goal: sharing a partial page in place (it is copied).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Sequence

from cadence.model.arith import cdiv
from cadence.scheduler.prefix_cache import PageKeys, PrefixCache

__all__ = ["NULL_PAGE", "PageAllocator", "PageKeys"]

NULL_PAGE = 0  # where free and padding page-table entries point; never held by a sequence


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, caching: bool = False, keep_evicted: bool = False):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token beside the null page, "
                             f"got {num_pages} x {page_size}")
        self.num_pages = num_pages  # the null page included
        self.page_size = page_size
        self.caching = caching
        # Key-less pages nobody holds, a min-heap: every page but the null page, at first.
        self._free = list(range(NULL_PAGE + 1, num_pages))
        self._refs = [0] * num_pages  # sequences holding each page
        self.cache = PrefixCache()  # published pages, and those of them nobody holds
        # With `keep_evicted`: (page, key) of each full page evicted since `take_evicted`.
        self._evicted: list[tuple[int, bytes]] | None = [] if keep_evicted else None

    @property
    def free_count(self) -> int:
        """Pages an allocation can take: key-less free ones and cached ones nobody holds."""
        return len(self._free) + self.cache.evictable_count

    @property
    def usable(self) -> int:
        """Pages sequences may hold: all but the null page."""
        return self.num_pages - 1

    @property
    def used_count(self) -> int:
        """Pages some sequence holds."""
        return self.usable - self.free_count

    @property
    def cached_count(self) -> int:
        """Pages holding a published prefix, held or not."""
        return self.cache.cached_count

    @property
    def evictions(self) -> int:
        """Cached pages evicted (their prefix forgotten) to make room, since the start."""
        return self.cache.evictions

    def pages_for(self, tokens: int) -> int:
        return cdiv(tokens, self.page_size)

    def grow(self, pages: list[int], to_tokens: int) -> list[int] | None:
        """Appends to `pages` what `to_tokens` tokens need beyond what it holds; returns the
        new pages, or None (and changes nothing) if the pool has too few free."""
        wanted = self.pages_for(to_tokens) - len(pages)
        if wanted <= 0:
            return []
        if wanted > self.free_count:
            return None
        new = [self._take_free() for _ in range(wanted)]
        pages.extend(new)
        return new

    def _take_free(self) -> int:
        if self._free:
            page = heapq.heappop(self._free)
        else:  # evict the page released longest ago; its prefix is forgotten
            page, key = self.cache.evict()
            if key is not None and self._evicted is not None:
                self._evicted.append((page, key))
        self._refs[page] = 1
        return page

    def release(self, pages: list[int]) -> None:
        """Gives back one hold on every page in `pages` and empties the list. A page nobody
        holds any more is free; a published one stays cached until it is evicted, the
        sequence's tail queued for eviction before its head."""
        for page, count in collections.Counter(pages).items():
            if not 0 <= page < self.num_pages or self._refs[page] < count:
                raise ValueError(f"page {page} is not held; freed twice or never allocated")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self.cache:
                self.cache.park(page)
            else:
                heapq.heappush(self._free, page)
        pages.clear()

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the first: a prompt's prefix hit.
        Changes nothing; `share` takes them."""
        return self.cache.lookup(keys)

    def evictable_among(self, pages: Sequence[int]) -> int:
        """How many of `pages` nobody holds: sharing them takes as many from `free_count`."""
        return sum(1 for page in pages if not self._refs[page])

    def releasable(self, pages: Sequence[int]) -> int:
        """How many pages releasing `pages` would add to `free_count`: those it holds alone."""
        return sum(1 for page, count in collections.Counter(pages).items() if self._refs[page] == count)

    def share(self, pages: list[int], hit: Sequence[int], cached: bool = True) -> None:
        """Appends the cached pages `hit` (a `lookup`'s answer, in this same state) to `pages`,
        holding each once more. Not `cached`: pages another sequence holds, whose KV it will
        not write again (the full prompt pages of a group's first sequence, `n` > 1)."""
        for page in hit:
            if cached and page not in self.cache:
                raise ValueError(f"page {page} holds no published prefix")
            if not cached and not (0 <= page < self.num_pages and self._refs[page]):
                raise ValueError(f"page {page} is not held; only held pages are shared uncached")
        for page in hit:
            if not self._refs[page]:
                self.cache.unpark(page)
            self._refs[page] += 1
        pages.extend(hit)

    def longest(self, parent: bytes, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The cached page under `parent` whose leading tokens agree longest with `tokens`, and
        for how many (`PrefixCache.longest`). Changes nothing; `share` takes it."""
        return self.cache.longest(parent, tokens)

    def publish(self, page: int, key: bytes, parent: bytes | None = None,
                tokens: Sequence[int] | None = None) -> bool:
        """Makes a held page's KV (now written in full) reusable under `key` (and, given its
        `parent` key and `tokens`, by partial matches). False if caching is off, the page is
        published already, or another page holds that key already (two sequences computed the
        same prefix at once: the first stays the cached one)."""
        if not self.caching or page in self.cache or self.cache.has_key(key):
            return False
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is not held; only its writer may publish it")
        self.cache.publish(page, key, parent, tokens)
        return True

    def publish_tail(self, page: int, parent: bytes, tokens: Sequence[int]) -> bool:
        """Makes the KV of a page's leading positions, written for `tokens` after the prefix
        `parent` names, reusable by partial matches: a sequence's last page, partly written,
        published by its writer as it lets it go (and never written after). False if caching
        is off, the page is cached already, or a cached page under `parent` already begins
        with `tokens` (it serves every match this one would)."""
        if not self.caching or not tokens or page in self.cache:
            return False
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is not held; only its writer may publish it")
        if self.cache.longest(parent, tokens)[1] == len(tokens):
            return False
        self.cache.publish_tail(page, parent, tokens)
        return True

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """The full pages evicted since the last call, (page, key) in order, each now another
        sequence's: their KV is as cached until a program dispatched after this writes them."""
        if self._evicted is None:  # (not kept)
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def drop(self, page: int) -> bool:
        """Takes a cached page nobody holds out of the cache and frees it; False (nothing
        changed) if someone holds it or it holds no prefix."""
        if page not in self.cache or self._refs[page]:
            return False
        self.cache.drop(page)
        heapq.heappush(self._free, page)
        return True

    def clear_cache(self) -> None:
        """Forgets every cached prefix (the engine's KV was rebuilt): the pages nobody holds are
        free again, and held ones are freed, not cached, when released."""
        self.take_evicted()  # (their KV is gone)
        for page in self.cache.clear():
            heapq.heappush(self._free, page)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def published(self, page: int) -> bool:
        return page in self.cache

    def check(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (for tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        evictable = self.cache.check(free)
        assert not self._refs[NULL_PAGE] and NULL_PAGE not in free and NULL_PAGE not in evictable, \
            "the null page was handed out"
        for page in range(NULL_PAGE + 1, self.num_pages):
            held = self._refs[page] > 0
            assert held + (page in free) + (page in evictable) == 1, f"page {page} is in two states or none"
