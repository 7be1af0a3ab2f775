"""Small argument checks shared by stapo_core and the layers above it."""

from __future__ import annotations

import math


def is_number(x) -> bool:
    """A finite int or float (not a bool): what every numeric setting of the recipe must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
