"""Training curves of several runs, one line per method, from verl's file-logger JSON Lines.

CLI: ``python -m recipe.stapo.plots RUN_DIR [RUN_DIR ...] --out DIR [--labels NAME ...]`` writes
``DIR/curves.png`` (all :data:`PANELS`), one ``DIR/<panel>.png`` per logged panel and
``DIR/update_effect.png``. A missing metric is skipped with a note; a non-finite value (NaN, inf, or
verl's ``null``) is never dropped silently: its line breaks there, a mark stands at the panel's edge
and a note names run, metric, steps and values.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from tqdm import tqdm

from stapo_core.fileio import atomic_write, check_output_folder, cli_path

from .methods import methods
from .metrics import Series, find_metrics_file, metric_series, nonfinite_values
from .metrics import read_metrics as read_steps

#: validation accuracy keys: val-core/<data_source>/<acc|reward>/mean@<N> (verl's ray_trainer)
_VAL_MEAN_RE = re.compile(r"^val-core/(?P<source>.+)/(?P<var>[^/]+)/mean@(?P<n>\d+)$")
#: written into a run folder by the quickstart when it stopped the run at its limit (``--timeout``)
STOPPED_FILE = "stopped.json"


def stopped_message(run: str | os.PathLike) -> Optional[str]:
    """The quickstart's message about a run it stopped at its limit (``RUN_DIR/stopped.json``; ``run``:
    the run folder or a file in it), or None for a run it did not stop."""
    run = Path(run)
    try:
        return str(json.loads(((run.parent if run.is_file() else run) / STOPPED_FILE).read_text())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunMetrics(dict):
    """``{metric: Series}`` of one run (finite values only), and in ``nonfinite`` the values left out,
    ``{metric: [(step, value), ...]}`` (an all-non-finite metric gets an empty series)."""

    def __init__(self, series: dict[str, Series], nonfinite: dict[str, list] | None = None):
        super().__init__(series)
        self.nonfinite = dict(nonfinite or {})
        for key in self.nonfinite:
            self.setdefault(key, ([], []))


def read_metrics(path: str | os.PathLike) -> RunMetrics:
    """Every numeric metric of a file-logger JSONL as a series of its finite values; the rest in
    ``.nonfinite``."""
    steps = read_steps(path)
    if not steps:
        size = os.path.getsize(path)
        why = (f"its {size} bytes hold no complete line: a write cut short, or zeros a crash left" if size else
               "an empty metrics file: the run logged no step yet, or the file was emptied")
        raise ValueError(f"{path}: no step records ({why}); nothing to plot")
    series, nonfinite = metric_series(steps), nonfinite_values(steps)
    for key, (xs, ys) in list(series.items()):  # beyond PLOT_LIMIT: marked like a non-finite value
        far = [(x, y) for x, y in zip(xs, ys) if abs(y) > PLOT_LIMIT]
        if far:
            kept = [(x, y) for x, y in zip(xs, ys) if abs(y) <= PLOT_LIMIT]
            series[key] = ([x for x, _ in kept], [y for _, y in kept])
            nonfinite[key] = sorted(nonfinite.get(key, []) + far, key=lambda p: p[0])
    return RunMetrics(series, nonfinite)


PLOT_LIMIT = 1e300
"""Largest magnitude drawn as a point of a line: a larger finite value is marked like an infinity."""


def _nonfinite(metrics: Mapping[str, Series], key: str) -> list:
    """``[(step, value)]`` of ``key``'s non-finite values in one run (none for a plain mapping)."""
    return getattr(metrics, "nonfinite", {}).get(key, [])


def _first_of(*keys: str) -> Callable[[Mapping[str, Series]], dict[str, str]]:
    """Selector: the first of ``keys`` that the run logged (as ``{"": key}``)."""

    def select(metrics):
        for key in keys:
            if key in metrics:
                return {"": key}
        return {}

    return select


def _val_accuracy(metrics: Mapping[str, Series]) -> dict[str, str]:
    """``val-core/<source>/<acc|reward>/mean@N`` per data source (``acc`` preferred, largest N)."""
    best: dict[str, tuple] = {}
    for key in metrics:
        m = _VAL_MEAN_RE.match(key)
        if m:
            rank = (m.group("var") == "acc", int(m.group("n")))
            if m.group("source") not in best or rank > best[m.group("source")][0]:
                best[m.group("source")] = (rank, key)
    suffix = len(best) > 1
    return {(source if suffix else ""): key for source, (_, key) in sorted(best.items())}


@dataclass(frozen=True)
class Panel:
    """One plotted quantity: ``select(metrics)`` gives ``{line suffix: metric key}`` (empty: not logged)."""

    name: str
    title: str
    metric: str
    select: Callable[[Mapping[str, Series]], dict[str, str]]
    log_scale: bool = False
    #: line style per line suffix (default solid)
    styles: Optional[Mapping[str, str]] = None


#: the update effect's token sets: (set, metric key, line style, label)
DLOGP_SETS = (("silenced", "actor/s2t/dlogp_silenced", "--", "silenced"),
              ("kept_candidates", "actor/s2t/dlogp_kept_candidates", ":", "kept candidates"),
              ("all", "actor/s2t/dlogp_all", "-", "all"))


def _dlogp_keys(metrics: Mapping[str, Series]) -> dict[str, str]:
    """``{label: actor/s2t/dlogp_<set>}`` for the sets the run logged (:data:`DLOGP_SETS` order)."""
    return {label: key for _, key, _, label in DLOGP_SETS if key in metrics}


PANELS = (
    Panel("reward", "Training reward", "critic/score/mean (or critic/rewards/mean)",
          _first_of("critic/score/mean", "critic/rewards/mean")),
    Panel("entropy", "Policy entropy", "actor/entropy", _first_of("actor/entropy")),
    Panel("response_length", "Mean response length (tokens)", "response_length/mean",
          _first_of("response_length/mean")),
    Panel("silenced_frac", "Silenced token fraction (S2T)", "actor/s2t/silenced_frac",
          _first_of("actor/s2t/silenced_frac"), log_scale=True),
    Panel("val_accuracy", "Validation accuracy", "val-core/<data_source>/<acc|reward>/mean@N", _val_accuracy),
    Panel("dlogp", "Log-prob change across the update\nsilenced (dashed), kept candidates (dotted), all (solid)",
          "actor/s2t/dlogp_{silenced,kept_candidates,all}", _dlogp_keys,
          styles={label: style for _, _, style, label in DLOGP_SETS}),
)


def _panel_keys(panel: Panel, runs: Mapping[str, Mapping[str, Series]]) -> list[tuple[str, Mapping, str]]:
    """``(line label, metrics, metric key)`` of each line of one panel over runs ``{label: metrics}``."""
    return [(f"{label} ({suffix})" if suffix else label, metrics, key)
            for label, metrics in runs.items() for suffix, key in panel.select(metrics).items()]


def panel_lines(panel: Panel, runs: Mapping[str, Mapping[str, Series]]) -> dict[str, Series]:
    """``{line label: series}`` of one panel over runs ``{label: metrics}`` (runs without it left out)."""
    return {line: metrics[key] for line, metrics, key in _panel_keys(panel, runs)}


def panel_marks(panel: Panel, runs: Mapping[str, Mapping[str, Series]]) -> dict[str, list]:
    """``{line label: [(step, value)]}``: the non-finite values of each line of :func:`panel_lines`
    (lines without any left out)."""
    return {line: points for line, metrics, key in _panel_keys(panel, runs) if (points := _nonfinite(metrics, key))}


def _describe_points(points: Sequence[tuple]) -> str:
    """``"step 3 NaN, step 5 +inf"`` (the first 8, then how many more)."""
    shown = ", ".join(f"step {step} {nonfinite_kind(value)}" for step, value in points[:8])
    return shown + (f", ... ({len(points) - 8} more)" if len(points) > 8 else "")


def nonfinite_notes(runs: Mapping[str, Mapping[str, Series]]) -> list[str]:
    """One note per (run, plotted metric) with non-finite values: which steps, which values, where marked."""
    notes = []
    for label, metrics in runs.items():
        for panel in PANELS:
            for key in panel.select(metrics).values():
                if points := _nonfinite(metrics, key):
                    what = "not finite" if not any(v is not None and math.isfinite(v) for _, v in points) else \
                        "not finite or beyond +-1e300"
                    notes.append(f"{label}: {key} is {what} at {len(points)} step(s) ({_describe_points(points)}); "
                                 f"marked on '{panel.name}', left out of its line")
    return notes


#: how a non-finite value is marked on a panel: kind -> (marker, height in axes coordinates)
NONFINITE_MARKERS = {"NaN": ("x", 0.96), "NaN/inf (null)": ("x", 0.96), "+inf": ("^", 0.96), "-inf": ("v", 0.04),
                     "> 1e300": ("^", 0.96), "< -1e300": ("v", 0.04)}


def nonfinite_kind(value) -> str:
    """``"NaN"``, ``"+inf"``, ``"-inf"``, ``"NaN/inf (null)"`` for None (verl's file logger writes both as
    null), or ``"> 1e300"`` / ``"< -1e300"`` for a finite value beyond :data:`PLOT_LIMIT`."""
    if value is None:
        return "NaN/inf (null)"
    if math.isfinite(value):  # beyond PLOT_LIMIT
        return "> 1e300" if value > 0 else "< -1e300"
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def with_gaps(steps: Sequence[int], values: Sequence[float], points: Sequence[tuple]) -> tuple[list, list]:
    """``(steps, values)`` with a NaN at each step of ``points`` (non-finite values) that has no finite
    value, so that the drawn line breaks there instead of joining its neighbours."""
    gaps = {step for step, _ in points} - set(steps)
    merged = sorted([*zip(steps, values), *((step, math.nan) for step in gaps)], key=lambda p: p[0])
    return [step for step, _ in merged], [value for _, value in merged]


def draw_nonfinite(ax, label: str, points: Sequence[tuple], color: str) -> None:
    """Mark one line's non-finite values (:data:`NONFINITE_MARKERS`; height in axes coordinates, so the
    marks never move the y range): one Line2D per kind, labelled ``"<label>: <kind>"``."""
    for kind, (marker, height) in NONFINITE_MARKERS.items():
        steps = [step for step, value in points if nonfinite_kind(value) == kind]
        if steps:
            ax.plot(steps, [height] * len(steps), linestyle="none", marker=marker, color=color,
                    transform=ax.get_xaxis_transform(), clip_on=False, label=f"{label}: {kind}")


def missing_notes(runs: Mapping[str, Mapping[str, Series]]) -> list[str]:
    """One note per (run, panel) whose metric the run did not log."""
    return [f"{label}: no {panel.metric}; skipped in '{panel.name}'"
            for label, metrics in runs.items() for panel in PANELS if not panel.select(metrics)]


def draw_panel(ax, panel: Panel, lines: Mapping[str, Series], marks: Optional[Mapping[str, list]] = None,
               colors: Optional[Mapping[str, str]] = None) -> None:
    """Plot ``lines`` on ``ax`` as :func:`draw_bands` plots one seed each (a label ``"<run> (<suffix>)"``
    is the line ``suffix`` of ``run``, drawn in ``panel.styles[suffix]``); a "not logged" note naming
    the metric when there are no lines. ``colors``: :func:`label_colors`."""
    def split(label: str) -> tuple[str, str]:
        suffix = next((s for s in panel.styles or {} if label.endswith(f" ({s})")), "")
        return (label[: -len(suffix) - 3], suffix) if suffix else (label, "")

    bands = {split(label): Band(steps, values, values, values, [1] * len(steps)) for label, (steps, values) in lines.items()}
    draw_bands(ax, panel.title, bands, panel.log_scale, colors or label_colors([run for run, _ in bands]),
               {split(label): points for label, points in (marks or {}).items()}, panel.styles or {},
               title_size=10, missing=f"not logged\n({panel.metric})")


def _pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib  # matplotlib (seconds to import) loads only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt


def _grid(panels: int):
    """A Figure of ``panels`` axes, three a row (the spares of the last row hidden), and the axes."""
    rows = math.ceil(panels / 3)
    fig, axes = _pyplot().subplots(rows, 3, figsize=(15, 3.6 * rows), squeeze=False)
    for ax in axes.ravel()[panels:]:
        ax.set_visible(False)
    return fig, list(axes.ravel()[:panels])


def summary_figure(runs: Mapping[str, Mapping[str, Series]]):
    """A matplotlib Figure with one axes per entry of :data:`PANELS` (same order), then spares hidden."""
    fig, axes = _grid(len(PANELS))
    colors = label_colors(list(runs))
    for ax, panel in zip(axes, PANELS):
        draw_panel(ax, panel, panel_lines(panel, runs), panel_marks(panel, runs), colors)
    fig.tight_layout()
    return fig


def panel_figure(panel: Panel, lines: Mapping[str, Series], marks: Optional[Mapping[str, list]] = None,
                 colors: Optional[Mapping[str, str]] = None):
    """A one-axes Figure of one panel (``colors``: as :func:`draw_panel`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_panel(ax, panel, lines, marks, colors)
    ax.set_ylabel(panel.metric, fontsize=8)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    _pyplot().close(fig)
    return path


#: one colour per method (:mod:`recipe.stapo.methods`), the same in every panel and figure
METHOD_COLORS = {m.name: m.color for m in methods().values()}
_SPARE_COLORS = ("tab:gray", "tab:olive", "tab:cyan", "tab:pink", "tab:brown", "tab:purple")


def label_colors(labels: Sequence[str]) -> dict[str, str]:
    """One colour per label for a whole figure: a method's name (any case) gets the method's colour,
    every other label the next unused spare colour, in order."""
    known = {name.lower(): color for name, color in METHOD_COLORS.items()}
    colors = {label: known[label.lower()] for label in labels if label.lower() in known}
    spares = [c for c in dict.fromkeys(_SPARE_COLORS + tuple(METHOD_COLORS.values())) if c not in colors.values()]
    others = [label for label in dict.fromkeys(labels) if label not in colors]
    colors.update({label: spares[i % len(spares)] for i, label in enumerate(others)})
    return colors


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


#: the grad-norm panel's lines: (metric, line style, variant label)
GRAD_NORM_KEYS = (("actor/s2t/grad_norm_kept", "-", "kept"),
                  ("actor/s2t/grad_norm_kept_candidates", ":", "kept candidates"),
                  ("actor/s2t/grad_norm_silenced", "--", "silenced"))


def _grad_norm_keys(metrics: Mapping[str, Series]) -> dict[str, str]:
    """``{label: actor/s2t/grad_norm_<set>}`` for the sets the run logged (:data:`GRAD_NORM_KEYS` order)."""
    return {variant: key for key, _, variant in GRAD_NORM_KEYS if key in metrics}


#: the study panels of several lines: their variants, in legend order (any other panel has one line, variant "")
BAND_VARIANTS = {"grad_norm": [variant for *_, variant in GRAD_NORM_KEYS], "dlogp": [label for *_, label in DLOGP_SETS]}
#: panels of the study figure: (name, title, selector, log scale)
BAND_PANELS = (
    ("reward", "Training reward (critic/score/mean)", _first_of("critic/score/mean", "critic/rewards/mean"), False),
    ("val_accuracy", "Validation accuracy", _val_accuracy, False),
    ("entropy", "Mean entropy (actor/entropy)", _first_of("actor/entropy"), False),
    ("entropy_p95", "p95 entropy (actor/entropy_p95)", _first_of("actor/entropy_p95"), False),
    ("silenced_frac", "Silenced fraction (actor/s2t/silenced_frac)", _first_of("actor/s2t/silenced_frac"), True),
    ("grad_norm", "Closed-form grad norm\nsilenced (dashed), kept candidates (dotted), all kept (solid)",
     _grad_norm_keys, False),
    ("dlogp", "Log-prob change across the update\nsilenced (dashed), kept candidates (dotted), all (solid)",
     _dlogp_keys, False),
)


def _band_keys(name: str, metrics: Mapping[str, Series]) -> dict[str, str]:
    """``{variant: metric key}`` one run logged for study panel ``name`` (a one-line panel: its first key)."""
    keys = next(p[2] for p in BAND_PANELS if p[0] == name)(metrics)
    return keys if name in BAND_VARIANTS else {"": key for key in list(keys.values())[:1]}


def band_lines(name: str, groups: Mapping[str, Sequence[Mapping[str, Series]]]) -> dict[tuple[str, str], Band]:
    """``{(method, variant): Band}`` of one study panel over ``groups = {method: [metrics per seed]}``
    (methods without the metric left out; variant is "" except the :data:`GRAD_NORM_KEYS` labels for grad_norm)."""
    series: dict[tuple[str, str], list] = {}
    for method, runs in groups.items():
        for metrics in runs:
            for variant, key in _band_keys(name, metrics).items():
                series.setdefault((method, variant), []).append(metrics[key])
    return {(method, variant): band(series[(method, variant)])
            for method in groups for variant in BAND_VARIANTS.get(name, [""]) if (method, variant) in series}


def band_marks(name: str, groups: Mapping[str, Sequence[Mapping[str, Series]]]) -> dict[tuple[str, str], list]:
    """``{(method, variant): [(step, value)]}``: the non-finite values of each :func:`band_lines`
    entry over its seeds (steps ascending; entries without any left out)."""
    marks: dict[tuple[str, str], list] = {}
    for method, runs in groups.items():
        for metrics in runs:
            for variant, key in _band_keys(name, metrics).items():
                marks.setdefault((method, variant), []).extend(_nonfinite(metrics, key))
    return {line: sorted(points, key=lambda p: p[0]) for line, points in marks.items() if points}


def band_nonfinite_notes(groups: Mapping[str, Sequence[Mapping[str, Series]]]) -> list[str]:
    """One note per (method, seed, plotted metric) with non-finite values (seeds numbered from 1 in
    the order given)."""
    notes = []
    for method, runs in groups.items():
        for seed, metrics in enumerate(runs, start=1):
            for name, *_ in BAND_PANELS:
                for key in _band_keys(name, metrics).values():
                    if points := _nonfinite(metrics, key):
                        notes.append(f"{method} (run {seed} of {len(runs)}): {key} is not finite at {len(points)} "
                                     f"step(s) ({_describe_points(points)}); marked on '{name}', left out of the band")
    return notes


def draw_bands(ax, title: str, lines: Mapping[tuple[str, str], Band], log_scale: bool,
               colors: Mapping[str, str], marks: Optional[Mapping[tuple[str, str], list]] = None,
               styles: Optional[Mapping[str, str]] = None, title_size: int = 9, missing: str = "not logged") -> None:
    """One mean line (broken at :func:`with_gaps`, and a min-max band when several seeds) per entry,
    then its non-finite ``marks``; the ``missing`` note when there are no lines. ``styles``: line
    style per variant (default: the :data:`GRAD_NORM_KEYS` and :data:`DLOGP_SETS` ones)."""
    ax.set_title(title, fontsize=title_size)
    ax.set_xlabel("step")
    if not lines:
        ax.text(0.5, 0.5, missing, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="gray")
        return
    if styles is None:
        styles = {variant: style for _, style, variant in GRAD_NORM_KEYS}
        styles.update({label: style for _, _, style, label in DLOGP_SETS})
    marks = marks or {}
    for (method, variant), b in lines.items():
        color = colors[method]
        label = f"{method} ({variant})" if variant else method
        steps, mean = with_gaps(b.steps, b.mean, marks.get((method, variant), ()))
        ax.plot(steps, mean, styles.get(variant, "-"), color=color, label=label,
                marker="." if len(steps) < 30 else None)
        if b.seeds and max(b.seeds) > 1:
            ax.fill_between(b.steps, b.low, b.high, color=color, alpha=0.18, linewidth=0)
    for (method, variant), points in marks.items():
        draw_nonfinite(ax, f"{method} ({variant})" if variant else method, points, colors[method])
    if log_scale:
        positive = [v for b in lines.values() for v in b.mean + b.high if v > 0]
        ax.set_yscale("symlog", linthresh=min(positive) if positive else 1e-6)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def band_figure(groups: Mapping[str, Sequence[Mapping[str, Series]]]):
    """The study figure: one axes per :data:`BAND_PANELS` entry, bands = min-max over seeds."""
    fig, axes = _grid(len(BAND_PANELS))
    colors = label_colors(list(groups))
    for ax, (name, title, _, log_scale) in zip(axes, BAND_PANELS):
        draw_bands(ax, title, band_lines(name, groups), log_scale, colors, band_marks(name, groups))
    seeds = sorted({len(runs) for runs in groups.values()})
    fig.suptitle(f"mean over seeds ({'/'.join(map(str, seeds))} per method), band = min..max", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bands(groups: Mapping[str, Sequence[str | os.PathLike]], out_dir: str | os.PathLike,
               name: str = "study_curves.png", notes: Optional[list] = None) -> list[Path]:
    """Write the study figure (``out_dir/<name>``) from ``{method: [run folder per seed]}``; the
    non-finite-value notes go to stderr and, if ``notes`` is a list, into it."""
    check_output_folder("--out", Path(out_dir))
    loaded = {method: [read_metrics(find_metrics_file(run)) for run in runs] for method, runs in groups.items()}
    if not any(loaded.values()):
        raise ValueError("no runs to plot")
    _report(band_nonfinite_notes(loaded), notes)
    return [_save(band_figure(loaded), Path(out_dir) / name)]


@dataclass(frozen=True)
class Effect:
    """One token set's log-prob change across the updates of a run: ``mean`` = token-weighted mean
    over every step (None when no token was measured), ``tokens`` = how many."""

    mean: Optional[float]
    tokens: int


def update_effect_of_run(steps: Mapping[int, Mapping]) -> dict[str, Effect]:
    """``{set: Effect}`` for :data:`DLOGP_SETS` from one run's per-step records: each step's mean
    weighted by ``actor/s2t/dlogp_<set>_tokens``; non-finite steps left out."""
    out = {}
    for name, key, _, _ in DLOGP_SETS:
        total, count = 0.0, 0
        for data in steps.values():
            value, tokens = data.get(key), data.get(key + "_tokens")
            if isinstance(value, (int, float)) and isinstance(tokens, (int, float)) and math.isfinite(value) \
                    and tokens > 0:
                total += value * tokens
                count += int(tokens)
        out[name] = Effect(total / count if count else None, count)
    return out


def update_effect_figure(effects: Mapping[str, Sequence[Mapping[str, Effect]]],
                         colors: Optional[Mapping[str, str]] = None):
    """Per method (x), the run-level update effect of each token set (one marker shape each, tokens
    measured beside it): a dot per seed, the mean with a min-max whisker.
    ``effects = {method: [per-run effects]}``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.9 * len(effects) + 1.5), 4.2))
    order = list(effects)
    colors = colors or label_colors(order)
    offsets = {name: off for (name, *_), off in zip(DLOGP_SETS, (-0.22, 0.0, 0.22))}
    markers = {"silenced": "v", "kept_candidates": "o", "all": "s"}
    labelled = set()
    for x, method in enumerate(order):
        color = colors[method]
        for name, _, _, label in DLOGP_SETS:
            values = [run[name].mean for run in effects[method] if run[name].mean is not None]
            if not values:
                continue
            pos = x + offsets[name]
            ax.scatter([pos] * len(values), values, s=12, color=color, alpha=0.5, linewidths=0)
            mean = sum(values) / len(values)
            ax.errorbar([pos], [mean], yerr=[[mean - min(values)], [max(values) - mean]], fmt=markers[name],
                        color=color, markersize=7, capsize=3, markerfacecolor="white" if name == "all" else color)
            tokens = sum(run[name].tokens for run in effects[method])
            ax.annotate(f"{tokens:,}", (pos, mean), textcoords="offset points", xytext=(5, 0), fontsize=6,
                        color=color, va="center")
            labelled.add(label)
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(order)), order)
    ax.set_ylabel("mean change of log p across the update")
    seeds = sorted({len(runs) for runs in effects.values()})
    how = ("one run per method" if seeds == [1] else
           f"markers: mean over {'/'.join(map(str, seeds))} seeds, whiskers: min..max, dots: seeds")
    ax.set_title(f"What each update does to the tokens S2T singles out\n({how}; numbers: tokens measured)",
                 fontsize=9)
    from matplotlib.lines import Line2D  # matplotlib only when a figure is drawn (see _pyplot)

    shapes = [Line2D([], [], linestyle="none", marker=markers[name], color="black",
                     markerfacecolor="white" if name == "all" else "black", label=label)
              for name, _, _, label in DLOGP_SETS if label in labelled]
    ax.legend(handles=shapes, fontsize=8, title="token set (colour: method)", title_fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_update_effect(groups: Mapping[str, Sequence[str | os.PathLike]], out_dir: str | os.PathLike,
                       name: str = "update_effect.png") -> list[Path]:
    """Write :func:`update_effect_figure` (``out_dir/<name>``) from ``{method: [run folder per seed]}``;
    nothing when no run measured the update effect."""
    check_output_folder("--out", Path(out_dir))
    effects = {method: [update_effect_of_run(read_steps(find_metrics_file(run))) for run in runs]
               for method, runs in groups.items()}
    effects = {m: runs for m, runs in effects.items() if any(e.tokens for run in runs for e in run.values())}
    if not effects:
        return []
    return [_save(update_effect_figure(effects, label_colors(list(groups))), Path(out_dir) / name)]


def _report(found: Sequence[str], notes: Optional[list]) -> None:
    """Print each note to stderr and append them to ``notes`` when it is a list."""
    for note in found:
        print(f"note: {note}", file=sys.stderr)
    if notes is not None:
        notes.extend(found)


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
    labelled = _labelled(run_dirs)
    if not labelled:
        raise ValueError("no runs to plot")
    return {label: read_metrics(find_metrics_file(run))
            for label, run in tqdm(labelled.items(), desc="reading runs", unit="run", disable=not progress)}


def plot_runs(run_dirs: Mapping[str, Path] | Sequence[Path], out_dir: str | os.PathLike,
              notes: Optional[list] = None) -> list[Path]:
    """Write ``curves.png`` and one PNG per logged panel into ``out_dir`` (created if needed); return
    their paths. ``run_dirs``: ``{label: run folder or metrics file}``, or a list of them (labels:
    folder names); the notes go to stderr and, if ``notes`` is a list, into it."""
    out = Path(out_dir)
    check_output_folder("--out", out)
    runs = load_runs(run_dirs)
    _report(missing_notes(runs) + nonfinite_notes(runs), notes)
    written = [_save(summary_figure(runs), out / "curves.png")]
    colors = label_colors(list(runs))
    for panel in PANELS:
        lines = panel_lines(panel, runs)
        if lines:
            written.append(_save(panel_figure(panel, lines, panel_marks(panel, runs), colors), out / f"{panel.name}.png"))
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or their metrics .jsonl files)")
    parser.add_argument("--out", type=cli_path, required=True, help="folder for the PNG files")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: the run folder names)")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels: got {len(args.labels)} labels for {len(args.runs)} runs")
    if args.labels is not None and len(set(args.labels)) != len(args.labels):
        parser.error("--labels: labels must be distinct")
    runs = dict(zip(args.labels, args.runs)) if args.labels else args.runs
    try:
        labelled = _labelled(runs)
        for label, run in labelled.items():
            stopped = stopped_message(run)
            if stopped is None:
                continue
            try:
                logged = bool(read_steps(find_metrics_file(run)))
            except (OSError, ValueError):
                logged = False
            if not logged:
                raise ValueError(f"{run}: nothing to plot: {stopped}, before logging a step")
            print(f"note: {label}: {stopped}; its curves end where it stopped", file=sys.stderr)
        paths = plot_runs(labelled, args.out)
        paths += plot_update_effect({label: [run] for label, run in labelled.items()}, args.out)
    except (OSError, ValueError) as exc:  # OSError's message names its file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
