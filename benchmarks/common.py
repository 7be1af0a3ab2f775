"""What the benchmarks share: their markdown tables, a number that may be NaN, and the rotated order
of a round (each round starts one place later, so drift and position effects cancel)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table: the header, its ``|---|`` line, then one line per row; every line ends in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def number(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, ``n/a`` for NaN."""
    return "n/a" if math.isnan(value) else f"{value:.{decimals}f}"


def rotated(items: Sequence, k: int) -> list:
    """``items`` starting at position ``k`` (modulo their count): the order of round ``k``."""
    k %= len(items)
    return [*items[k:], *items[:k]]
