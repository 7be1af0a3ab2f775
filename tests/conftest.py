"""Fixtures shared by the CPU end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The tiny CPU assets, built once per test session (every trainer test of the session reuses them)."""
    from recipe.stapo.cpu.assets import build_assets

    return build_assets(tmp_path_factory.getbasetemp() / "stapo_cpu_assets").root
