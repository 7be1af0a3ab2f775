"""Per-phase step time of STAPO against JustRL, from two verl runs with identical settings and seeds.

::

    python -m benchmarks.bench_e2e RUN_JUSTRL RUN_STAPO        # run folders (metrics.jsonl) or .jsonl files
    python -m benchmarks.bench_e2e --from-quickstart results/quickstart
    python -m benchmarks.bench_e2e --run [--out results/bench_e2e] [--steps 6] [--timeout 1200]   # train both first

Per ``timing_s/<phase>`` metric both runs log: each run's median over steps and the median of the
paired per-step ratio (:func:`compare`; how to read them: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import common
from benchmarks.common import median, number
from recipe.stapo.metrics import find_metrics_file, read_metrics
from recipe.stapo.plots import stopped_message

TIMING_PREFIX = "timing_s/"
#: phases in the order of a step; others both runs log follow, sorted
PHASE_ORDER = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_weights", "step")
BASELINE, METHOD = "justrl", "stapo"


@dataclass
class PhaseRow:
    """One phase: median seconds of each run, median paired ratio, steps used (n)."""

    phase: str
    baseline_s: float
    method_s: float
    ratio: float
    n: int


def load_run(run: str | Path) -> dict[int, dict]:
    """``{step: {metric: value}}`` of one run (ValueError naming the file and line on a bad line; for a
    run the quickstart stopped at its limit before it logged a step, its message)."""
    stopped = stopped_message(run)
    try:
        path = find_metrics_file(run)
        steps = read_metrics(path)
    except (FileNotFoundError, ValueError):
        if stopped is None:
            raise
        steps = {}
    if not steps:
        raise ValueError(f"{run}: {stopped}, before logging a step: nothing to compare" if stopped is not None
                         else f"{path}: no steps logged")
    return steps


def phases(baseline: dict[int, dict], method: dict[int, dict]) -> list[str]:
    """Timing phases both runs log, in step order (:data:`PHASE_ORDER`), then the others sorted."""

    def names(run):
        return {k[len(TIMING_PREFIX):] for data in run.values() for k in data if k.startswith(TIMING_PREFIX)}

    common = names(baseline) & names(method)
    return [p for p in PHASE_ORDER if p in common] + sorted(common - set(PHASE_ORDER))


def _seconds(data: dict, phase: str) -> Optional[float]:
    value = data.get(TIMING_PREFIX + phase)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def timed_steps(baseline: dict[int, dict], method: dict[int, dict]) -> list[int]:
    """The training steps both runs logged, in order: steps with a ``timing_s/*`` metric in each (a
    validation before training, the quickstart's step 0, is no training step)."""
    timed = lambda run: {s for s, data in run.items() if any(k.startswith(TIMING_PREFIX) for k in data)}  # noqa: E731
    return sorted(timed(baseline) & timed(method))


def compare(baseline: dict[int, dict], method: dict[int, dict], *, warmup_steps: int = 1) -> list[PhaseRow]:
    """Per-phase medians and paired ratios over the training steps both runs logged
    (:func:`timed_steps`), the first ``warmup_steps`` of them skipped. A step whose baseline time is 0 gives no ratio (never
    inf/NaN); a phase with no usable step gets NaN medians and n = 0."""
    if warmup_steps < 0:
        raise ValueError(f"--warmup-steps={warmup_steps}: expected >= 0")
    steps = timed_steps(baseline, method)[warmup_steps:]
    rows = []
    for phase in phases(baseline, method):
        pairs = [(_seconds(baseline[s], phase), _seconds(method[s], phase)) for s in steps]
        pairs = [(b, m) for b, m in pairs if b is not None and m is not None]
        ratios = [m / b for b, m in pairs if b > 0]
        rows.append(PhaseRow(phase, median([b for b, _ in pairs]), median([m for _, m in pairs]), median(ratios),
                             len(ratios)))
    return rows


def markdown_table(rows: Sequence[PhaseRow], baseline: str = BASELINE, method: str = METHOD) -> str:
    header = ("phase", f"{baseline} median s", f"{method} median s", f"ratio {method}/{baseline}", "n")
    return common.markdown_table(header, ((r.phase, number(r.baseline_s, 3), number(r.method_s, 3), number(r.ratio, 3),
                                           r.n) for r in rows))


def report(baseline_run: str | Path, method_run: str | Path, warmup_steps: int = 1) -> str:
    """The comparison of two runs as printed by the CLI (header, notes and table)."""
    baseline, method = load_run(baseline_run), load_run(method_run)
    lines = [f"bench_e2e: {METHOD} {find_metrics_file(method_run)} vs {BASELINE} {find_metrics_file(baseline_run)}; "
             f"median over steps, step(s) {timed_steps(baseline, method)[:warmup_steps]} skipped as warm-up; "
             "ratio = median of per-step ratios"]
    for name, run in ((BASELINE, baseline_run), (METHOD, method_run)):
        stopped = stopped_message(run)
        if stopped is not None:
            lines.append(f"note: {name}: {stopped}; only the steps it logged are compared")
    if set(baseline) != set(method):
        lines.append(f"note: the runs logged different steps ({BASELINE}: {len(baseline)}, {METHOD}: {len(method)}); "
                     "only the common steps are compared")
    rows = compare(baseline, method, warmup_steps=warmup_steps)
    if not rows:
        raise ValueError(f"the runs share no {TIMING_PREFIX}* metric: are these verl runs with timing enabled?")
    return "\n".join(lines) + "\n\n" + markdown_table(rows)


def run_both(out: Path, steps: int, extra: Sequence[str] = ()) -> Optional[Path]:
    """Train JustRL and STAPO on CPU with identical settings and seeds through the quickstart
    (:mod:`stapo_cpu.quickstart`, reusing finished runs; ``extra``: its options). Returns the
    quickstart folder, or None (after printing how to do it by hand) when the CPU path is not
    available. RuntimeError when a run failed, naming a run stopped at its limit."""
    try:
        from stapo_cpu.quickstart import main as quickstart_main
    except ImportError as e:
        print(f"the CPU path is not available here ({e}); run the two trainings by hand:\n"
              f"  bash run_scripts/quickstart.sh --methods {BASELINE},{METHOD} --steps {steps} --out {out}\n"
              f"  python -m benchmarks.bench_e2e --from-quickstart {out}")
        return None
    code = quickstart_main(["--out", str(out), "--methods", f"{BASELINE},{METHOD}", "--steps", str(steps), *extra])
    if code != 0:
        stopped = [m for m in (stopped_message(out / BASELINE), stopped_message(out / METHOD)) if m is not None]
        raise RuntimeError("; ".join(stopped) + " (--timeout of bench_e2e --run)" if stopped
                           else f"the quickstart runs failed (exit {code}); see the logs under {out}")
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help=f"RUN_{BASELINE.upper()} RUN_{METHOD.upper()}: run folders or .jsonl files")
    p.add_argument("--from-quickstart", default=None, help=f"quickstart folder holding {BASELINE}/ and {METHOD}/")
    p.add_argument("--run", action="store_true", help="train both methods on CPU first (through the quickstart)")
    p.add_argument("--out", default="results/bench_e2e", help="--run: output folder (default results/bench_e2e)")
    p.add_argument("--steps", type=int, default=6, help="--run: training steps per method (default 6)")
    p.add_argument("--timeout", type=float, default=None,
                   help="--run: seconds each run may take (default: the quickstart's, 1200)")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps skipped (default 1)")
    args = p.parse_args(argv)
    sources = sum([bool(args.runs), args.from_quickstart is not None, args.run])
    if sources != 1 or (args.runs and len(args.runs) != 2):
        p.error(f"give exactly one of: two runs (RUN_{BASELINE.upper()} RUN_{METHOD.upper()}), --from-quickstart DIR, --run")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps={args.warmup_steps}: expected >= 0")
    if args.steps < 2:
        p.error(f"--steps={args.steps}: expected >= 2 (step 1 is skipped as warm-up)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.run:
        try:
            folder = run_both(Path(args.out), args.steps,
                              [] if args.timeout is None else ["--timeout", str(args.timeout)])
        except RuntimeError as e:
            print(f"bench_e2e: {e}", file=sys.stderr)
            return 1
        if folder is None:
            return 1
        runs = (folder / BASELINE, folder / METHOD)
    elif args.from_quickstart is not None:
        runs = (Path(args.from_quickstart) / BASELINE, Path(args.from_quickstart) / METHOD)
    else:
        runs = tuple(args.runs)
    try:
        print(report(*runs, warmup_steps=args.warmup_steps))
    except (ValueError, FileNotFoundError) as e:
        print(f"bench_e2e: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
