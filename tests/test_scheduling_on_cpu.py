"""The suite's xdist schedule (tests/helpers/scheduling.py): units sent longest first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import scheduling

REPO = Path(__file__).resolve().parents[1]


def test_units_are_listed_longest_first_whole_and_the_rest_in_collection_order():
    nodeids = ["tests/a_on_cpu.py::t1", "tests/b_on_cpu.py::t1", "tests/e2e/test_trainer_e2e_on_cpu.py::t[x]",
               "tests/a_on_cpu.py::t2", "tests/c_on_cpu.py::t1", "tests/b_on_cpu.py::t2",
               "tests/e2e/test_reproducible_e2e_on_cpu.py::t"]
    order = [nodeids[i] for i in scheduling.longest_first(nodeids, {"tests/c_on_cpu.py": 50.0, "shared_runs": 900.0})]
    assert order == ["tests/e2e/test_trainer_e2e_on_cpu.py::t[x]", "tests/e2e/test_reproducible_e2e_on_cpu.py::t",
                     "tests/c_on_cpu.py::t1",
                     "tests/a_on_cpu.py::t1", "tests/a_on_cpu.py::t2", "tests/b_on_cpu.py::t1", "tests/b_on_cpu.py::t2"]


def test_the_table_sums_setup_call_and_teardown_per_unit_from_pytests_durations():
    log = ["============ slowest durations ============",
           "300.00s setup    tests/e2e/test_reproducible_e2e_on_cpu.py::test_a",
           "100.50s call     tests/e2e/test_trainer_e2e_on_cpu.py::test_b[grpo_v1]",
           " 15.00s call     tests/x_on_cpu.py::test_c",
           "  6.00s teardown tests/x_on_cpu.py::test_c",
           "  3.00s call     tests/y_on_cpu.py::test_d",
           "=== 3 passed in 500.00s ==="]
    assert scheduling.unit_seconds_from_durations(log) == {"shared_runs": 400.5, "tests/x_on_cpu.py": 21.0}


def test_every_unit_of_the_shipped_table_still_exists():
    table = scheduling.load_unit_seconds()
    assert table, "tests/helpers/unit_seconds.json is missing"
    stale = [unit for unit in table if unit != "shared_runs" and not (REPO / unit).is_file()]
    assert not stale, (f"units no longer in the suite: {stale}; regenerate the table: "
                       "bash run_scripts/test.sh --durations=0 | tee suite.log; python -m tests.helpers.scheduling suite.log")
    assert list(table.values()) == sorted(table.values(), reverse=True)


def test_regenerating_writes_the_table_and_a_log_without_durations_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "unit_seconds.json"
    monkeypatch.setattr(scheduling, "UNIT_SECONDS_FILE", out)
    log = tmp_path / "suite.log"
    log.write_text("== 1 passed in 1.0s ==\n")
    assert scheduling.main([str(log)]) == 1 and not out.exists()
    assert "no --durations lines" in capsys.readouterr().err
    log.write_text("40.0s call tests/z_on_cpu.py::t\n")
    assert scheduling.main([str(log)]) == 0
    assert scheduling.load_unit_seconds(out) == {"tests/z_on_cpu.py": 40.0}


def test_the_documented_regeneration_command_runs_as_written(tmp_path):
    """``python -m tests.helpers.scheduling suite.log`` (docs/testing.md), on a log whose durations are
    the shipped table's: it rewrites the table byte for byte."""

    shipped = scheduling.UNIT_SECONDS_FILE.read_bytes()
    table = scheduling.load_unit_seconds()
    nodeid = {"shared_runs": "tests/e2e/test_trainer_e2e_on_cpu.py"}
    (tmp_path / "suite.log").write_text("".join(f"{s:.2f}s call     {nodeid.get(u, u)}::t\n" for u, s in table.items()))
    try:
        done = subprocess.run([sys.executable, "-m", "tests.helpers.scheduling", "suite.log"], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"{len(table)} units" in done.stdout
        assert scheduling.UNIT_SECONDS_FILE.read_bytes() == shipped
    finally:
        scheduling.UNIT_SECONDS_FILE.write_bytes(shipped)
