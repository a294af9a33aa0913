"""The KV page allocator: which pages of the engine's pool each sequence holds.

    pages = PageAllocator(num_pages=1024, page_size=64)
    got = pages.grow(request_pages, to_tokens=300)   # pages added so 300 tokens fit, or None
    pages.release(request_pages)                     # all back, at the end or on preemption

Pure host-side bookkeeping, in plain Python: the scheduler asks for pages as a prompt's chunks
are admitted and as decode crosses a page boundary, and gives them all back when a request ends,
is cancelled or is preempted. Growth is all-or-nothing (a request never holds half of what a
step needs), so a failed `grow` changes nothing and the scheduler can preempt and retry.
Page 0 upward are the pool's pages; the lowest free ones are handed out first, so a fresh
engine fills its pool from the front (easy to read in a trace, nothing depends on it).

Non-goals: sharing pages between sequences (prefix caching), swapping pages to the host.
"""

from __future__ import annotations

import heapq


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages))  # a min-heap
        self._held: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._held)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def grow(self, pages: list[int], to_tokens: int) -> list[int] | None:
        """Appends to `pages` what `to_tokens` tokens need beyond what it holds; returns the
        new pages, or None (and changes nothing) if the pool has too few free."""
        wanted = self.pages_for(to_tokens) - len(pages)
        if wanted <= 0:
            return []
        if wanted > len(self._free):
            return None
        new = [heapq.heappop(self._free) for _ in range(wanted)]
        self._held.update(new)
        pages.extend(new)
        return new

    def release(self, pages: list[int]) -> None:
        """Returns every page in `pages` to the pool and empties the list."""
        for page in pages:
            if page not in self._held:
                raise ValueError(f"page {page} is not held; freed twice or never allocated")
            self._held.remove(page)
            heapq.heappush(self._free, page)
        pages.clear()
