"""Test-only verl external module: records every actor mini-batch update of a CPU run.

Imported in every verl process through ``VERL_USE_EXTERNAL_MODULES`` (after ``verl_patches.activate``)
when ``STAPO_TEST_RECORD_DIR`` is set. It wraps ``TrainingWorker.train_batch`` (outside the
recipe's wrapper, which folds the token selection into the mini-batch) and writes, per call, one
``mb<k>.pt`` with:

- ``rank``: the data-parallel rank (the records of one mini-batch share their call index ``mb<k>``
  over the ranks' processes),
- ``weights``: the actor's full state dict before the update (the policy the mini-batch's current
  statistics must come from; gathered on every rank, saved by rank 0 only),
- ``input_ids_rows`` / ``attention_mask_rows`` / ``position_ids_rows``: one tensor per sequence (as
  verl holds them: jagged without padding, or padded), ``responses`` / ``advantages`` /
  ``old_log_probs`` / ``entropy`` (rollout time) and the ``response_mask`` before the fold (padded, as verl's loss sees them),
- ``folded``: the ``response_mask`` the engine received (after the recipe's fold),
- ``weights_after``: the actor's full state dict after the update (for the update effect),
- ``infer_calls``: how many times ``TrainingWorker.infer_batch`` ran during the call (the extra
  forward of ``stats_from=current``, the update effect's two forwards), ``infer_responses``: the
  response token ids of every sequence it forwarded (one tuple per sequence, per call),
  ``update_lr_scheduler``: verl's flag on the last mini-batch of a step (so the next call starts a step),
- ``metrics``: the recipe's ``s2t/*`` metrics of the update (on the ranks that return verl's output).

``STAPO_TEST_NO_POSITIVE_AT=<call>:<rank>`` also injects a case: on that call (mini-batch index,
counted from 0 over the run) that rank's advantages become ``-|A|`` before the update, so the rank
holds no positive-advantage sequence there whatever the model sampled. The record holds the
advantages the update used.

Used by tests/e2e/test_current_stats_e2e_on_cpu.py, which recomputes the silenced set from an
independent forward of the recorded weights, and the update effect from the weights before and
after each update.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

RECORD_DIR_ENV = "STAPO_TEST_RECORD_DIR"
NO_POSITIVE_ENV = "STAPO_TEST_NO_POSITIVE_AT"


def no_positive_at(value: str) -> tuple[int, int] | None:
    """``"<call>:<rank>"`` -> (call, rank); None for an empty value. Raises ValueError naming the variable."""
    if not value:
        return None
    try:
        call, rank = (int(part) for part in value.split(":"))
    except ValueError as exc:
        raise ValueError(f"{NO_POSITIVE_ENV}={value!r}: expected <call>:<rank>, two integers") from exc
    return call, rank


def _padded(value) -> torch.Tensor:
    from verl_patches.layout import to_padded

    return to_padded(value).detach().cpu().clone()


def _rows(value) -> list[torch.Tensor]:
    """One tensor per row (a jagged nested tensor's rows, or a padded tensor's rows)."""
    return [row.detach().cpu().clone() for row in value.unbind(0)]


def _full_state_dict(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
            for name, t in module.state_dict().items()}


def install(out_dir: str) -> None:
    from verl.utils import tensordict_utils as tu
    from verl.workers import engine_workers

    worker_cls = engine_workers.TrainingWorker
    if getattr(worker_cls.train_batch, "_recorder", False):
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {"calls": 0, "infer": 0, "responses": []}
    inject = no_positive_at(os.environ.get(NO_POSITIVE_ENV, ""))
    inner_train, inner_infer = worker_cls.train_batch, worker_cls.infer_batch

    @functools.wraps(inner_infer)
    def infer_batch(self, data, *args, **kwargs):
        state["infer"] += 1
        state["responses"].append([tuple(row.tolist()) for row in data["responses"].unbind(0)])
        return inner_infer(self, data, *args, **kwargs)

    @functools.wraps(inner_train)
    def train_batch(self, data, *args, **kwargs):
        engine = self.engine
        if not getattr(engine, "_recorder_wrapped", False):
            engine_train = engine.train_batch

            def engine_train_batch(batch, *a, **k):
                engine._recorder_folded = _padded(batch["response_mask"])
                return engine_train(batch, *a, **k)

            engine.train_batch = engine_train_batch
            engine._recorder_wrapped = True
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if inject == (state["calls"], rank):
            data["advantages"] = -data["advantages"].abs()
        record = {name: _padded(data[name]) for name in
                  ("responses", "advantages", "old_log_probs", "entropy", "response_mask") if name in data}
        record.update({name + "_rows": _rows(data[name]) for name in ("input_ids", "attention_mask", "position_ids")
                       if name in data})
        record["update_lr_scheduler"] = bool(tu.get(data, "update_lr_scheduler", False))
        record["rank"] = rank
        with engine.train_mode():
            weights = _full_state_dict(engine.module)  # collective: every rank gathers
        if record["rank"] == 0:
            record["weights"] = weights
        infer_before, state["responses"] = state["infer"], []
        output = inner_train(self, data, *args, **kwargs)
        with engine.train_mode():
            weights_after = _full_state_dict(engine.module)
        if record["rank"] == 0:
            record["weights_after"] = weights_after
        record["infer_calls"] = state["infer"] - infer_before
        record["infer_responses"] = state["responses"]
        record["folded"] = engine._recorder_folded
        if output is not None:
            record["metrics"] = {k: v for k, v in tu.get(output, "metrics").items() if k.startswith("s2t/")}
        torch.save(record, out / f"pid{os.getpid()}_mb{state['calls']:03d}.pt")
        state["calls"] += 1
        return output

    infer_batch._recorder = True
    train_batch._recorder = True
    worker_cls.infer_batch = infer_batch
    worker_cls.train_batch = train_batch


if os.environ.get(RECORD_DIR_ENV):
    install(os.environ[RECORD_DIR_ENV])
