"""Plain-text tables for the CLI: columns padded to their widest cell."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Lines of a table with a header and a dashed rule; ``align`` has one ``<`` or ``>`` per column.

    >>> print("\\n".join(format_table(["name", "n"], [["a", "1"], ["bb", "10"]], "<>")))
    name   n
    ----  --
    a      1
    bb    10
    """
    if len(align) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError(f"format_table: every row and align need {len(headers)} columns")
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths)).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows]
