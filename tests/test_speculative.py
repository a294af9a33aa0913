"""Speculative decoding: the n-gram drafts against a brute-force search, and acceptance."""

from __future__ import annotations

import random

import pytest

from cadence.scheduler.speculative import Acceptance, NgramDrafts


def brute_force(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix (min_n..max_n
    tokens) of `seq`."""
    end = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n >= end:
            continue
        suffix = seq[end - n:]
        for start in range(end - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                return seq[start + n: min(start + n + k, end)]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_ngram_drafts_equal_a_brute_force_search(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        drafts = NgramDrafts(min_n, max_n, max_candidates=10**6)
        drafts.extend(seq[: len(seq) // 2])
        drafts.extend(seq[len(seq) // 2:])  # in two parts, as a prompt then its output
        k = rng.randrange(1, 6)
        assert drafts.propose(k) == brute_force(seq, min_n, max_n, k), (seq, k)


def test_truncate_forgets_as_if_never_seen():
    rng = random.Random(7)
    for _ in range(100):
        seq = [rng.randrange(4) for _ in range(30)]
        cut = rng.randrange(0, 30)
        drafts = NgramDrafts(2, 4)
        drafts.extend(seq)
        drafts.truncate(cut)
        fresh = NgramDrafts(2, 4)
        fresh.extend(seq[:cut])
        assert drafts.tokens == fresh.tokens and drafts._where == fresh._where


def test_quoted_text_is_drafted_whole():
    document = list(range(100, 160))
    drafts = NgramDrafts(2, 4)
    drafts.extend(document + [1, 2, 3] + document[10:13])  # the answer starts quoting
    assert drafts.propose(5) == document[13:18]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafts(3, 2)
    with pytest.raises(ValueError):
        NgramDrafts(0, 2)


def test_acceptance_pauses_a_request_whose_drafts_fail_then_retries():
    a = Acceptance()
    a.observe(4, 4)
    assert a.wants()
    for _ in range(3):
        a.observe(4, 0)
    assert a.rate < Acceptance.LOW
    sat_out = 0
    while not a.wants():
        sat_out += 1
    assert sat_out == Acceptance.PAUSE
    assert (a.proposed, a.accepted) == (16, 4)
