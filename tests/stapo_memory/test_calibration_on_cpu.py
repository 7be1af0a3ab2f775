"""The estimate next to a run's measurements, term by term (``stapo_memory.calibration``): the
preflight's table read back from a driver's log, the memory probe's recorded lines (as the GPU run's
workers print them, with Ray's prefix), verl's memory metrics from ``metrics.jsonl``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from stapo_memory import calibration as mc
from stapo_memory import model as mm
from stapo_memory.peaks import line
from stapo_memory.shape import BUILTIN_SHAPES
from stapo_memory.terms import GIB, OVERHEAD_BYTES
from tests.helpers.paths import REPO


def _estimate() -> tuple[mm.Estimate, float]:
    shape = BUILTIN_SHAPES["qwen3-1.7b"]
    gpu = mm.DEFAULT_GPU_MEM_GIB * GIB
    settings = mm.Settings(world_size=1, gpu_memory_utilization=0.5, log_prob_tokens=49152, update_tokens=32768,
                           current_tokens=49152, longest=16384)
    return mm.estimate(shape, settings, gpu), gpu


def _run(tmp_path, probe_lines=(), metrics_rows=()) -> mm.Estimate:
    est, gpu = _estimate()
    text = "noise\n[stapo] preflight passed\n[stapo] " + mm.table(est, gpu) + "\nStep 1 ...\n"
    text += "".join(f"(WorkerDict pid=1) {x}\n" for x in probe_lines)
    (tmp_path / "train.log").write_text(text)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows))
    return est


def _row(text: str, name: str) -> str:
    (row,) = [r for r in text.splitlines() if r.strip().startswith(name + " ")]
    return row


def _pass(est: mm.Estimate, name: str) -> mm.Pass:
    return next(p for p in est.passes if p.name == name)


def test_the_estimate_is_read_back_with_tokens_and_bytes_per_token(tmp_path):
    est = _run(tmp_path)
    target, rows = mc.estimate_from_log((tmp_path / "train.log").read_text())
    assert target == mm.DEFAULT_GPU_MEM_GIB
    assert {n: r.gib for n, r in rows.items()} == {p.name: round(p.total / GIB, 1) for p in est.passes}
    update = _pass(est, "update")
    assert rows["update"].tokens == 32768 and rows["update"].kib_per_token == round(update.bytes_per_token / 1024)
    assert rows["rollout"].tokens is None and rows["rollout"].vllm == round(0.5 * mm.DEFAULT_GPU_MEM_GIB, 1)


def test_each_term_is_set_beside_its_measurement(tmp_path):
    """Recorded lines: the update at two micro-batch sizes 25% apart (a slope), a log-prob pass, a
    current-policy forward inside the update, the rollout after a weight sync."""
    _run(tmp_path, [
        line("log_prob", 20.0 * GIB, 21.5 * GIB, 25.0 * GIB, 3.5 * GIB, 49000, 4),
        line("update", 17.0 * GIB, 18.0 * GIB, 22.0 * GIB, 4.0 * GIB, 24000, 10),
        line("current", 19.0 * GIB, 20.0 * GIB, 24.0 * GIB, 4.0 * GIB, 48000, 3),
        line("update", 19.0 * GIB, 20.0 * GIB, 24.0 * GIB, 4.0 * GIB, 32000, 8),
        line("rollout", 1.0 * GIB, 1.2 * GIB, 43.0 * GIB, 41.8 * GIB),
    ])
    text = mc.compare(tmp_path / "train.log")
    overhead = OVERHEAD_BYTES / GIB
    _, rows = mc.estimate_from_log((tmp_path / "train.log").read_text())
    # the update: the estimate less the overhead moved to the largest measured micro-batch (32,000 tokens)
    update = rows["update"]
    at = update.gib - overhead - update.kib_per_token * 1024 * (32768 - 32000) / GIB
    assert f"estimate less the overhead at 32000 tokens {at:6.1f} GiB, allocated   19.0: {at / 19.0 - 1:+.0%}" \
        in _row(text, "update")
    # its bytes per token against the slope of the two measurements: 2 GiB over 8,000 tokens
    measured_kib = 2.0 * GIB / 8000 / 1024
    assert f"measured {measured_kib:.0f} KiB: {update.kib_per_token / measured_kib - 1:+.0%}" in text
    # the current-policy forward, logged inside the update, is its own pass
    assert "allocated   19.0" in _row(text, "current")
    # the overhead: outside the allocator, the largest over the passes (the cache is not overhead)
    assert f"overhead       estimate {overhead:.1f} GiB, measured 4.0" in text
    assert f"{overhead / 4.0 - 1:+.0%}" in _row(text, "overhead")
    # vLLM's share: outside the trainer's allocator awake (41.8) less asleep (the least, 3.5)
    assert f"vLLM's share   estimate {rows['rollout'].vllm:.1f} GiB, measured 38.3" in text
    # the passes the update's line covers, and a pass without a line
    assert "inside the update's line" in _row(text, "optimizer_step") and "inside" in _row(text, "update_end")
    _run(tmp_path, [line("update", 17.0 * GIB, 18.0 * GIB, 22.0 * GIB, 4.0 * GIB, 24000, 10)])
    assert _row(mc.compare(tmp_path / "train.log"), "log_prob").endswith("not measured")


def test_cached_memory_is_not_overhead_and_vllms_share_holds_its_cuda_graphs(tmp_path):
    """A GPU whose memory is known by construction: the trainer's CUDA context and NCCL 2.1 GiB, vLLM
    asleep 1.4 (its context 0.6, its CUDA graphs' pool 0.8, which sleep keeps), so 3.5 outside the
    trainer's allocator; the update allocates at most 20.0 while its allocator holds 27.0 (7.0 cached);
    vLLM awake adds its weights 8.2 and KV cache 30.0. The overhead is the 3.5 outside the allocator,
    not 3.5 + the 7.0 cached (which read -57% before); vLLM's share is what waking adds plus the CUDA
    graphs it kept asleep, 8.2 + 30.0 + 0.8, as vLLM reports them (the larger of its two ranks')."""
    outside, cached = 3.5, 7.0
    graphs = ["(vLLMHttpServer pid=9) INFO 01-01 [gpu_model_runner.py:4102] Graph capturing finished in 12 secs, "
              "took 0.80 GiB", "(vLLMHttpServer pid=9) INFO Graph capturing finished in 11 secs, took 0.78 GiB"]
    _run(tmp_path, [*graphs,
                    line("log_prob", 18.0 * GIB, 22.0 * GIB, (22.0 + outside) * GIB, outside * GIB, 49000, 4),
                    line("update", 20.0 * GIB, (20.0 + cached) * GIB, (20.0 + cached + outside) * GIB, outside * GIB,
                         32000, 8),
                    line("rollout", 1.0 * GIB, 1.2 * GIB, (1.2 + outside + 38.2) * GIB, (outside + 38.2) * GIB)])
    text = mc.compare(tmp_path / "train.log")
    overhead = OVERHEAD_BYTES / GIB
    assert _row(text, "overhead").strip().startswith(f"overhead       estimate {overhead:.1f} GiB, measured 3.5 (")
    assert "vLLM's CUDA graphs 0.8 of it" in _row(text, "overhead")
    assert _row(text, "overhead").endswith(f"{overhead / 3.5 - 1:+.0%}")
    assert _row(text, "update").endswith("not counted: 7.0)") and _row(text, "log_prob").endswith("not counted: 4.0)")
    _, rows = mc.estimate_from_log((tmp_path / "train.log").read_text())
    share = rows["rollout"].vllm
    assert (f"vLLM's share   estimate {share:.1f} GiB, measured 39.0 (outside the trainer's allocator awake less "
            f"asleep 38.2, its CUDA graphs 0.8): {share / 39.0 - 1:+.0%}") in text


def test_lines_without_the_device_figures_and_without_metrics_are_read(tmp_path):
    """A log of an earlier probe (peaks only) and no metrics file: what can be compared is."""
    _run(tmp_path, ["[stapo] memory peak: pass=log_prob allocated_gib=20.00 reserved_gib=21.00"])
    (tmp_path / "metrics.jsonl").unlink()
    text = mc.compare(tmp_path / "train.log")
    assert "allocated   20.0" in _row(text, "log_prob")
    assert "vLLM's share   not measured" in text and "overhead       estimate" not in text
    assert mc.main([str(tmp_path)]) == 0


def test_verls_run_wide_peaks_are_reported_from_the_metrics(tmp_path):
    _run(tmp_path, metrics_rows=[{"step": 1, "data": {"actor/perf/max_memory_allocated_gb": 30.0,
                                                      "actor/perf/max_memory_reserved_gb": 33.0}},
                                 {"step": 2, "data": {"actor/perf/max_memory_allocated_gb": 31.5,
                                                      "actor/perf/max_memory_reserved_gb": 34.0}}])
    text = mc.compare(tmp_path / "train.log", tmp_path / "metrics.jsonl")
    assert "max_memory_allocated_gb (all passes): 31.5 GiB" in text and "max_memory_reserved_gb (all passes): 34.0 GiB" in text


def test_bad_inputs_name_the_file(tmp_path):
    _run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "data": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        mc.compare(tmp_path / "train.log", tmp_path / "metrics.jsonl")
    (tmp_path / "train.log").write_text("[stapo] preflight passed\n")
    with pytest.raises(ValueError, match=r"train.log: no memory table"):
        mc.compare(tmp_path / "train.log")
    assert mc.main([str(tmp_path / "missing")]) == 1


def test_slope_needs_token_counts_apart():
    assert mc.slope([(1000, 1.0), (1050, 2.0)]) is None
    assert mc.slope([(1000, 1.0), (2000, 3.0), (3000, 5.0)]) == pytest.approx(2.0 / 1000)


def test_the_documented_command_runs_on_a_run_folder(tmp_path):
    folder = tmp_path / "results" / "gpu_smoke" / "stapo"
    folder.mkdir(parents=True)
    _run(folder, [line("update", 17.0 * GIB, 18.0 * GIB, 22.0 * GIB, 4.0 * GIB, 32000, 8)])
    command = next(c for c in (REPO / "docs" / "memory.md").read_text().splitlines()
                   if c.startswith("python -m stapo_memory.calibration results/"))
    argv = command.split("#")[0].split()
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "allocated   17.0" in _row(proc.stdout, "update")


def test_the_documented_command_reads_a_calibration_runs_log_and_metrics(tmp_path):
    """``--log calibration.log --metrics checkpoints/stapo/calibration/metrics.jsonl``, as docs/memory.md
    writes it after its calibration run, on recorded lines; ``--help`` names the command."""
    folder = tmp_path / "checkpoints" / "stapo" / "calibration"
    folder.mkdir(parents=True)
    _run(folder, [line("update", 17.0 * GIB, 18.0 * GIB, 22.0 * GIB, 4.0 * GIB, 32000, 8)],
         [{"step": 1, "data": {"actor/perf/max_memory_allocated_gb": 30.0}}])
    (folder / "train.log").rename(tmp_path / "calibration.log")
    (command,) = [c for c in (REPO / "docs" / "memory.md").read_text().splitlines()
                  if c.startswith("python -m stapo_memory.calibration --log ")]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, *command.split()[1:]], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "allocated   17.0" in _row(proc.stdout, "update")
    assert "max_memory_allocated_gb (all passes): 30.0 GiB" in proc.stdout
    usage = subprocess.run([sys.executable, "-m", "stapo_memory.calibration", "--help"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, env=env)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m stapo_memory.calibration ")


def test_the_overhead_is_documented_as_unmeasured_with_its_range_and_the_run_that_pins_it():
    """docs/memory.md, beside the term: the largest unmeasured term, its public range (NCCL's
    communicators, NVLS) and the calibration run that pins it, word for word the commands of
    "Calibrating on a GPU"."""
    text = (REPO / "docs" / "memory.md").read_text()
    term = text.split("**Fixed overhead**", 1)[1].split("\n\n", 1)[0]
    assert term.startswith(f", {OVERHEAD_BYTES / GIB:.1f} GiB per GPU: **the model's largest unmeasured term**")
    assert "0.5 to 1.6 GB" in term and "NVLS" in term and "`overhead` line" in term
    shown = [" ".join(code.split()) for code in re.findall(r"`([^`]+)`", term)]
    joined = text.replace("\\\n", " ").splitlines()
    launch = next(c for c in joined if c.startswith("VERL_USE_EXTERNAL_MODULES=verl_patches.activate,stapo_memory"))
    reading = next(c for c in joined if c.startswith("python -m stapo_memory.calibration --log "))
    assert " ".join(launch.split()) in shown and reading in shown
