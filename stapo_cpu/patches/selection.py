"""Whether this process selected the CPU path."""

from __future__ import annotations

import os

PLATFORM_ENV = "VERL_PLATFORM"


def cpu_selected() -> bool:
    """True when this process selected the CPU path (``VERL_PLATFORM=cpu``)."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"
