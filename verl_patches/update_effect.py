"""What each update does to the tokens S2T singles out: their log-probability just before and just
after the mini-batch's update (``update_effect_responses > 0``).

For every PPO mini-batch with S2T's sets known before the update (applied by STAPO, or monitored
in any other run), up to ``update_effect_responses`` responses of each rank (:func:`choose_rows`)
get one no-grad forward through verl's own inference pass (``TrainingWorker.infer_batch``, the
rollout temperature) before verl's ``train_batch`` and the same forward after it, so
``dlogp = log pi_after(y_t) - log pi_before(y_t)`` is the update's effect alone (same code path,
same batch, one optimizer step apart). Every rank forwards the same number of responses (FSDP
forwards are collective: a rank with fewer repeats its first one and discards it). The sums are
pooled over the step's mini-batches and the data-parallel group into the step's
``s2t/dlogp_{silenced,kept_candidates,all}`` means (docs/metrics.md).

Cost: two forwards of at most ``update_effect_responses`` responses per rank and mini-batch and
nothing else: no gradient, no optimizer state, the peak memory of verl's inference pass on that
many responses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from verl.utils import tensordict_utils as tu

from stapo_core.rules import S2T

from .current_stats import infer
from .mini_batch_view import MiniBatchView, S2TSets

#: worker attribute holding the step's running sums (:class:`StepTotals`)
STATE_ATTR = "_stapo_update_effect"
#: the token sets, in the order of the metric names and of the pooled sums
SETS = ("silenced", "kept_candidates", "all")
METRIC_PREFIX = S2T.metric_prefix + "dlogp_"


def choose_rows(sets: S2TSets, limit: int) -> list[int]:
    """Up to ``limit`` rows (ascending within each group): the rows holding a silenced token, then
    the rows holding only kept candidates."""
    silenced = sets.silenced.any(-1)
    kept = sets.kept_candidates.any(-1) & ~silenced
    first = torch.nonzero(silenced).reshape(-1).tolist()
    second = torch.nonzero(kept).reshape(-1).tolist()
    return (first + second)[: max(limit, 0)]


@dataclass
class Measurement:
    """One mini-batch's measurement between its two forwards.

    rows: this rank's measured rows (the sub-batch's first ``len(rows)`` rows; the rest are
    repeats). masks: set name -> bool ``(len(rows), width)`` on the host. before: float32
    ``(len(rows), width)`` log-probs before the update.
    """

    rows: list
    sub: object
    masks: dict
    before: torch.Tensor
    seconds: float


@dataclass
class StepTotals:
    """Running sums of one worker's current step (dlogp sums in float64)."""

    sums: dict = field(default_factory=lambda: {name: 0.0 for name in SETS})
    counts: dict = field(default_factory=lambda: {name: 0 for name in SETS})
    responses: int = 0
    seconds: float = 0.0

    def add(self, dlogp: torch.Tensor, masks: dict, responses: int, seconds: float) -> None:
        for name in SETS:
            selected = masks[name]
            self.sums[name] += float(dlogp.double()[selected].sum())
            self.counts[name] += int(selected.sum())
        self.responses += responses
        self.seconds += seconds


def _totals(worker) -> StepTotals:
    totals = getattr(worker, STATE_ATTR, None)
    if totals is None:
        totals = StepTotals()
        setattr(worker, STATE_ATTR, totals)
    return totals


def _group_max(value: int, group, device) -> int:
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item())


def response_log_probs(worker, sub) -> torch.Tensor:
    """``(len(sub), width)`` float32 log-probs of the response tokens of ``sub`` (verl's TensorDict)
    under the worker's current policy: one no-grad pass through verl's inference path
    (:func:`verl_patches.current_stats.infer`, no entropy, no loss)."""
    return infer(worker, sub, entropy=False)[0].float()


def measure_before(worker, view: MiniBatchView) -> Optional[Measurement]:
    """Choose this rank's responses among those holding S2T's sets and forward them before the update
    (every rank runs the same number of forwards; None, with no forward, when no rank has a response
    to measure)."""
    start = time.perf_counter()
    sets = view.selection.s2t
    rows = choose_rows(sets, view.cfg.update_effect_responses)
    count = _group_max(len(rows), view.group, view.device)
    if count == 0:
        return None
    padded_rows = rows + [rows[0] if rows else 0] * (count - len(rows))
    sub = tu.index_select_tensor_dict(view.data, padded_rows)
    if "input_ids" in sub and sub["input_ids"].is_nested:  # the per-sequence counts of verl's throughput estimate
        tu.assign_non_tensor(sub, global_token_num=sub["input_ids"].offsets().diff().tolist())
    before = response_log_probs(worker, sub)
    width = min(before.shape[1], sets.mask.shape[1])
    index = torch.tensor(rows, dtype=torch.long)
    masks = {
        "silenced": sets.silenced.cpu()[index, :width],
        "kept_candidates": sets.kept_candidates.cpu()[index, :width],
        "all": sets.mask.cpu()[index, :width],
    }
    return Measurement(rows, sub, masks, before[: len(rows), :width].cpu(), time.perf_counter() - start)


def measure_after(worker, measurement: Optional[Measurement]) -> None:
    if measurement is None:
        return
    start = time.perf_counter()
    after = response_log_probs(worker, measurement.sub)
    n, width = measurement.before.shape
    dlogp = after[:n, :width].cpu() - measurement.before
    _totals(worker).add(dlogp, measurement.masks, len(measurement.rows),
                        measurement.seconds + time.perf_counter() - start)


def step_metrics(worker, *, group=None, device=None) -> dict[str, float]:
    """The step's ``s2t/dlogp_*`` metrics pooled over the data-parallel group; resets the sums.
    Called on every rank at the step's last mini-batch (one all-reduce)."""
    totals = _totals(worker)
    setattr(worker, STATE_ATTR, StepTotals())
    values = [v for name in SETS for v in (totals.sums[name], float(totals.counts[name]))]
    values += [float(totals.responses), totals.seconds, 1.0]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, group=group)
    pooled = t.tolist()
    metrics = {}
    for i, name in enumerate(SETS):
        total, count = pooled[2 * i], pooled[2 * i + 1]
        metrics[METRIC_PREFIX + name + "_tokens"] = count
        if count > 0:
            metrics[METRIC_PREFIX + name] = total / count
    responses, seconds, ranks = pooled[2 * len(SETS):]
    metrics[METRIC_PREFIX + "responses"] = responses
    metrics[METRIC_PREFIX + "seconds"] = seconds / ranks
    return metrics
