"""Fixtures shared by the CPU end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The tiny CPU assets, built once per test session (every trainer test of the session reuses them);
    ``STAPO_CPU_ASSETS_DIR`` names a folder to build them in once and reuse across sessions (its
    manifest is checked against the assets' configuration)."""
    import os

    from recipe.stapo.cpu.assets import build_assets

    return build_assets(os.environ.get("STAPO_CPU_ASSETS_DIR") or tmp_path_factory.getbasetemp() / "stapo_cpu_assets").root


@pytest.fixture(scope="session")
def shared_runs(assets, tmp_path_factory):
    """The suite's shared trainer runs (tests/helpers/shared_runs.py): each made once per session."""
    from tests.helpers.shared_runs import SharedRuns

    return SharedRuns(assets, tmp_path_factory.getbasetemp() / "shared_runs")
