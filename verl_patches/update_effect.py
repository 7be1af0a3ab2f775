"""The probe of an update: chosen responses of a mini-batch forwarded just before and just after it.

``dlogp = log pi_after(y_t) - log pi_before(y_t)``, from verl's own inference pass
(``TrainingWorker.infer_batch``, the rollout temperature) on the same rows one optimizer step apart, is
what the update did to each token and nothing else. One :class:`Probe` per mini-batch serves both
readers: the update effect (``update_effect_responses > 0``: the responses holding S2T's silenced, or
would-be-silenced, tokens and kept candidates, pooled into the step's ``s2t/dlogp_*`` metrics,
docs/metrics.md) and the token dump (the per-token ``dlogp`` of its sampled responses). Its cost: two
no-grad forwards of the probed responses, the peak memory of verl's inference pass on that many.
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


@dataclass
class Probe:
    """Rows of one rank's mini-batch forwarded before and after its update.

    rows: this rank's probed rows (the sub-batch's first ``len(rows)``; the rest repeat a row, so that
    every rank runs the same forwards: FSDP forwards are collective). sub: the sub-batch (verl's
    TensorDict). before: float32 ``(len(rows), width)`` response log-probs before the update, on the
    host. dlogp: float32 ``(len(rows), width)``, after minus before (None until :func:`probe_after`).
    seconds: this rank's wall time of both forwards.
    """

    rows: list
    sub: object
    before: torch.Tensor
    seconds: float
    dlogp: Optional[torch.Tensor] = None


def _group_max(value: int, group, device) -> int:
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item())


def probe_before(worker, view: MiniBatchView, rows: list) -> Optional[Probe]:
    """Forward ``rows`` of the mini-batch before its update, on every rank alike (one all-reduce of the
    row counts first).

    Args:
        worker: the ``TrainingWorker``. view: the mini-batch. rows: this rank's rows to probe.

    Returns:
        The :class:`Probe`, or None, with no forward, when no rank has a row to probe.
    """
    start = time.perf_counter()
    count = _group_max(len(rows), view.group, view.device)
    if count == 0:
        return None
    sub = tu.index_select_tensor_dict(view.data, rows + [rows[0] if rows else 0] * (count - len(rows)))
    if "input_ids" in sub and sub["input_ids"].is_nested:  # the per-sequence counts of verl's throughput estimate
        tu.assign_non_tensor(sub, global_token_num=sub["input_ids"].offsets().diff().tolist())
    before = infer(worker, sub, entropy=False)[0].float()
    return Probe(rows, sub, before[: len(rows)].cpu(), time.perf_counter() - start)


def probe_after(worker, probe: Optional[Probe]) -> None:
    """Forward the probed rows again after the update and set ``probe.dlogp``."""
    if probe is None:
        return
    start = time.perf_counter()
    after = infer(worker, probe.sub, entropy=False)[0].float()
    probe.dlogp = after[: len(probe.rows)].cpu() - probe.before
    probe.seconds += time.perf_counter() - start


def choose_rows(sets: S2TSets, limit: int) -> list[int]:
    """Up to ``limit`` rows (ascending within each group): the rows holding a silenced token, then
    the rows holding only kept candidates."""
    silenced = sets.silenced.any(-1)
    kept = sets.kept_candidates.any(-1) & ~silenced
    first = torch.nonzero(silenced).reshape(-1).tolist()
    second = torch.nonzero(kept).reshape(-1).tolist()
    return (first + second)[: max(limit, 0)]


@dataclass
class StepTotals:
    """Running sums of one worker's current step (dlogp sums in float64)."""

    sums: dict = field(default_factory=lambda: {name: 0.0 for name in SETS})
    counts: dict = field(default_factory=lambda: {name: 0 for name in SETS})
    responses: int = 0
    seconds: float = 0.0


def add_update_effect(worker, probe: Optional[Probe], rows: list, sets: S2TSets) -> None:
    """Add the probe's change of ``rows`` (the probe's first rows, :func:`choose_rows` of ``sets``), per
    token set of ``sets``, to the worker's step sums (:func:`step_metrics`); nothing without a probe."""
    if probe is None:
        return
    totals = getattr(worker, STATE_ATTR, None)
    if totals is None:
        totals = StepTotals()
        setattr(worker, STATE_ATTR, totals)
    width = min(probe.dlogp.shape[1], sets.mask.shape[1])
    dlogp = probe.dlogp[: len(rows), :width].double()
    index = torch.tensor(rows, dtype=torch.long)
    for name, tokens in zip(SETS, (sets.silenced, sets.kept_candidates, sets.mask)):
        selected = tokens.cpu()[index, :width]
        totals.sums[name] += float(dlogp[selected].sum())
        totals.counts[name] += int(selected.sum())
    totals.responses += len(rows)
    totals.seconds += probe.seconds


def step_metrics(worker, *, group=None, device=None) -> dict[str, float]:
    """The step's ``s2t/dlogp_*`` metrics pooled over the data-parallel group; resets the sums.
    Called on every rank at the step's last mini-batch (one all-reduce)."""
    totals = getattr(worker, STATE_ATTR, None) or StepTotals()
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
