"""S2T on top of another verl policy loss, end to end: STAPO + GSPO with verl's real trainer on CPU.

The suite's shared run ``stapo_gspo_legacy`` (tests/helpers/shared_runs.py: 2 steps, legacy trainer):
the composed pair trains, S2T's mask and metrics are there, and verl's GSPO loss is the one that ran.
GSPO's sequence ratio is taken over every response token (``sequence_ratio=all_tokens``): the
unselected mask the fold keeps travels through verl's micro-batching to the loss (the default
``kept_tokens`` needs nothing beyond the fold; both readings are checked against closed forms in
tests/verl_patches/test_losses_on_cpu.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from recipe.stapo.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gspo_run(shared_runs):
    run = shared_runs.get("stapo_gspo_legacy")
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return run


def test_stapo_on_gspo_trains_with_the_s2t_mask(gspo_run):
    steps = read_metrics(gspo_run.metrics)
    assert set(steps) == {1, 2}
    log = Path(gspo_run.log).read_text(errors="replace")
    assert "'loss_mode': 'gspo'" in log and "'token_selection': 's2t'" in log  # the composed pair ran
    assert "'sequence_ratio': 'all_tokens'" in log
    for step, data in steps.items():
        assert math.isfinite(data["actor/pg_loss"]) and math.isfinite(data["actor/grad_norm"])
        s2t = {k: v for k, v in data.items() if k.startswith("actor/s2t/")}
        assert 0 <= s2t["actor/s2t/silenced"] <= s2t["actor/s2t/candidates"] <= s2t["actor/s2t/tokens"]
        assert s2t["actor/s2t/tokens"] > 0
        assert 0.0 <= s2t["actor/s2t/rollout_agreement"] <= 1.0  # current statistics on mini-batch 2
    assert max(data["actor/grad_norm"] for data in steps.values()) > 0
