"""The measured GPU memory of each pass, one line per pass on rank 0 of a calibration run (the probes of
:mod:`stapo_memory.probes`; docs/memory.md, "Calibrating on a GPU", says what each field measures). Each
forward and each update (covering its nested forwards) resets PyTorch's peak before it runs, as verl's
never-reset ``perf/max_memory_*`` do not. Only on CUDA:

    [stapo] memory peak: pass=log_prob allocated_gib=23.41 reserved_gib=25.02 device_gib=31.20 outside_gib=6.18 tokens=48913 micro_batches=12
"""

from __future__ import annotations

import contextlib
import functools
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu

from .terms import GIB

#: what each line starts with (stapo_memory.calibration matches it)
PREFIX = "[stapo] memory peak:"

_state = threading.local()


def _device():
    return torch.cuda if torch.cuda.is_available() else None


def _is_rank_zero() -> bool:
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def pass_name(worker, method: str, data=None) -> str:
    """``update`` for the update; for a forward, ``reference`` on a forward-only engine, else
    ``current`` / ``update_effect`` inside the update (with / without the entropy), else ``log_prob``."""
    if method == "train_mini_batch":
        return "update"
    engine_config = getattr(getattr(worker, "engine", None), "engine_config", None)
    if getattr(engine_config, "forward_only", False):
        return "reference"
    if getattr(_state, "outer", None) == "update":
        if isinstance(data, dict):
            entropy = data.get("calculate_entropy", False)
        else:  # a batch's non-tensor entry, as verl reads it
            entropy = data is not None and tu.get_non_tensor_data(data, "calculate_entropy", False)
        return "current" if entropy else "update_effect"
    return "log_prob"


def micro_batch_tokens(micro_batch) -> int:
    """Tokens of one micro-batch on this GPU: packed (nested) input ids, else the attention mask's sum."""
    ids = micro_batch.get("input_ids", None) if hasattr(micro_batch, "get") else None
    if ids is not None and getattr(ids, "is_nested", False):
        return int(ids.offsets()[-1])
    mask = micro_batch.get("attention_mask", None) if hasattr(micro_batch, "get") else None
    return int(mask.sum()) if mask is not None else 0


def line(name: str, allocated: float, reserved: float, device: float = 0.0, outside: float = 0.0,
         tokens: int = 0, micro_batches: int = 0) -> str:
    return (f"{PREFIX} pass={name} allocated_gib={allocated / GIB:.2f} reserved_gib={reserved / GIB:.2f} "
            f"device_gib={device / GIB:.2f} outside_gib={outside / GIB:.2f} tokens={tokens} "
            f"micro_batches={micro_batches}")


@contextlib.contextmanager
def _counting(engine):
    """The largest micro-batch (tokens on this GPU) and the number of micro-batches of one pass, read
    from the engine's ``forward_step`` while the pass runs."""
    counter = SimpleNamespace(tokens=0, micro_batches=0)
    original = getattr(engine, "forward_step", None)
    if original is None:
        yield counter
        return
    had_own = "forward_step" in vars(engine)

    def counted(micro_batch, *args, **kwargs):
        counter.micro_batches += 1
        counter.tokens = max(counter.tokens, micro_batch_tokens(micro_batch))
        return original(micro_batch, *args, **kwargs)

    engine.forward_step = counted
    try:
        yield counter
    finally:
        if had_own:
            engine.forward_step = original
        else:
            del engine.forward_step


def _wrap(original, method: str, device=_device, log=print):
    @functools.wraps(original)
    def probed(self, *args, **kwargs):
        dev = device()
        if dev is None:
            return original(self, *args, **kwargs)
        outer = getattr(_state, "outer", None)
        if outer is not None and method == "train_mini_batch":
            return original(self, *args, **kwargs)
        name = pass_name(self, method, args[0] if args else kwargs.get("data"))
        before = dev.max_memory_allocated(), dev.max_memory_reserved()
        if outer is None:
            _state.outer, _state.carried = name, (0.0, 0.0)
        else:  # a pass inside the update: the update's peak so far is carried over its own reset
            carried = getattr(_state, "carried", (0.0, 0.0))
            _state.carried = (max(carried[0], before[0]), max(carried[1], before[1]))
        dev.reset_peak_memory_stats()
        try:
            with _counting(getattr(self, "engine", None)) as counter:
                out = original(self, *args, **kwargs)
            allocated, reserved = dev.max_memory_allocated(), dev.max_memory_reserved()
            carried = _state.carried
            if outer is not None:
                _state.carried = (max(carried[0], allocated), max(carried[1], reserved))
            else:
                allocated, reserved = max(allocated, carried[0]), max(reserved, carried[1])
            if _is_rank_zero():
                free, total = dev.mem_get_info()
                log(line(name, allocated, reserved, total - free, total - free - dev.memory_reserved(),
                         counter.tokens, counter.micro_batches))
            return out
        finally:
            if outer is None:
                _state.outer = None
            else:
                dev.reset_peak_memory_stats()

    return probed


wrap_infer_batch = functools.partial(_wrap, method="infer_batch")
wrap_train_mini_batch = functools.partial(_wrap, method="train_mini_batch")


def wrap_update_weights(original, device=_device, log=print):
    """``ActorRolloutRefWorker.update_weights`` (a coroutine) that logs, when it returns, the device-wide
    figure with vLLM awake (its weights and KV cache resumed): ``pass=rollout``."""

    @functools.wraps(original)
    async def probed(self, *args, **kwargs):
        out = await original(self, *args, **kwargs)
        dev = device()
        if dev is not None and _is_rank_zero():
            free, total = dev.mem_get_info()
            log(line("rollout", dev.memory_allocated(), dev.memory_reserved(), total - free,
                     total - free - dev.memory_reserved()))
        return out

    return probed
