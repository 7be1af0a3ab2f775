"""The measured GPU memory peak of each training-side pass, logged next to nothing else: one line per
pass on data-parallel rank 0, which ``python -m recipe.stapo.memory.calibration`` reads back from the
driver's log and sets beside the memory model's estimate (docs/memory.md, "Calibrating on a GPU").

verl's own ``perf/max_memory_*`` metrics are PyTorch's allocator peaks since the process started
(never reset), so they give one number for all passes. Here ``TrainingWorker.infer_batch`` (the
actor's log-prob pass; a forward-only engine: the reference pass) and
``TrainingWorker.train_mini_batch`` (the update, with the recipe's current-policy and update-effect
forwards inside it) reset the peak before they run and log it after:

    [stapo] memory peak: pass=log_prob allocated_gib=23.41 reserved_gib=25.02

A call nested in another (the recipe's forwards inside the update) neither resets nor logs, so the
update's line covers the whole update. Only on CUDA; a reset and a print per pass, nothing else.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

#: what each line starts with (recipe.stapo.memory.calibration matches it)
PREFIX = "[stapo] memory peak:"

_depth = threading.local()


def _device():
    return torch.cuda if torch.cuda.is_available() else None


def _is_rank_zero() -> bool:
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def pass_name(worker, method: str) -> str:
    """``update`` for the update; for a forward, ``reference`` on a forward-only engine, else ``log_prob``."""
    if method == "train_mini_batch":
        return "update"
    engine_config = getattr(getattr(worker, "engine", None), "engine_config", None)
    return "reference" if getattr(engine_config, "forward_only", False) else "log_prob"


def line(name: str, allocated: float, reserved: float) -> str:
    gib = 1024**3
    return f"{PREFIX} pass={name} allocated_gib={allocated / gib:.2f} reserved_gib={reserved / gib:.2f}"


def _wrap(original, method: str, device=_device, log=print):
    @functools.wraps(original)
    def probed(self, *args, **kwargs):
        dev = device()
        outer = getattr(_depth, "value", 0) == 0
        if dev is None or not outer:
            return original(self, *args, **kwargs)
        _depth.value = 1
        try:
            dev.reset_peak_memory_stats()
            out = original(self, *args, **kwargs)
            if _is_rank_zero():
                log(line(pass_name(self, method), dev.max_memory_allocated(), dev.max_memory_reserved()))
            return out
        finally:
            _depth.value = 0

    return probed


def wrap_infer_batch(original):
    return _wrap(original, "infer_batch")


def wrap_train_mini_batch(original):
    return _wrap(original, "train_mini_batch")
