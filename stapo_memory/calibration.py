"""The memory model's estimate next to what a calibration run measured, term by term, so the first GPU
run can correct the model (docs/memory.md, "Calibrating on a GPU", says what each line compares): it reads
the preflight's table and the probes' lines (:mod:`stapo_memory.peaks`) from the driver's log, vLLM's own
report of its CUDA graphs, and verl's run-wide peaks from ``metrics.jsonl``.

    python -m stapo_memory.calibration results/gpu_smoke/stapo [more run folders...]
    python -m stapo_memory.calibration --log train.log [--metrics metrics.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .terms import GIB, OVERHEAD_BYTES

#: a row of the preflight's memory table: pass, estimate, margin (GiB), share of the GPU, and for a
#: token-dependent pass its tokens and bytes per token
ROW = re.compile(r"^\s*(?:\[stapo\]\s*)?([a-z_]+)\s+([0-9.]+) \+\s*([0-9.]+)\s+\d+%\s+\S+(?: [A-Z ]+)?\s*"
                 r"(?:at (\d+) tokens, (\d+) KiB/token)?")
#: the rollout row's vLLM component
VLLM = re.compile(r"vLLM \(gpu_memory_utilization\) ([0-9.]+)")
#: the table's first line (carries the target GPU's capacity)
HEAD = re.compile(r"GPU memory per GPU \(estimate, GiB; target ([0-9.]+) GiB")
MEASURED_KEYS = ("max_memory_allocated_gb", "max_memory_reserved_gb")
#: a worker's per-pass line (stapo_memory.peaks), with Ray's prefix before it
PROBE = re.compile(r"\[stapo\] memory peak: pass=([a-z_]+) allocated_gib=([0-9.]+) reserved_gib=([0-9.]+)"
                   r"(?: device_gib=([0-9.]+) outside_gib=(-?[0-9.]+) tokens=(\d+) micro_batches=(\d+))?")
#: vLLM's report of its CUDA graphs' pool, per GPU (``capture_model``: the device's free memory before less
#: after the capture); the pool stays allocated while vLLM sleeps (its sleep frees weights and KV cache only)
GRAPHS = re.compile(r"Graph capturing finished in \d+ secs, took ([0-9.]+) GiB")
#: token counts this far apart (relative) let a slope be fitted
SLOPE_SPREAD = 0.10
#: passes the probe's update line covers beside the update itself (its backward's end, the optimizer step)
WITHIN_UPDATE = ("update_end", "optimizer_step")


@dataclass
class Row:
    """A pass's row of the preflight's table (GiB; ``tokens`` and ``kib_per_token`` for a
    token-dependent pass; ``vllm``: vLLM's share, in the rollout's row)."""

    name: str
    gib: float
    tokens: Optional[int] = None
    kib_per_token: Optional[float] = None
    vllm: Optional[float] = None


@dataclass
class Measured:
    """One probe line (GiB; ``tokens``: the largest micro-batch on the GPU)."""

    name: str
    allocated: float
    reserved: float
    device: Optional[float] = None
    outside: Optional[float] = None
    tokens: int = 0


def estimate_from_log(text: str) -> tuple[Optional[float], dict[str, Row]]:
    """(target GiB, {pass: row}) of the last memory table in a driver's log."""
    target, rows, inside = None, {}, False
    for line in text.splitlines():
        head = HEAD.search(line)
        if head:
            target, rows, inside = float(head.group(1)), {}, True
            continue
        if inside:
            row = ROW.match(line)
            if row:
                vllm = VLLM.search(line)
                rows[row.group(1)] = Row(row.group(1), float(row.group(2)),
                                         int(row.group(4)) if row.group(4) else None,
                                         float(row.group(5)) if row.group(5) else None,
                                         float(vllm.group(1)) if vllm else None)
            elif "peak:" not in line and "vLLM's share" not in line:
                inside = False
    return target, rows


def probe_lines(text: str) -> list[Measured]:
    """Every probe line of a driver's log, in order."""
    out = []
    for m in PROBE.finditer(text):
        device, outside, tokens = m.group(4), m.group(5), m.group(6)
        out.append(Measured(m.group(1), float(m.group(2)), float(m.group(3)),
                            float(device) if device else None, float(outside) if outside else None,
                            int(tokens) if tokens else 0))
    return out


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


def slope(points: list[tuple[int, float]]) -> Optional[float]:
    """Least-squares slope of ``(tokens, GiB)`` points (GiB per token), or None when the token counts
    span less than :data:`SLOPE_SPREAD` of the largest."""
    xs = [float(x) for x, _ in points]
    if len(xs) < 2 or max(xs) - min(xs) < SLOPE_SPREAD * max(xs):
        return None
    return statistics.linear_regression(xs, [float(y) for _, y in points]).slope


def _error(estimate: float, measured: float) -> str:
    return f"{estimate / measured - 1:+.0%}" if measured > 0 else "n/a"


def compare(log: Path, metrics: Optional[Path] = None) -> str:
    """The estimate's terms and the measured ones of one run, as text."""
    for path in (log, metrics):
        if path is not None and not path.is_file():
            raise ValueError(f"{path}: no such file")
    text = log.read_text(errors="replace")
    target, rows = estimate_from_log(text)
    if not rows:
        raise ValueError(f"{log}: no memory table of the preflight (a CPU run, or memory_check=off)")
    lines = probe_lines(text)
    overhead = OVERHEAD_BYTES / GIB
    out = [f"{log.parent}: target {target} GiB; each term: estimate, measured (rank 0, largest over the run), "
           "estimate / measured - 1"]
    for name, row in rows.items():
        if name == "rollout":
            continue
        if name in WITHIN_UPDATE:
            out.append(f"  {name:<14} estimate {row.gib:6.1f} GiB: inside the update's line (its peak is the largest "
                       "of the update's passes)")
            continue
        measured = [m for m in lines if m.name == name]
        if not measured:
            out.append(f"  {name:<14} estimate {row.gib:6.1f} GiB: not measured")
            continue
        peak = max(measured, key=lambda m: m.allocated)
        at = row.gib - overhead
        where = ""
        inside = [rows[n].gib for n in WITHIN_UPDATE if name == "update" and n in rows]
        if inside and max(inside) > row.gib:  # the update's line peaks at its end or in the optimizer step
            at, where = max(inside) - overhead, " (its end or the optimizer step)"
        elif row.tokens and row.kib_per_token is not None and peak.tokens:
            at -= row.kib_per_token * 1024 * (row.tokens - peak.tokens) / GIB
            where = f" at {peak.tokens} tokens"
        out.append(f"  {name:<14} estimate less the overhead{where} {at:6.1f} GiB, allocated {peak.allocated:6.1f}: "
                   f"{_error(at, peak.allocated)} (and cached by the allocator beside it, not counted: "
                   f"{peak.reserved - peak.allocated:.1f})")
        fitted = slope([(m.tokens, m.allocated) for m in measured if m.tokens])
        if fitted is not None and row.kib_per_token is not None:
            kib = fitted * GIB / 1024
            out.append(f"  {'':<14} bytes per token: estimate {row.kib_per_token:.0f} KiB, measured {kib:.0f} KiB: "
                       f"{_error(row.kib_per_token, kib)}")
    graphs = max((float(g) for g in GRAPHS.findall(text)), default=0.0)
    asleep = [m for m in lines if m.name != "rollout" and m.outside is not None]
    if asleep:
        worst = max(asleep, key=lambda m: m.outside)
        out.append(f"  overhead       estimate {overhead:.1f} GiB, measured {worst.outside:.1f} (outside PyTorch's allocator "
                   f"with vLLM asleep, pass {worst.name}; vLLM's CUDA graphs {graphs:.1f} of it): "
                   f"{_error(overhead, worst.outside)}")
    awake = [m for m in lines if m.name == "rollout" and m.outside is not None]
    if awake and asleep and rows.get("rollout") and rows["rollout"].vllm is not None:
        woken = max(m.outside for m in awake) - min(m.outside for m in asleep)
        out.append(f"  vLLM's share   estimate {rows['rollout'].vllm:.1f} GiB, measured {woken + graphs:.1f} (outside the "
                   f"trainer's allocator awake less asleep {woken:.1f}, its CUDA graphs {graphs:.1f}): "
                   f"{_error(rows['rollout'].vllm, woken + graphs)}")
    elif "rollout" in rows:
        out.append("  vLLM's share   not measured (no rollout line: the probe logs it after each weight sync)")
    if metrics is not None:
        run_wide = measured_from_metrics(metrics)
        if not run_wide:
            out.append(f"  verl's run-wide peak: {metrics} has no {' / '.join(MEASURED_KEYS)}")
        for key in MEASURED_KEYS:
            if key in run_wide:
                out.append(f"  verl's {key} (all passes): {run_wide[key]:.1f} GiB")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stapo_memory.calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run folders holding train.log (and metrics.jsonl)")
    p.add_argument("--log", help="a driver's log (instead of a run folder)")
    p.add_argument("--metrics", help="its metrics.jsonl (optional)")
    args = p.parse_args(argv)
    pairs = []
    for run in args.runs:
        metrics = Path(run) / "metrics.jsonl"
        pairs.append((Path(run) / "train.log", metrics if metrics.is_file() else None))
    if args.metrics and not args.log:
        p.error("--metrics goes with --log")
    if args.log:
        pairs.append((Path(args.log), Path(args.metrics) if args.metrics else None))
    if not pairs:
        p.error("name a run folder, or --log")
    status = 0
    for log, metrics in pairs:
        try:
            print(compare(log, metrics))
        except ValueError as e:
            print(f"stapo_memory.calibration: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
