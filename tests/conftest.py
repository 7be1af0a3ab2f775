"""Fixtures shared by the CPU end-to-end tests, and how the suite is spread over pytest-xdist workers.

``bash run_scripts/test.sh`` runs the suite on 2 pytest-xdist workers with ``--dist loadgroup``:
every test module is one unit of work (a module's fixtures, trainer runs included, are made once),
and the modules that read the shared trainer runs of tests/helpers/shared_runs.py form one unit
(each run is made once in the session). Without xdist (``-n 0``, or plain ``pytest``) nothing changes.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

def pytest_collection_modifyitems(config, items):
    """Each test without an ``xdist_group`` mark joins its module's group (a module goes to one worker)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def session_folder(tmp_path_factory, name: str) -> Path:
    """A folder shared by every worker of this test session (xdist workers each have a base temp
    of their own, inside the session's)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The tiny CPU assets, built once per test session (every trainer test of the session, on every
    worker, reuses them); ``STAPO_CPU_ASSETS_DIR`` names a folder to build them in once and reuse
    across sessions (its manifest is checked against the assets' configuration)."""
    from recipe.stapo.cpu.assets import build_assets

    folder = Path(os.environ.get("STAPO_CPU_ASSETS_DIR") or session_folder(tmp_path_factory, "stapo_cpu_assets"))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:  # one worker builds, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_assets(folder).root


@pytest.fixture(scope="session")
def shared_runs(assets, tmp_path_factory):
    """The suite's shared trainer runs (tests/helpers/shared_runs.py): each made once per session."""
    from tests.helpers.shared_runs import SharedRuns

    return SharedRuns(assets, tmp_path_factory.getbasetemp() / "shared_runs")
