"""Test-only verl external module: records every actor mini-batch update of a CPU run.

Imported in every verl process through ``VERL_USE_EXTERNAL_MODULES`` (after ``verl_patches``)
when ``STAPO_TEST_RECORD_DIR`` is set. It wraps ``TrainingWorker.train_batch`` (outside the
recipe's wrapper, which folds the token selection into the mini-batch) and writes, per call, one
``mb<k>.pt`` with:

- ``weights``: the actor's full state dict before the update (the policy the mini-batch's current
  statistics must come from),
- ``input_ids_rows`` / ``attention_mask_rows`` / ``position_ids_rows``: one tensor per sequence (as
  verl holds them: jagged without padding, or padded), ``responses`` / ``advantages`` /
  ``old_log_probs`` / ``entropy`` (rollout time) and the ``response_mask`` before the fold (padded, as verl's loss sees them),
- ``folded``: the ``response_mask`` the engine received (after the recipe's fold),
- ``weights_after``: the actor's full state dict after the update (for the update effect),
- ``infer_calls``: how many times ``TrainingWorker.infer_batch`` ran during the call (the extra
  forward of ``stats_from=current``, the update effect's two forwards), ``update_lr_scheduler``:
  verl's flag on the last mini-batch of a step (so the next call starts a step).

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


def _padded(value) -> torch.Tensor:
    from verl_patches.token_selection import to_padded

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
    state = {"calls": 0, "infer": 0}
    inner_train, inner_infer = worker_cls.train_batch, worker_cls.infer_batch

    @functools.wraps(inner_infer)
    def infer_batch(self, data, *args, **kwargs):
        state["infer"] += 1
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
        record = {name: _padded(data[name]) for name in
                  ("responses", "advantages", "old_log_probs", "entropy", "response_mask") if name in data}
        record.update({name + "_rows": _rows(data[name]) for name in ("input_ids", "attention_mask", "position_ids")
                       if name in data})
        record["update_lr_scheduler"] = bool(tu.get(data, "update_lr_scheduler", False))
        with engine.train_mode():
            record["weights"] = _full_state_dict(engine.module)
        infer_before = state["infer"]
        output = inner_train(self, data, *args, **kwargs)
        with engine.train_mode():
            record["weights_after"] = _full_state_dict(engine.module)
        record["infer_calls"] = state["infer"] - infer_before
        record["folded"] = engine._recorder_folded
        torch.save(record, out / f"pid{os.getpid()}_mb{state['calls']:03d}.pt")
        state["calls"] += 1
        return output

    infer_batch._recorder = True
    train_batch._recorder = True
    worker_cls.infer_batch = infer_batch
    worker_cls.train_batch = train_batch


if os.environ.get(RECORD_DIR_ENV):
    install(os.environ[RECORD_DIR_ENV])
