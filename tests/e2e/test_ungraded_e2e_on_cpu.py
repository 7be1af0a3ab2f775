"""verl's real trainers on CPU with a reward that leaves every other response ungraded
(tests/helpers/ungraded_reward.py): each step's ``reward/ungraded`` equals the number of that step's
responses the reward marked ungraded, read back from the step's rollout dump (they alone score
``UNGRADED_SCORE``), on verl's default TransferQueue trainer and on the legacy trainer. The runs are
the suite's shared ``entropy20_v1`` and ``justrl_legacy`` (tests/helpers/shared_runs.py), which train
with that reward.

The TransferQueue run is 20-Entropy on two data-parallel ranks with ``ranks_per_pool=1``, so it also
shows the selection pool made by the actor's init inside verl's workers: each rank's top 20% is taken
over its own tokens (``actor/entropy_topk/tokens`` is half a mini-batch's response tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe.stapo.metrics import read_metrics
from tests.helpers.shared_runs import RANKS, RESPONSES_PER_STEP
from tests.helpers.ungraded_reward import UNGRADED_SCORE

pytestmark = pytest.mark.slow

STEPS = 2


@pytest.fixture(scope="module")
def v1_run(shared_runs):
    run = shared_runs.get("entropy20_v1")
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return run


@pytest.fixture(scope="module")
def legacy_run(shared_runs):
    run = shared_runs.get("justrl_legacy")
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return run


def _dumped(run_dir: Path) -> dict[int, list[dict]]:
    """Each step's dumped responses."""
    out = {}
    for path in sorted((run_dir / "rollouts").glob("*.jsonl")):
        out[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def _check_counts(run) -> list[int]:
    steps, dumped = read_metrics(run.metrics), _dumped(run.run_dir)
    assert set(steps) == set(dumped) == set(range(1, STEPS + 1)), (sorted(steps), sorted(dumped))
    counts = []
    for step, rows in dumped.items():
        assert len(rows) == RESPONSES_PER_STEP
        expected = sum(row["score"] == UNGRADED_SCORE for row in rows)
        assert steps[step]["reward/ungraded"] == expected, (step, steps[step].get("reward/ungraded"), expected)
        counts.append(expected)
    assert 0 < sum(counts) < STEPS * RESPONSES_PER_STEP, counts  # the reward marked some responses, not all
    return counts


def test_the_transferqueue_trainer_logs_each_steps_ungraded_count(v1_run):
    print(f"[ungraded] v1 counts per step: {_check_counts(v1_run)}")


def test_the_legacy_trainer_logs_each_steps_ungraded_count(legacy_run):
    counts = _check_counts(legacy_run)
    for step, rows in _dumped(legacy_run.run_dir).items():  # the legacy dump carries the extra info itself
        assert sum(bool(row["ungraded"]) for row in rows) == counts[step - 1]
    print(f"[ungraded] legacy counts per step: {counts}")


def test_the_selection_pools_per_rank_with_ranks_per_pool_1(v1_run):
    log = Path(v1_run.log).read_text()
    assert "[stapo] token selection pools over 2 group(s) of 1 data-parallel rank(s)" in log, v1_run.tail()
    for step, data in read_metrics(v1_run.metrics).items():
        # the step's response tokens, over its 2 mini-batches x 2 ranks: each rank's pool is its own part
        total = data["response_length/mean"] * RESPONSES_PER_STEP
        assert data["actor/entropy_topk/tokens"] == pytest.approx(total / (2 * RANKS)), (step, data)
