"""Argument types shared by the ``gradpress`` subcommands.

Each is an ``argparse`` ``type=`` callable that raises ``argparse.ArgumentTypeError`` with a message naming
the allowed values; argparse prefixes the flag (``argument --rank: must be an integer >= 1, got 0``).

>>> int_at_least(1)("3"), float_at_least(0)("2.5"), int_list(1)("1,2,2,4")
(3, 2.5, [1, 2, 4])
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["float_at_least", "int_at_least", "int_list", "positive_float"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """Integers ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def float_at_least(minimum: float) -> Callable[[str], float]:
    """Finite numbers ``>= minimum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"must be a number >= {minimum:g}, got {text!r}")
        return value

    parse.__name__ = f"number >= {minimum:g}"
    return parse


def positive_float(text: str) -> float:
    """Finite numbers ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """Comma-separated integers ``>= minimum`` (``"1,2,4"``), duplicates dropped, order kept."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"must be integers >= {minimum} separated by commas (e.g. {minimum},{minimum + 1}), got {text!r}")
        return list(dict.fromkeys(values))

    parse.__name__ = f"list of integers >= {minimum}"
    return parse
