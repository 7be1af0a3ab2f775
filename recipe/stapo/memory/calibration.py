"""The memory model's estimate next to what a run measured, for calibrating the model on the first
GPU run (docs/memory.md, "Calibrating on a GPU").

    python -m recipe.stapo.memory.calibration results/gpu_smoke/stapo [more run folders...]
    python -m recipe.stapo.memory.calibration --log train.log --metrics metrics.jsonl

A run folder holds the driver's log (``train.log``: the preflight's memory table, one row per pass,
and the workers' ``[stapo] memory peak: pass=...`` lines, :mod:`verl_patches.memory_probe`: PyTorch's
allocator peak of each log-prob, reference and update pass on rank 0) and verl's file logger output
(``metrics.jsonl``: verl's own ``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb``,
peaks since the process started, never reset: one number for all training passes). Each measured
pass (its largest peak over the run) is set beside its estimate less the fixed overhead (CUDA
contexts, NCCL buffers and vLLM's residue are outside PyTorch's allocator); verl's run-wide peak
beside the largest training pass. The rollout is not compared: vLLM holds its share of the GPU by
construction.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional

from recipe.stapo.memory import model as mm

#: a row of the preflight's memory table: pass, estimate, margin (GiB), share of the GPU
ROW = re.compile(r"^\s*(?:\[stapo\]\s*)?([a-z_]+)\s+([0-9.]+) \+\s*([0-9.]+)\s+\d+%\s")
#: the table's first line (carries the target GPU's capacity)
HEAD = re.compile(r"GPU memory per GPU \(estimate, GiB; target ([0-9.]+) GiB")
MEASURED_KEYS = ("max_memory_allocated_gb", "max_memory_reserved_gb")
#: a worker's per-pass line (verl_patches.memory_probe), with Ray's prefix before it
PROBE = re.compile(r"\[stapo\] memory peak: pass=([a-z_]+) allocated_gib=([0-9.]+) reserved_gib=([0-9.]+)")
NOT_COMPARED = ("rollout",)


def estimate_from_log(text: str) -> tuple[Optional[float], dict[str, float]]:
    """(target GiB, {pass: estimated GiB}) of the last memory table in a driver's log."""
    target, rows, inside = None, {}, False
    for line in text.splitlines():
        head = HEAD.search(line)
        if head:
            target, rows, inside = float(head.group(1)), {}, True
            continue
        if inside:
            row = ROW.match(line)
            if row:
                rows[row.group(1)] = float(row.group(2))
            elif "peak:" not in line:
                inside = False
    return target, rows


def measured_passes(text: str) -> dict[str, tuple[float, float]]:
    """{pass: (allocated GiB, reserved GiB)}, the largest of each pass's lines in a driver's log."""
    peaks: dict[str, tuple[float, float]] = {}
    for m in PROBE.finditer(text):
        name, allocated, reserved = m.group(1), float(m.group(2)), float(m.group(3))
        old = peaks.get(name, (0.0, 0.0))
        peaks[name] = (max(old[0], allocated), max(old[1], reserved))
    return peaks


def measured_from_metrics(path: Path) -> dict[str, float]:
    """The largest value of each of verl's memory metrics over the steps of ``metrics.jsonl``
    (any prefix: ``actor/perf/...``); ``ValueError`` naming the file and line of a bad row."""
    peaks: dict[str, float] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
        data = row.get("data", row) if isinstance(row, dict) else {}
        for key, value in data.items():
            for name in MEASURED_KEYS:
                if key.endswith(name) and isinstance(value, (int, float)):
                    peaks[name] = max(peaks.get(name, 0.0), float(value))
    return peaks


def compare(log: Path, metrics: Path) -> str:
    """The estimate's passes and the measured peaks of one run, as text."""
    for path in (log, metrics):
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
    text = log.read_text(errors="replace")
    target, rows = estimate_from_log(text)
    if not rows:
        raise ValueError(f"{log}: no memory table of the preflight (a CPU run, or memory_check=off)")
    measured = measured_from_metrics(metrics)
    probed = measured_passes(text)
    overhead = mm.OVERHEAD_BYTES / mm.GIB
    lines = [f"{log.parent}: target {target} GiB; per pass: estimate, estimate less the {overhead:.1f} GiB overhead, "
             "measured allocated / reserved peak (rank 0), reserved / estimate less overhead"]
    for name, gib in rows.items():
        row = f"  {name:<14} {gib:6.1f}"
        if name in NOT_COMPARED:
            row += "  (not compared: vLLM's share)"
        elif name in probed:
            allocated, reserved = probed[name]
            row += f" {gib - overhead:6.1f}  measured {allocated:6.1f} / {reserved:6.1f}  {reserved / (gib - overhead):.2f}"
        else:
            row += f" {gib - overhead:6.1f}  not measured"
        lines.append(row)
    training = {k: v for k, v in rows.items() if k not in NOT_COMPARED}
    if not measured:
        lines.append(f"  measured: {metrics} has no {' / '.join(MEASURED_KEYS)}")
        return "\n".join(lines)
    name = max(training, key=training.get)
    expected = training[name] - mm.OVERHEAD_BYTES / mm.GIB
    for key in MEASURED_KEYS:
        if key in measured:
            lines.append(f"  verl's {key} (all passes): {measured[key]:.1f} GiB; estimate of the largest training "
                         f"pass ({name}) less the overhead: {expected:.1f} GiB; measured / estimate "
                         f"{measured[key] / expected:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run folders holding train.log and metrics.jsonl")
    p.add_argument("--log", help="a driver's log (instead of a run folder)")
    p.add_argument("--metrics", help="its metrics.jsonl")
    args = p.parse_args(argv)
    pairs = [(Path(r) / "train.log", Path(r) / "metrics.jsonl") for r in args.runs]
    if args.log or args.metrics:
        if not (args.log and args.metrics):
            p.error("--log and --metrics go together")
        pairs.append((Path(args.log), Path(args.metrics)))
    if not pairs:
        p.error("name a run folder, or --log and --metrics")
    status = 0
    for log, metrics in pairs:
        try:
            print(compare(log, metrics))
        except ValueError as e:
            print(f"recipe.stapo.memory.calibration: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
