"""Argument checks shared by the constructors: each raises ``ValueError`` naming the argument, the value
and the allowed range ("errors speak" in docs/design.md: at construction)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["check_int", "check_number"]


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None, owner: str | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]``, else a ``ValueError`` naming
    ``name`` (prefixed by ``"<owner>: "`` when given)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}{name} must be an integer {bound}, got {value!r}")
    return value


def check_number(name: str, value: Any, ok: Callable[[float], bool], allowed: str) -> float:
    """``float(value)`` if it is an int or float (not a bool) and ``ok(value)`` (the range test, only
    run on a number), else a ``ValueError`` saying ``name`` must be a number ``allowed`` (e.g. ``"> 0"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    return float(value)
