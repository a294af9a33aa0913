"""The page allocator's contract: all-or-nothing growth, exact release, no page held twice."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.scheduler.pages import PageAllocator


def test_grow_adds_exactly_the_pages_a_length_needs():
    pages = PageAllocator(num_pages=10, page_size=16)
    seq: list[int] = []
    assert pages.grow(seq, 1) == [0] and seq == [0]
    assert pages.grow(seq, 16) == []  # still one page
    assert pages.grow(seq, 17) == [1]
    assert pages.grow(seq, 64) == [2, 3] and len(seq) == 4 == pages.used_count
    assert pages.free_count == 6


def test_growth_is_all_or_nothing():
    pages = PageAllocator(num_pages=4, page_size=8)
    a, b = [], []
    assert pages.grow(a, 24) == [0, 1, 2]
    assert pages.grow(b, 16) is None and b == [] and pages.free_count == 1
    assert pages.grow(b, 8) == [3]


def test_release_returns_every_page_and_refuses_a_double_free():
    pages = PageAllocator(num_pages=4, page_size=8)
    seq: list[int] = []
    pages.grow(seq, 32)
    held = list(seq)
    pages.release(seq)
    assert seq == [] and pages.free_count == 4 and pages.used_count == 0
    with pytest.raises(ValueError, match="not held"):
        pages.release(held)


def test_random_traffic_never_shares_a_page_and_never_leaks():
    rng = np.random.default_rng(0)
    pages = PageAllocator(num_pages=64, page_size=8)
    seqs: dict[int, tuple[list[int], int]] = {}
    for step in range(5000):
        if seqs and rng.random() < 0.3:
            key = int(rng.choice(list(seqs)))
            pages.release(seqs.pop(key)[0])
        else:
            key = int(rng.integers(0, 20))
            seq, length = seqs.get(key, ([], 0))
            length += int(rng.integers(1, 40))
            if pages.grow(seq, length) is not None:
                seqs[key] = (seq, length)
            elif key not in seqs and seq:
                raise AssertionError("a failed grow left pages behind")
        held = [p for seq, _ in seqs.values() for p in seq]
        assert len(held) == len(set(held)) == pages.used_count
        assert pages.used_count + pages.free_count == 64
        for seq, length in seqs.values():
            assert len(seq) == pages.pages_for(length)
