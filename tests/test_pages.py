"""The page allocator's contract: all-or-nothing growth, exact release, no page held twice.

Every pool here has one page more than the test uses: page 0, the null page, is never handed out."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.scheduler.pages import PageAllocator


def test_grow_adds_exactly_the_pages_a_length_needs():
    pages = PageAllocator(num_pages=11, page_size=16)
    seq: list[int] = []
    assert pages.grow(seq, 1) == [1] and seq == [1]
    assert pages.grow(seq, 16) == []  # still one page
    assert pages.grow(seq, 17) == [2]
    assert pages.grow(seq, 64) == [3, 4] and len(seq) == 4 == pages.used_count
    assert pages.free_count == 6


def test_growth_is_all_or_nothing():
    pages = PageAllocator(num_pages=5, page_size=8)
    a, b = [], []
    assert pages.grow(a, 24) == [1, 2, 3]
    assert pages.grow(b, 16) is None and b == [] and pages.free_count == 1
    assert pages.grow(b, 8) == [4]


def test_release_returns_every_page_and_refuses_a_double_free():
    pages = PageAllocator(num_pages=5, page_size=8)
    seq: list[int] = []
    pages.grow(seq, 32)
    held = list(seq)
    pages.release(seq)
    assert seq == [] and pages.free_count == 4 and pages.used_count == 0
    with pytest.raises(ValueError, match="not held"):
        pages.release(held)


def test_random_traffic_never_shares_a_page_and_never_leaks():
    rng = np.random.default_rng(0)
    pages = PageAllocator(num_pages=65, page_size=8)
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


def test_the_null_page_is_never_handed_out():
    pages = PageAllocator(num_pages=3, page_size=4)
    a: list[int] = []
    assert pages.grow(a, 8) == [1, 2] and pages.grow([], 1) is None
    assert pages.usable == 2 == pages.used_count and pages.num_pages == 3
    with pytest.raises(ValueError, match="not held"):
        pages.release([0])
    pages.release(a)
    pages.check()
    with pytest.raises(ValueError, match="beside the null page"):
        PageAllocator(num_pages=1, page_size=4)
