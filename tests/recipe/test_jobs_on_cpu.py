"""Submission ids of LAUNCH=submit (recipe.stapo.jobs): the run's id, relaunches numbered after it,
no second job while one of the run is pending or running. The refusal on a real Ray cluster:
tests/e2e/test_two_node_on_cpu.py."""

from __future__ import annotations

import pytest

from recipe.stapo.driver import wandb_run_id
from recipe.stapo.jobs import JobRunning, launch_number, next_submission_id

BASE = wandb_run_id("stapo", "qwen3_8b_stapo")


def test_the_first_job_of_a_run_carries_the_runs_wandb_id():
    # (that `next-id` starts from the run's wandb id: tests/run_scripts/test_launch_on_cpu.py's submit dry run)
    assert next_submission_id([], BASE) == BASE
    assert next_submission_id([("raysubmit_abc", "RUNNING"), (BASE + "x", "RUNNING")], BASE) == BASE


@pytest.mark.parametrize("jobs, expected", [
    ([(BASE, "FAILED")], BASE + "-2"),
    ([(BASE, "SUCCEEDED"), (BASE + "-2", "STOPPED")], BASE + "-3"),
    ([(BASE, "FAILED"), (BASE + "-7", "FAILED"), (BASE + "-3", "SUCCEEDED")], BASE + "-8"),
    ([(BASE + "-2", "JobStatus.FAILED")], BASE + "-3"),
])
def test_a_relaunch_gets_the_next_number(jobs, expected):
    assert next_submission_id(jobs, BASE) == expected


@pytest.mark.parametrize("status", ["PENDING", "RUNNING", "JobStatus.RUNNING"])
def test_a_run_with_a_pending_or_running_job_is_refused(status):
    with pytest.raises(JobRunning) as info:
        next_submission_id([(BASE, "FAILED"), (BASE + "-2", status)], BASE)
    assert info.value.submission_id == BASE + "-2" and info.value.status == status.split(".")[-1]


def test_only_this_runs_ids_count():
    other = wandb_run_id("stapo", "qwen3_8b_stapo_2")
    assert launch_number(other, BASE) is None and launch_number(BASE + "-1", BASE) is None
    assert launch_number(BASE + "-12", BASE) == 12 and launch_number(BASE, BASE) == 1
    assert next_submission_id([(other, "RUNNING")], BASE) == BASE
