"""The prompts `parity.py` serves (and `../q3k-cpu/reference.py` checks against the reference)."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    " ".join(["the quick brown fox jumps over the lazy dog"] * 12),
]
