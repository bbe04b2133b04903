"""Seeded randomness of the engine: the same numbers on every rank and device (house rule: identical
randomness), independent of the bucket layout and of the user's global RNG.

Every draw is a pure function of ``(random_seed, key, draw)``: ``key`` a parameter's stable key (or a
sketch's column count), ``draw`` what distinguishes draws of one key (the step number without warm start,
:data:`P_DRAW` for P factors, :data:`RESIZE_DRAW` for the columns an adaptive rank adds). Values are drawn
on the CPU from a private generator seeded by SplitMix64 of the triple, then moved by the caller with
:func:`upload` (as are the other small tables the engine builds on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .backend import upload

__all__ = ["P_DRAW", "RESIZE_DRAW", "SKETCH_COLUMNS", "seeded_normal", "seeded_sketch", "upload"]

_MASK64 = (1 << 64) - 1
P_DRAW = 1 << 40  # draw numbers of P factors, disjoint from those of Q
RESIZE_DRAW = 1 << 41  # draw numbers of the columns an adaptive rank adds, disjoint from the first draws
_SKETCH_KEY = 1 << 62  # keys of the global-residual sketches (| m), disjoint from parameter keys

#: Columns k of the global-residual sketch Omega (m x k): see :func:`seeded_sketch`.
SKETCH_COLUMNS = 16


def _mix(*parts: int) -> int:
    """SplitMix64 over the parts: a seed that differs for every (seed, key, draw) triple."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)


def seeded_normal(shape: Sequence[int], seed: int, key: int, draw: int) -> Tensor:
    """Standard normal fp32 values on the CPU, a pure function of ``(seed, key, draw)``.

    Drawn on the CPU so every rank and every device gets the same numbers (house rule: identical randomness), and from a
    private generator so the user's global RNG stream is untouched.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_mix(seed, key, draw))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32)


def seeded_sketch(m: int, seed: int, draw: int) -> Tensor:
    """The ``(m, k)`` fp32 test matrix Omega of the global-residual diagnostic, on the CPU: a pure function
    of ``(seed, m, draw)`` (``draw``: the measurement's compressed step), so identical on every rank and
    device (house rule: identical randomness) and the same for every matrix with ``m`` columns.

    ``m > SKETCH_COLUMNS``: ``k = SKETCH_COLUMNS`` standard normal columns, so ``E ||X Omega||_F^2 = k ||X||_F^2``
    for any ``(n, m)`` matrix X (an unbiased estimate of ``||X||^2`` after dividing by k). ``m <=
    SKETCH_COLUMNS``: the identity (``k = m``), which costs no more to send and measures exactly.
    """
    if m <= SKETCH_COLUMNS:
        return torch.eye(m, dtype=torch.float32)
    return seeded_normal((m, SKETCH_COLUMNS), seed, _SKETCH_KEY | m, draw)
