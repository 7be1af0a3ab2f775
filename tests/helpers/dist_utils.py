"""Test helpers: run a function on N CPU ranks (gloo) and collect results; count host syncs.

The worker function must be importable by name (a module-level function), since
``torch.multiprocessing.spawn`` starts fresh interpreters.
"""

from __future__ import annotations

import os
import traceback
from unittest import mock
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, out_dir: str, fn, payload) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        result = fn(rank, dist.group.WORLD, payload)
    except Exception:  # report the traceback to the parent instead of a bare exit code
        result = {"__error__": traceback.format_exc()}
    finally:
        dist.barrier()
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_on_ranks(fn, payload, world: int, tmp_path) -> list:
    """``[fn(rank, group, payload) for each rank]``, run in ``world`` spawned gloo processes."""
    init_file = str(tmp_path / "dist_init")
    mp.spawn(_worker, args=(world, init_file, str(tmp_path), fn, payload), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "__error__" in result:
            raise AssertionError(f"rank {rank} failed:\n{result['__error__']}")
    return results


class SyncRecorder:
    """Wraps the tensor methods that copy data to the host and records the sizes involved."""

    SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")

    def __init__(self):
        self.calls = []  # (method, numel)
        self.boolean_indexing = 0

    def _wrap(self, name, original):
        def wrapper(tensor, *args, **kwargs):
            self.calls.append((name, tensor.numel()))
            return original(tensor, *args, **kwargs)

        return wrapper

    def _wrap_getitem(self, original):
        def getitem(tensor, index):
            indices = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.boolean_indexing += 1
            return original(tensor, index)

        return getitem

    def __enter__(self):
        self._active = self.patches()
        for p in self._active:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in reversed(self._active):
            p.stop()
        return False

    def patches(self):
        out = [mock.patch.object(torch.Tensor, n, self._wrap(n, getattr(torch.Tensor, n))) for n in self.SYNC_METHODS]
        out.append(mock.patch.object(torch.Tensor, "__getitem__", self._wrap_getitem(torch.Tensor.__getitem__)))
        for fn in ("nonzero", "masked_select", "unique"):
            original = getattr(torch, fn)
            out.append(mock.patch.object(torch, fn, self._wrap("torch." + fn, original)))
        return out
