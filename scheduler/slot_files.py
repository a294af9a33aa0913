"""llama-server's slot files, over the prefix cache: the KV of what a slot last held, saved to a
file and restored into the cache later, in this process or another (its `POST
/slots/{id}?action=save|restore|erase` with `--slot-save-path`).

    saved = SlotFile.take(pool, slot, namespace)   # on the loop: the cached whole pages of the
    saved.write(path)                              # sequence that let `slot` go last; anywhere
    saved = SlotFile.read(path)                    # anywhere
    tokens = saved.restore(pool, namespace)        # on the loop: into free pages, cached
    tokens = forget(pool, slot)                    # on the loop: its pages out of the caches

A slot's sequence is the one that let it go last (`Pool.last_sequences`: the tokens whose KV
it wrote, and its page keys); its whole pages are saved. Saving takes each of those pages from the device's cache or the host
tier, in order, as far as they go (a page neither holds any more ends the run). Restoring writes
them into free pages of the pool and publishes them under their keys, so the next prompt that
starts with those tokens (and the same `cache_salt`) finds them, in whatever slot it runs; the
pages the cache holds already are skipped, and what the free pages cannot hold is left out.
Restoring is what makes a file's KV servable, so it is refused unless the file was written for
this model (the namespace the keys fold in), this page size and this KV layout. A sequence
that ran with LoRA adapters is not saved: its keys name adapters by their place in this
process's bank.

The functions marked "on the loop" touch the pool and the engine: call them through
`Scheduler.call_in_loop`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from cadence.scheduler.kv_manager import Pool
from cadence.scheduler.pages import NULL_PAGE, PageKeys

FORMAT = "cadence-slot-1"


@dataclasses.dataclass
class SlotFile:
    namespace: str  # the model, weights and compute dtype the KV belongs to
    salt: str | None  # the requests' cache_salt
    page_size: int
    tokens: list[int]  # whole pages' worth
    pages: list[tuple[np.ndarray, ...]]  # each page's arrays, as the engine's handles give them

    @classmethod
    def take(cls, pool: Pool, slot: int, namespace: str) -> SlotFile:
        """What `slot` last held, as far as the caches still hold it (on the loop)."""
        tokens, keys = pool.last_sequences.get(slot, ([], None))
        if keys is not None and keys.lora:
            raise ValueError(f"slot {slot}'s last sequence ran with LoRA adapters, whose KV is not saved")
        size = pool.page_size  # (its whole pages: a partly written one is not saved)
        wanted = keys.upto(tokens, len(tokens) // size) if keys is not None else []
        device = pool.pages.lookup(wanted)
        pages = pool.engine.extract(device, len(device) * size, 0).host_pages() if device else []
        if pool.host is not None and len(device) < len(wanted):
            pages += [p.arrays for p in pool.host.lookup(wanted[len(device) :])]
        return cls(namespace, keys.salt if keys is not None else None, size, tokens[: len(pages) * size], pages)

    def write(self, path: Path) -> int:
        """Writes the file (a NumPy archive: the arrays, and the rest as JSON); returns its bytes."""
        first = self.pages[0] if self.pages else ()
        meta = {"format": FORMAT, "namespace": self.namespace, "salt": self.salt, "page_size": self.page_size,
                "tokens": self.tokens, "dtypes": [str(a.dtype) for a in first]}
        # Stored as unsigned integers of the same width: NumPy's files know no bfloat16 or float8.
        arrays = {f"a{i}": np.stack([page[i] for page in self.pages]).view(f"u{a.dtype.itemsize}")
                  for i, a in enumerate(first)}
        # A file of its own beside the target, renamed over it: a reader never sees half a file,
        # and two saves to one name never write into each other's.
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
            size = f.tell()
        try:
            os.replace(f.name, path)
        except OSError:
            os.unlink(f.name)
            raise
        return size

    @classmethod
    def read(cls, path: Path) -> SlotFile:
        """The file at `path`; ValueError if it is not one of these."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                meta = json.loads(archive["meta"].tobytes())
                if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                    raise ValueError(f"not a slot file of this version ({FORMAT})")
                arrays = [archive[f"a{i}"].view(_dtype(name)) for i, name in enumerate(meta["dtypes"])]
            tokens, size, namespace, salt = meta["tokens"], meta["page_size"], meta["namespace"], meta["salt"]
            if not (isinstance(size, int) and size > 0 and isinstance(namespace, str)
                    and (salt is None or isinstance(salt, str)) and isinstance(tokens, list)
                    and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens)):
                raise ValueError("its description is malformed")
            count = len(tokens) // size
            if len(tokens) % size or any(len(a) != count for a in arrays) or (count and not arrays):
                raise ValueError("its tokens and pages disagree")
        except (OSError, EOFError, zipfile.BadZipFile, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path.name} is not a slot file: {e}") from None
        return cls(namespace, salt, size, tokens, [tuple(a[i] for a in arrays) for i in range(count)])

    def restore(self, pool: Pool, namespace: str) -> int:
        """Writes the pages into free pages of `pool` and publishes them (on the loop); returns
        how many of the file's tokens the cache holds now, from the first."""
        if self.namespace != namespace:
            raise ValueError(f"the file holds the KV of {self.namespace!r}; this server's is {namespace!r}")
        cfg = pool.engine.config
        if self.page_size != pool.page_size or len(self.tokens) > cfg.max_seq_len:
            raise ValueError(f"the file holds {len(self.tokens)} tokens in pages of {self.page_size}; this "
                             f"server holds up to {cfg.max_seq_len} in pages of {pool.page_size}")
        if not self.pages:
            return 0
        # This engine's layout, and its kind of handle: a page of it, the null one.
        probe = pool.engine.extract([NULL_PAGE], min(pool.page_size, cfg.max_seq_len), 0)
        layout = probe.host_pages()[0]
        if [(a.shape, a.dtype) for a in layout] != [(a.shape, a.dtype) for a in self.pages[0]]:
            raise ValueError(f"the file's pages are {[(a.shape, str(a.dtype)) for a in self.pages[0]]}; this "
                             f"engine's are {[(a.shape, str(a.dtype)) for a in layout]}")
        size = self.page_size
        keys = PageKeys(size, namespace.encode(), self.salt)
        wanted = keys.upto(self.tokens, len(self.pages))
        kept: list[int] = []  # the leading pages cached already, held while the growth evicts
        pool.pages.share(kept, pool.pages.lookup(wanted))
        first, held = len(kept), []
        count = min(len(self.pages) - first, pool.pages.free_count)
        try:
            if count > 0:
                pool.pages.grow(held, count * size)
                pool.move_host_pages()  # what that evicted goes to the host before it is written
                pool.write_pages(type(probe), self.pages[first : first + count], held)
                for i, page in enumerate(held, start=first):
                    pool.pages.publish(page, wanted[i], keys.parent(i), self.tokens[i * size : (i + 1) * size])
        finally:  # (an engine call that raised: the pages go back unpublished, the pool recovers)
            pool.pages.release(held)  # cached, nobody's, tail first: as a finished request leaves them
            pool.pages.release(kept)
        return (first + count) * size


def _dtype(name: str) -> np.dtype:
    """A dtype by name, NumPy's own or ml_dtypes' (bfloat16, the float8s)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def forget(pool: Pool, slot: int) -> int:
    """Erases what `slot` last held (on the loop): its pages, whole and the partly written last
    one, leave the device's cache where nobody holds them, and the host tier; returns how many
    tokens it held."""
    tokens, keys = pool.last_sequences.pop(slot, ([], None))
    if keys is None:
        return 0
    full = len(tokens) // pool.page_size
    wanted = keys.upto(tokens, full)
    last, agreed = pool.pages.longest(keys.parent(full), tokens[full * pool.page_size :])
    for page in pool.pages.lookup(wanted) + ([last] if agreed and agreed == len(tokens) % pool.page_size else []):
        pool.pages.drop(page)
    if pool.host is not None:
        pool.host.discard(wanted)
    return len(tokens)
