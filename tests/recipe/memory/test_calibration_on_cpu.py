"""The estimate next to a run's measured peaks (``recipe.stapo.memory.calibration``): the preflight's
table read back from a driver's log, verl's memory metrics from ``metrics.jsonl``."""

from __future__ import annotations

import json

import pytest

from recipe.stapo.memory import calibration as mc
from recipe.stapo.memory import model as mm


def _run(tmp_path, metrics_rows):
    shape = mm.BUILTIN_SHAPES["qwen3-1.7b"]
    gpu = mm.DEFAULT_GPU_MEM_GIB * mm.GIB
    settings = mm.Settings(world_size=1, gpu_memory_utilization=0.5, log_prob_tokens=49152, update_tokens=32768,
                           current_tokens=49152)
    est = mm.estimate(shape, settings, gpu)
    (tmp_path / "train.log").write_text("noise\n[stapo] preflight passed\n[stapo] " + mm.table(est, gpu)
                                        + "\nStep 1 ...\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows))
    return est


def test_the_estimate_is_read_back_from_the_log_and_set_beside_the_measured_peak(tmp_path):
    est = _run(tmp_path, [{"step": 1, "data": {"actor/perf/max_memory_allocated_gb": 30.0,
                                                "actor/perf/max_memory_reserved_gb": 33.0}},
                          {"step": 2, "data": {"actor/perf/max_memory_allocated_gb": 31.5,
                                                "actor/perf/max_memory_reserved_gb": 34.0}}])
    target, rows = mc.estimate_from_log((tmp_path / "train.log").read_text())
    assert target == mm.DEFAULT_GPU_MEM_GIB
    assert rows == {p.name: round(p.total / mm.GIB, 1) for p in est.passes}
    text = mc.compare(tmp_path / "train.log", tmp_path / "metrics.jsonl")
    training = max((p for p in est.passes if p.name != "rollout"), key=lambda p: p.total)
    expected = round(training.total / mm.GIB, 1) - mm.OVERHEAD_BYTES / mm.GIB
    assert "max_memory_allocated_gb (all passes): 31.5 GiB" in text and "max_memory_reserved_gb (all passes): 34.0 GiB" in text
    assert f"({training.name}) less the overhead: {expected:.1f} GiB" in text
    assert f"measured / estimate {31.5 / expected:.2f}" in text


def test_bad_inputs_name_the_file(tmp_path):
    _run(tmp_path, [])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "data": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        mc.compare(tmp_path / "train.log", tmp_path / "metrics.jsonl")
    (tmp_path / "train.log").write_text("[stapo] preflight passed\n")
    with pytest.raises(ValueError, match=r"train.log: no memory table"):
        mc.compare(tmp_path / "train.log", tmp_path / "metrics.jsonl")
    assert mc.main([str(tmp_path / "missing")]) == 1


def test_each_probed_pass_is_set_beside_its_estimate(tmp_path):
    """The workers' per-pass lines (verl_patches.memory_probe, with Ray's prefix) are read back; each
    pass's largest peak over the run is compared with its estimate less the overhead."""
    est = _run(tmp_path, [])
    from verl_patches.memory_probe import line

    gib = mm.GIB
    probe = ["(WorkerDict pid=1) " + line("log_prob", 18.0 * gib, 20.0 * gib),
             "(WorkerDict pid=1) " + line("log_prob", 19.0 * gib, 21.0 * gib),
             "(WorkerDict pid=1) " + line("update", 40.0 * gib, 44.0 * gib)]
    with open(tmp_path / "train.log", "a") as f:
        f.write("\n".join(probe) + "\n")
    assert mc.measured_passes((tmp_path / "train.log").read_text()) == {"log_prob": (19.0, 21.0), "update": (40.0, 44.0)}
    text = mc.compare(tmp_path / "train.log", tmp_path / "metrics.jsonl")
    overhead = mm.OVERHEAD_BYTES / mm.GIB
    for name, allocated, reserved in (("log_prob", 19.0, 21.0), ("update", 40.0, 44.0)):
        (row,) = [r for r in text.splitlines() if r.strip().startswith(name + " ")]
        estimate = round(next(p for p in est.passes if p.name == name).total / mm.GIB, 1)
        assert f"measured {allocated:6.1f} / {reserved:6.1f}" in row, row
        assert row.endswith(f"{reserved / (estimate - overhead):.2f}"), row
    (current,) = [r for r in text.splitlines() if r.strip().startswith("current ")]
    assert current.endswith("not measured")
    (rollout,) = [r for r in text.splitlines() if r.strip().startswith("rollout ")]
    assert "not compared" in rollout
