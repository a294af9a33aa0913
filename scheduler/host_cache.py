"""The prefix cache's second tier: full pages the device's cache evicted, kept in host memory
by their keys, to be copied back instead of computed again (llama-server's --cache-ram, SGLang's
HiCache, vLLM's KV offloading).

    host = HostCache(capacity_bytes=8 << 30)
    host.save(keys, engine.extract(pages, length, 0))   # the pages just evicted, copying out
    found = host.lookup(keys)           # the host pages of the longest run of `keys` from the first
    pool.write_pages(found[0].kind, [p.arrays for p in found], pages)   # ... into fresh pages

A page is saved when the device's cache evicts it (`Pool.move_host_pages`): the extract is
dispatched before anything can write the page again, and its copy to the host runs while the
iteration does; the arrays are taken apart into pages when the host next looks anything up.
Keys are the device cache's (`prefix_cache.PageKeys`: a page's key names its whole prefix,
its model and its adapters), so a key found here holds exactly the KV the prompt would compute.
The tier is bounded in bytes and evicts the page used longest ago; a page brought back stays
here too, so a prefix evicted from the device again costs no second copy out.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from absl import logging


@dataclasses.dataclass(frozen=True)
class HostPage:
    """One page's KV on the host, as its handle's class (`kind`) takes pages apart and joins them."""

    arrays: tuple[Any, ...]
    kind: type
    nbytes: int


class HostCache:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"a host KV cache needs a positive size, got {capacity_bytes} bytes")
        self.capacity = capacity_bytes
        self._pages: collections.OrderedDict[bytes, HostPage] = collections.OrderedDict()  # LRU first
        self._pending: list[tuple[list[bytes], Any]] = []  # (keys, handle) still copying out
        self._pending_keys: set[bytes] = set()
        self.bytes = 0
        self.saved = 0  # pages copied out of the device, since the start
        self.dropped = 0  # pages this tier evicted for room (or lost with a failed copy)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages or key in self._pending_keys

    def __len__(self) -> int:
        return len(self._pages)

    def save(self, keys: Sequence[bytes], handle) -> None:
        """Keeps the pages of `handle` (an engine's `extract` of evicted pages, dispatched) under
        `keys`, in order; the copy to the host starts now and is waited for at the next lookup."""
        handle.to_host_async()
        self._pending.append((list(keys), handle))
        self._pending_keys.update(keys)

    def settle(self) -> None:
        """Takes the pending copies apart into pages. A copy whose program failed (the device
        state was lost after it was dispatched) saves nothing."""
        pending, self._pending = self._pending, []
        self._pending_keys.clear()
        for keys, handle in pending:
            try:
                pages = handle.host_pages()
            except Exception:  # the engine failed; its requests are failed elsewhere
                logging.exception("copying %d evicted KV pages to the host failed", len(keys))
                self.dropped += len(keys)
                continue
            for key, arrays in zip(keys, pages):
                self._put(key, HostPage(arrays, type(handle), sum(a.nbytes for a in arrays)))
            self.saved += len(keys)

    def _put(self, key: bytes, page: HostPage) -> None:
        old = self._pages.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        if page.nbytes > self.capacity:
            self.dropped += 1
            return
        while self.bytes + page.nbytes > self.capacity:
            _, gone = self._pages.popitem(last=False)
            self.bytes -= gone.nbytes
            self.dropped += 1
        self._pages[key] = page
        self.bytes += page.nbytes

    def lookup(self, keys: Sequence[bytes]) -> list[HostPage]:
        """The pages of the longest run of `keys` from the first, each now the most recently used."""
        if self._pending:
            self.settle()
        found = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            self._pages.move_to_end(key)
            found.append(page)
        return found

    def discard(self, keys: Sequence[bytes]) -> int:
        """Forgets the pages of `keys` (those it holds); returns how many it held."""
        if self._pending:
            self.settle()
        gone = [self._pages.pop(key) for key in keys if key in self._pages]
        self.bytes -= sum(page.nbytes for page in gone)
        return len(gone)
