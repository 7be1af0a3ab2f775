"""The per-pass memory probe (``verl_patches.memory_probe``): which pass a call is, the peak reset
before and read after the outermost call only, one line on rank 0, nothing without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

from verl_patches import memory_probe as probe


class _Device:
    """A stand-in for torch.cuda's peak-memory calls: records resets, reports a peak that grows."""

    def __init__(self):
        self.events, self.peak = [], 0

    def reset_peak_memory_stats(self):
        self.events.append("reset")
        self.peak = 0

    def max_memory_allocated(self):
        return self.peak

    def max_memory_reserved(self):
        return self.peak + 2**30


def _worker(forward_only: bool):
    return SimpleNamespace(engine=SimpleNamespace(engine_config=SimpleNamespace(forward_only=forward_only)))


def test_passes_are_named_by_method_and_engine():
    assert probe.pass_name(_worker(False), "infer_batch") == "log_prob"
    assert probe.pass_name(_worker(True), "infer_batch") == "reference"
    assert probe.pass_name(_worker(False), "train_mini_batch") == "update"


def test_the_outermost_call_resets_and_logs_nested_ones_do_neither():
    device, logged = _Device(), []

    def infer(self, n):
        device.peak += n * 2**30
        return n

    probed_infer = probe._wrap(infer, "infer_batch", device=lambda: device, log=logged.append)

    def train(self):
        device.peak += 10 * 2**30
        probed_infer(self, 3)  # the recipe's current-policy forward inside the update
        return "done"

    probed_train = probe._wrap(train, "train_mini_batch", device=lambda: device, log=logged.append)
    worker = _worker(False)
    assert probed_infer(worker, 5) == 5
    assert probed_train(worker) == "done"
    assert device.events == ["reset", "reset"]
    assert logged == [probe.line("log_prob", 5 * 2**30, 6 * 2**30), probe.line("update", 13 * 2**30, 14 * 2**30)]
    assert logged[0] == "[stapo] memory peak: pass=log_prob allocated_gib=5.00 reserved_gib=6.00"


def test_without_cuda_the_call_passes_through():
    logged = []
    wrapped = probe._wrap(lambda self: "x", "infer_batch", device=lambda: None, log=logged.append)
    assert wrapped(_worker(False)) == "x" and logged == []


def test_an_exception_leaves_the_next_call_outermost():
    device, logged = _Device(), []

    def boom(self):
        raise RuntimeError("oom")

    wrapped = probe._wrap(boom, "infer_batch", device=lambda: device, log=logged.append)
    try:
        wrapped(_worker(False))
    except RuntimeError:
        pass
    ok = probe._wrap(lambda self: 1, "infer_batch", device=lambda: device, log=logged.append)
    assert ok(_worker(True)) == 1 and logged[-1].startswith("[stapo] memory peak: pass=reference")
