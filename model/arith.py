"""Integer arithmetic every layer shares. Plain Python that imports nothing, so it serves the
JAX-free modules (`engine.api`, `model.host_sampling`) and works on ints, NumPy arrays and
traced JAX arrays alike (inside jitted code too)."""

from __future__ import annotations


def cdiv(a, b):
    """Ceiling division, `-(-a // b)`: how many blocks of `b` hold `a` (for b > 0)."""
    return -(-a // b)
