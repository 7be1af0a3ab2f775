"""The per-pass memory probes' code (``stapo_memory.peaks``): which pass a call is, the peak reset
before and read after each pass, a forward inside the update logged as its own pass while the update's
line still covers it, the device-wide figure and the memory outside PyTorch's allocator, the largest
micro-batch's tokens, one line on rank 0, nothing without CUDA."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch
from tensordict import TensorDict

from stapo_memory import peaks as probe
from verl.utils import tensordict_utils as tu

GIB = 2**30


class _Device:
    """A stand-in for torch.cuda's memory calls: records resets, reports a peak that grows, a GPU of
    80 GiB whose other processes hold ``outside`` bytes."""

    def __init__(self, outside: float = 3 * GIB):
        self.events, self.peak, self.current, self.outside = [], 0, 0, outside

    def reset_peak_memory_stats(self):
        self.events.append("reset")
        self.peak = self.current

    def allocate(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n

    def max_memory_allocated(self):
        return self.peak

    def max_memory_reserved(self):
        return self.peak + GIB

    def memory_allocated(self):
        return self.current

    def memory_reserved(self):
        return self.current + GIB

    def mem_get_info(self):
        total = 80 * GIB
        return total - (self.current + GIB + self.outside), total


def _worker(forward_only: bool, engine=None):
    engine = engine or SimpleNamespace()
    engine.engine_config = SimpleNamespace(forward_only=forward_only)
    return SimpleNamespace(engine=engine)


def _batch(calculate_entropy=None):
    data = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    if calculate_entropy is not None:
        tu.assign_non_tensor(data, calculate_entropy=calculate_entropy)
    return data


def test_passes_are_named_by_method_engine_and_nesting():
    assert probe.pass_name(_worker(False), "infer_batch") == "log_prob"
    assert probe.pass_name(_worker(True), "infer_batch") == "reference"
    assert probe.pass_name(_worker(False), "train_mini_batch") == "update"


def test_a_forward_inside_the_update_is_its_own_pass_and_the_update_covers_it():
    device, logged = _Device(), []

    def infer(self, data, n):
        device.allocate(n * GIB)
        device.free(n * GIB)
        return n

    probed_infer = probe._wrap(infer, "infer_batch", device=lambda: device, log=logged.append)

    def train(self, data):
        device.allocate(10 * GIB)
        device.free(4 * GIB)  # the update's first peak (10) is behind it
        probed_infer(self, _batch(calculate_entropy=True), 3)  # the recipe's current-policy forward: 6 + 3
        probed_infer(self, _batch(calculate_entropy=False), 1)  # the update effect's forward
        device.allocate(2 * GIB)  # the rest of the update: 8
        device.free(8 * GIB)
        return "done"

    probed_train = probe._wrap(train, "train_mini_batch", device=lambda: device, log=logged.append)
    worker = _worker(False)
    assert probed_infer(worker, _batch(), 5) == 5
    assert probed_train(worker, _batch()) == "done"
    names = [x.split("pass=")[1].split()[0] for x in logged]
    assert names == ["log_prob", "current", "update_effect", "update"]
    peaks = [float(x.split("allocated_gib=")[1].split()[0]) for x in logged]
    # each nested pass's own peak (what was resident, 6 GiB, plus its forward), the update's the largest of all
    assert peaks == [5.0, 9.0, 7.0, 10.0]
    # device-wide: this process's reserved (current + 1) and the other processes' 3 GiB; outside = 3 GiB
    assert "device_gib=4.00 outside_gib=3.00" in logged[0]


def test_the_largest_micro_batch_is_counted_through_the_engine():
    device, logged = _Device(), []

    class Engine:
        def forward_step(self, micro_batch, loss_function=None, forward_only=True):
            return micro_batch

    engine = Engine()
    lengths = ([3, 5], [4, 4, 4], [2])

    def infer(self, data):
        for sizes in lengths:
            ids = torch.nested.nested_tensor([torch.zeros(n, dtype=torch.long) for n in sizes], layout=torch.jagged)
            self.engine.forward_step(TensorDict({"input_ids": ids}, batch_size=[len(sizes)]))
        return "out"

    wrapped = probe._wrap(infer, "infer_batch", device=lambda: device, log=logged.append)
    assert wrapped(_worker(False, engine), _batch()) == "out"
    assert logged[0].endswith("tokens=12 micro_batches=3")
    assert "forward_step" not in vars(engine)  # the engine's own method again


def test_the_rollout_line_comes_after_the_weight_sync():
    device, logged = _Device(outside=50 * GIB), []

    async def update_weights(self, global_steps=None):
        device.allocate(2 * GIB)
        return {"synced": True}

    wrapped = probe.wrap_update_weights(update_weights, device=lambda: device, log=logged.append)
    assert asyncio.run(wrapped(_worker(False), global_steps=3)) == {"synced": True}
    (entry,) = logged
    assert entry.startswith("[stapo] memory peak: pass=rollout allocated_gib=2.00 reserved_gib=3.00")
    assert "outside_gib=50.00" in entry


def test_without_cuda_the_call_passes_through():
    logged = []
    wrapped = probe._wrap(lambda self, data: "x", "infer_batch", device=lambda: None, log=logged.append)
    assert wrapped(_worker(False), _batch()) == "x" and logged == []
    synced = probe.wrap_update_weights(_async_value, device=lambda: None, log=logged.append)
    assert asyncio.run(synced(_worker(False))) == "y" and logged == []


async def _async_value(self):
    return "y"


def test_an_exception_leaves_the_next_call_outermost():
    device, logged = _Device(), []

    def boom(self, data):
        raise RuntimeError("oom")

    wrapped = probe._wrap(boom, "train_mini_batch", device=lambda: device, log=logged.append)
    try:
        wrapped(_worker(False), _batch())
    except RuntimeError:
        pass
    ok = probe._wrap(lambda self, data: 1, "infer_batch", device=lambda: device, log=logged.append)
    assert ok(_worker(False), _batch(calculate_entropy=True)) == 1
    assert logged[-1].startswith("[stapo] memory peak: pass=log_prob")
