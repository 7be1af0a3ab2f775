"""Training curves of several runs, one line per method, from verl's file-logger JSON Lines.

CLI::

    python -m recipe.stapo.plots RUN_DIR [RUN_DIR ...] --out DIR [--labels NAME ...]

Writes ``DIR/curves.png`` (all panels) and one ``DIR/<panel>.png`` per panel that some run logged:
reward, entropy, response length, silenced fraction (log scale), validation accuracy, over steps.

Where a run's metrics are and how they are read: :mod:`recipe.stapo.metrics`. A metric missing from
a run is skipped for that run with a note; a panel no run logged is left out of the per-panel PNGs
and marked "not logged" in ``curves.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from stapo_core.fileio import atomic_write

from .metrics import Series, find_metrics_file, metric_series
from .metrics import read_metrics as read_steps

#: validation accuracy keys: val-core/<data_source>/<acc|reward>/mean@<N> (verl's ray_trainer)
_VAL_MEAN_RE = re.compile(r"^val-core/(?P<source>.+)/(?P<var>[^/]+)/mean@(?P<n>\d+)$")



# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> dict[str, Series]:
    """Every finite numeric metric of a file-logger JSONL, as a series over steps
    (:func:`recipe.stapo.metrics.read_metrics`, then :func:`recipe.stapo.metrics.metric_series`)."""
    return metric_series(read_steps(path))


# --------------------------------------------------------------------------------------------
# panels
# --------------------------------------------------------------------------------------------


def _first_of(*keys: str) -> Callable[[Mapping[str, Series]], dict[str, Series]]:
    """Selector: the first of ``keys`` that the run logged (as ``{"": series}``)."""

    def select(metrics):
        for key in keys:
            if key in metrics:
                return {"": metrics[key]}
        return {}

    return select


def _val_accuracy(metrics: Mapping[str, Series]) -> dict[str, Series]:
    """``val-core/<source>/<acc|reward>/mean@N`` per data source (``acc`` preferred, largest N)."""
    best: dict[str, tuple] = {}
    for key in metrics:
        m = _VAL_MEAN_RE.match(key)
        if m:
            rank = (m.group("var") == "acc", int(m.group("n")))
            if m.group("source") not in best or rank > best[m.group("source")][0]:
                best[m.group("source")] = (rank, key)
    suffix = len(best) > 1
    return {(source if suffix else ""): metrics[key] for source, (_, key) in sorted(best.items())}


@dataclass(frozen=True)
class Panel:
    """One plotted quantity: ``select(metrics)`` gives ``{line suffix: series}`` (empty: not logged)."""

    name: str
    title: str
    metric: str
    select: Callable[[Mapping[str, Series]], dict[str, Series]]
    log_scale: bool = False


PANELS = (
    Panel("reward", "Training reward", "critic/score/mean (or critic/rewards/mean)",
          _first_of("critic/score/mean", "critic/rewards/mean")),
    Panel("entropy", "Policy entropy", "actor/entropy", _first_of("actor/entropy")),
    Panel("response_length", "Mean response length (tokens)", "response_length/mean",
          _first_of("response_length/mean")),
    Panel("silenced_frac", "Silenced token fraction (S2T)", "actor/s2t/silenced_frac",
          _first_of("actor/s2t/silenced_frac"), log_scale=True),
    Panel("val_accuracy", "Validation accuracy", "val-core/<data_source>/<acc|reward>/mean@N", _val_accuracy),
)


def panel_lines(panel: Panel, runs: Mapping[str, Mapping[str, Series]]) -> dict[str, Series]:
    """``{line label: series}`` of one panel over runs ``{label: metrics}`` (runs without it left out)."""
    lines = {}
    for label, metrics in runs.items():
        for suffix, series in panel.select(metrics).items():
            lines[f"{label} ({suffix})" if suffix else label] = series
    return lines


def missing_notes(runs: Mapping[str, Mapping[str, Series]]) -> list[str]:
    """One note per (run, panel) whose metric the run did not log."""
    return [f"{label}: no {panel.metric}; skipped in '{panel.name}'"
            for label, metrics in runs.items() for panel in PANELS if not panel.select(metrics)]


def _symlog_threshold(lines: Mapping[str, Series]) -> float:
    """Linear range of the symlog axis: the smallest positive value (1e-6 if none), so zeros show at 0."""
    positive = [v for _, values in lines.values() for v in values if v > 0]
    return min(positive) if positive else 1e-6


def draw_panel(ax, panel: Panel, lines: Mapping[str, Series]) -> None:
    """Plot ``lines`` on ``ax`` (one Line2D per entry, in order); a "not logged" note when empty."""
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    if not lines:
        ax.text(0.5, 0.5, f"not logged\n({panel.metric})", ha="center", va="center", transform=ax.transAxes,
                fontsize=8, color="gray")
        return
    order = [label.split(" (")[0] for label in lines]
    for label, (steps, values) in lines.items():
        ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label,
                color=method_color(label.split(" (")[0], order))
    if panel.log_scale:
        ax.set_yscale("symlog", linthresh=_symlog_threshold(lines))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def summary_figure(runs: Mapping[str, Mapping[str, Series]]):
    """A matplotlib Figure with one axes per entry of :data:`PANELS` (same order), then spares hidden."""
    plt = _pyplot()
    ncols = 3
    nrows = math.ceil(len(PANELS) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    flat = axes.ravel()
    for ax, panel in zip(flat, PANELS):
        draw_panel(ax, panel, panel_lines(panel, runs))
    for ax in flat[len(PANELS):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def panel_figure(panel: Panel, lines: Mapping[str, Series]):
    """A one-axes Figure of one panel."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_panel(ax, panel, lines)
    ax.set_ylabel(panel.metric, fontsize=8)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    _pyplot().close(fig)
    return path


# --------------------------------------------------------------------------------------------
# bands across seeds (study mode)
# --------------------------------------------------------------------------------------------

#: one colour per method, the same in every panel and figure
METHOD_COLORS = {"grpo": "tab:blue", "entropy20": "tab:orange", "justrl": "tab:green", "stapo": "tab:red"}
_SPARE_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def method_color(label: str, order: Sequence[str] = ()) -> str:
    """The colour of ``label``: :data:`METHOD_COLORS` for a known method, else a spare colour by
    its position in ``order`` (stable for a given list of labels)."""
    if label in METHOD_COLORS:
        return METHOD_COLORS[label]
    others = [x for x in order if x not in METHOD_COLORS]
    return _SPARE_COLORS[(others.index(label) if label in others else 0) % len(_SPARE_COLORS)]


@dataclass(frozen=True)
class Band:
    """Mean and range over seeds at each step: arrays of equal length (``seeds[i]`` runs have step ``steps[i]``)."""

    steps: list
    mean: list
    low: list
    high: list
    seeds: list


def band(series: Sequence[Series]) -> Band:
    """Per-step mean, min and max over the runs that logged the step (one series per seed)."""
    values: dict[int, list[float]] = {}
    for steps, ys in series:
        for s, y in zip(steps, ys):
            values.setdefault(s, []).append(y)
    steps = sorted(values)
    return Band(steps, [sum(values[s]) / len(values[s]) for s in steps], [min(values[s]) for s in steps],
                [max(values[s]) for s in steps], [len(values[s]) for s in steps])


#: panels of the study figure: (name, title, selector, log scale); the grad-norm panel is special
BAND_PANELS = (
    ("reward", "Training reward (critic/score/mean)", _first_of("critic/score/mean", "critic/rewards/mean"), False),
    ("val_accuracy", "Validation accuracy", _val_accuracy, False),
    ("entropy", "Mean entropy (actor/entropy)", _first_of("actor/entropy"), False),
    ("entropy_p95", "p95 entropy (actor/entropy_p95)", _first_of("actor/entropy_p95"), False),
    ("silenced_frac", "Silenced fraction (actor/s2t/silenced_frac)", _first_of("actor/s2t/silenced_frac"), True),
    ("grad_norm", "Closed-form grad norm\nsilenced (dashed), kept candidates (dotted), all kept (solid)", None,
     False),
)
#: the grad-norm panel's lines: (metric, line style, variant label)
GRAD_NORM_KEYS = (("actor/s2t/grad_norm_kept", "-", "kept"),
                  ("actor/s2t/grad_norm_kept_candidates", ":", "kept candidates"),
                  ("actor/s2t/grad_norm_silenced", "--", "silenced"))


def band_lines(name: str, groups: Mapping[str, Sequence[Mapping[str, Series]]]) -> dict[tuple[str, str], Band]:
    """``{(method, variant): Band}`` of one study panel over ``groups = {method: [metrics per seed]}``
    (methods without the metric left out; variant is "" except the :data:`GRAD_NORM_KEYS` labels for grad_norm)."""
    out = {}
    for method, runs in groups.items():
        if name == "grad_norm":
            for key, _, variant in GRAD_NORM_KEYS:
                series = [m[key] for m in runs if key in m]
                if series:
                    out[(method, variant)] = band(series)
            continue
        select = next(p[2] for p in BAND_PANELS if p[0] == name)
        series = [next(iter(sel.values())) for sel in map(select, runs) if sel]
        if series:
            out[(method, "")] = band(series)
    return out


def draw_bands(ax, title: str, lines: Mapping[tuple[str, str], Band], log_scale: bool = False,
               order: Sequence[str] = ()) -> None:
    """One mean line (and a min-max band when several seeds) per entry, coloured by method."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    if not lines:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, fontsize=8, color="gray")
        return
    styles = {variant: style for _, style, variant in GRAD_NORM_KEYS}
    for (method, variant), b in lines.items():
        color = method_color(method, order)
        label = f"{method} ({variant})" if variant else method
        ax.plot(b.steps, b.mean, styles.get(variant, "-"), color=color, label=label,
                marker="." if len(b.steps) < 30 else None)
        if max(b.seeds) > 1:
            ax.fill_between(b.steps, b.low, b.high, color=color, alpha=0.18, linewidth=0)
    if log_scale:
        positive = [v for b in lines.values() for v in b.mean + b.high if v > 0]
        ax.set_yscale("symlog", linthresh=min(positive) if positive else 1e-6)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def band_figure(groups: Mapping[str, Sequence[Mapping[str, Series]]]):
    """The study figure: one axes per :data:`BAND_PANELS` entry, bands = min-max over seeds."""
    plt = _pyplot()
    ncols = 3
    nrows = math.ceil(len(BAND_PANELS) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    order = list(groups)
    for ax, (name, title, _, log_scale) in zip(axes.ravel(), BAND_PANELS):
        draw_bands(ax, title, band_lines(name, groups), log_scale, order)
    seeds = sorted({len(runs) for runs in groups.values()})
    fig.suptitle(f"mean over seeds ({'/'.join(map(str, seeds))} per method), band = min..max", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bands(groups: Mapping[str, Sequence[str | os.PathLike]], out_dir: str | os.PathLike,
               name: str = "study_curves.png") -> list[Path]:
    """Write the study figure (``out_dir/<name>``) from ``{method: [run folder per seed]}``."""
    loaded = {method: [read_metrics(find_metrics_file(run)) for run in runs] for method, runs in groups.items()}
    if not any(loaded.values()):
        raise ValueError("no runs to plot")
    return [_save(band_figure(loaded), Path(out_dir) / name)]


# --------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------


def _labelled(run_dirs: Mapping[str, Path] | Sequence[Path]) -> dict[str, Path]:
    if isinstance(run_dirs, Mapping):
        return {str(k): Path(v) for k, v in run_dirs.items()}
    labelled: dict[str, Path] = {}
    for run in map(Path, run_dirs):
        label = run.stem if run.is_file() else run.resolve().name
        if label in labelled:
            raise ValueError(f"two runs are both labelled {label!r} ({labelled[label]}, {run}); give labels")
        labelled[label] = run
    return labelled


def load_runs(run_dirs: Mapping[str, Path] | Sequence[Path], progress: bool = True) -> dict[str, dict[str, Series]]:
    """``{label: metrics}``: labels from a mapping, else each run folder's name (file stem for a file)."""
    from tqdm import tqdm

    labelled = _labelled(run_dirs)
    if not labelled:
        raise ValueError("no runs to plot")
    return {label: read_metrics(find_metrics_file(run))
            for label, run in tqdm(labelled.items(), desc="reading runs", unit="run", disable=not progress)}


def plot_runs(run_dirs: Mapping[str, Path] | Sequence[Path], out_dir: str | os.PathLike,
              notes: Optional[list] = None) -> list[Path]:
    """Write ``curves.png`` and one PNG per logged panel into ``out_dir``; return their paths.

    Args:
        run_dirs: ``{label: run folder or metrics file}``, or a list of them (labels = folder names).
        out_dir: created if needed.
        notes: if a list, the "metric missing" notes are appended to it (also printed to stderr).
    """
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    found = missing_notes(runs)
    for note in found:
        print(f"note: {note}", file=sys.stderr)
    if notes is not None:
        notes.extend(found)
    written = [_save(summary_figure(runs), out / "curves.png")]
    for panel in PANELS:
        lines = panel_lines(panel, runs)
        if lines:
            written.append(_save(panel_figure(panel, lines), out / f"{panel.name}.png"))
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or their metrics .jsonl files)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: the run folder names)")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels: got {len(args.labels)} labels for {len(args.runs)} runs")
    if args.labels is not None and len(set(args.labels)) != len(args.labels):
        parser.error("--labels: labels must be distinct")
    runs = dict(zip(args.labels, args.runs)) if args.labels else args.runs
    try:
        paths = plot_runs(runs, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
