"""What the benchmarks share: their markdown tables, a number that may be NaN, and the rotated order
of a round (each round starts one place later, so drift and position effects cancel)."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Callable, Iterable, Sequence

from recipe.stapo.eval import tables


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """The project's Markdown table (:func:`recipe.stapo.eval.tables.markdown_table`), ending in a newline."""
    return tables.markdown_table(header, rows) + "\n"


def number(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, ``n/a`` for NaN."""
    return "n/a" if math.isnan(value) else f"{value:.{decimals}f}"


def median(values: Sequence[float]) -> float:
    """The median of ``values``, NaN for none."""
    return statistics.median(values) if values else math.nan


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse ``type``: ``kind`` of the text, refused unless > 0 (argparse names the option)."""

    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def rotated(items: Sequence, k: int) -> list:
    """``items`` starting at position ``k`` (modulo their count): the order of round ``k``."""
    k %= len(items)
    return [*items[k:], *items[:k]]
