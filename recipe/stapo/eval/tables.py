"""The paper's Table 2 and its headline number, from run summaries or a markdown table.

CLI::

    python -m recipe.stapo.eval.tables INPUT... [--format markdown|latex] [--stapo-method STAPO] [--out FILE]
        [--allow-partial]

Each INPUT is a ``summary.json`` written by ``recipe.stapo.eval.run_eval`` (its ``scale`` and
``method`` label the row; override with ``SCALE:METHOD=path``), or a markdown file holding a
table in the paper's layout (``| model | method | AIME24 | ... | Avg |`` with cells
``"1.0/1.0 (0.7/0.9)"``, e.g. ``recipe/stapo/data/fixtures/paper_table2.md``).

Headline (the paper's evaluation protocol): per decoding setting, the mean over model scales of STAPO's
relative gain ``100 * (Avg_STAPO - Avg_best) / Avg_best`` where ``Avg_best`` is the highest Avg
among the other methods at that scale. The paper's printed Avg column is used when the input is
a table (that reproduces its +7.13%); :func:`inconsistent_rows` lists rows whose printed Avg
differs from the mean of their six cells.

A Table 2 row needs all six benchmarks under both decoding settings, as finite numbers, from a
full run. An input that is partial -- a smoke-test summary (``limit`` set, or ``complete: false``),
a benchmark or decoding setting missing, a value that is NaN, infinite or not a number -- is
refused with an error naming the file, the row and what is wrong. With ``--allow-partial`` such a
row is shown marked with a dagger (its unusable cells as "-"), never bolded, and left out of the
headline of the decoding settings it is partial in; every headline line names the rows (and the
scales) it left out and why, so it never silently compares STAPO with a weaker baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

COLUMNS = ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad")
AVG = "Avg"
BENCH_TO_COLUMN = {
    "aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23",
    "math500": "MATH500", "minerva": "Minerva", "olympiadbench": "Olympiad",
}
DECODING_ORDER = ("train", "justrl")
"""Decoding settings in cell order: "train" = 1.0/1.0 (outside parentheses), "justrl" = 0.7/0.9."""
DECODING_LABEL = {"train": "1.0/1.0", "justrl": "0.7/0.9"}
MARK = "\u2020"
"""Dagger appended to the method of a partial row (``--allow-partial``)."""
_CELL = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?|-|–)\s*(?:\(\s*([-+]?\d+(?:\.\d+)?|-|–)\s*\))?\s*$")


@dataclass
class Row:
    """One (scale, method) row: ``values[decoding][column]`` in percent (Avg included if known).

    ``issues[decoding]`` lists why the row is partial under that decoding setting (empty or absent:
    complete); ``source`` is the input it came from.
    """

    scale: str
    method: str
    values: dict[str, dict[str, float]] = field(default_factory=dict)
    issues: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""

    def partial(self, decoding: Optional[str] = None) -> bool:
        """Whether the row has issues under ``decoding`` (any decoding when None)."""
        if decoding is None:
            return any(self.issues.values())
        return bool(self.issues.get(decoding))

    def describe_issues(self, decoding: Optional[str] = None) -> str:
        """The row's issues (under ``decoding``, or all of them once each), joined by "; "."""
        found: list[str] = []
        for name in [decoding] if decoding else list(self.issues):
            found += [i for i in self.issues.get(name, []) if i not in found]
        return "; ".join(found)

    def value(self, decoding: str, column: str) -> Optional[float]:
        return self.values.get(decoding, {}).get(column)

    def recomputed_avg(self, decoding: str) -> Optional[float]:
        """Mean of the six benchmark cells (None unless all six are present)."""
        cells = [self.value(decoding, c) for c in COLUMNS]
        return None if any(v is None for v in cells) else sum(cells) / len(cells)

    def avg(self, decoding: str, printed: bool = True) -> Optional[float]:
        """The Avg cell (``printed``) or the recomputed mean when there is no printed one."""
        stored = self.value(decoding, AVG)
        return stored if printed and stored is not None else self.recomputed_avg(decoding)


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def _parse_cell(text: str, where: str) -> dict[str, float]:
    match = _CELL.match(text)
    if not match:
        raise ValueError(f"{where}: cannot read cell {text!r} (expected 'a (b)')")
    out = {}
    for decoding, part in zip(DECODING_ORDER, match.groups()):
        if part not in (None, "-", "–"):
            out[decoding] = float(part)
    return out


def parse_markdown_table(text: str, source: str = "<table>") -> list[Row]:
    """Rows of a paper-layout markdown table (header row names the columns; others ignored).

    Raises:
        ValueError: no table header, or an unreadable cell (names source, line and cell).
    """
    rows, header = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if len(cells) >= 3 and cells[0].lower() == "model" and cells[1].lower() == "method":
                header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        if len(cells) != len(header):
            raise ValueError(f"{source}: line {number}: {len(cells)} cells, header has {len(header)}")
        row = Row(scale=cells[0], method=cells[1], source=f"{source}: line {number}")
        for name, cell in zip(header[2:], cells[2:]):
            for decoding, value in _parse_cell(cell, f"{source}: line {number}, column {name}").items():
                row.values.setdefault(decoding, {})[name] = value
        row.issues = _missing_issues(row)
        rows.append(row)
    if header is None:
        raise ValueError(f"{source}: no '| model | method | ...' table header found")
    return rows


def _label(decoding: str) -> str:
    return DECODING_LABEL.get(decoding, decoding)


def _missing_issues(row: Row, unusable: Optional[dict[str, set]] = None) -> dict[str, list[str]]:
    """``{decoding: [issue]}`` for decoding settings without results or with benchmark cells missing
    (columns in ``unusable[decoding]`` already have their own issue)."""
    issues: dict[str, list[str]] = {}
    for decoding in DECODING_ORDER:
        values = row.values.get(decoding, {})
        skip = (unusable or {}).get(decoding, set())
        if not values and not skip:
            issues[decoding] = [f"no {_label(decoding)} results"]
            continue
        missing = [c for c in COLUMNS if c not in values and c not in skip]
        if missing:
            issues[decoding] = [f"missing {', '.join(missing)} ({_label(decoding)})"]
    return issues


def row_from_summary(summary: dict, source: str, label: Optional[tuple[str, str]] = None) -> Row:
    """A row from a run_eval ``summary.json`` dict, its issues listed in ``Row.issues``.

    Issues: ``limit`` set (smoke test), a decoding block with ``complete: false``, a decoding
    setting or benchmark missing, a ``mean_at_n`` that is not a finite number (that cell is left
    empty and no Avg is computed).

    Raises:
        ValueError: no scale/method label (pass ``SCALE:METHOD=path``), or no decodings.
    """
    scale, method = label or (summary.get("scale"), summary.get("method"))
    if not scale or not method:
        raise ValueError(f"{source}: summary has no scale/method; pass it as SCALE:METHOD={source}")
    if not summary.get("decodings"):
        raise ValueError(f"{source}: summary has no decodings")
    row = Row(scale=str(scale), method=str(method), source=source)
    issues: dict[str, list[str]] = {d: [] for d in DECODING_ORDER}
    unusable: dict[str, set] = {d: set() for d in DECODING_ORDER}
    limit = summary.get("limit")
    for decoding, block in summary["decodings"].items():
        values = {}
        for bench, result in (block.get("benchmarks") or {}).items():
            if bench not in BENCH_TO_COLUMN:
                continue
            column, value = BENCH_TO_COLUMN[bench], result.get("mean_at_n") if isinstance(result, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                issues.setdefault(decoding, []).append(f"{column} ({_label(decoding)}) is not a number")
            elif not math.isfinite(value):
                issues.setdefault(decoding, []).append(f"{column} ({_label(decoding)}) is not a finite number")
            else:
                values[column] = float(value)
                continue
            unusable.setdefault(decoding, set()).add(column)
        if all(c in values for c in COLUMNS):
            values[AVG] = sum(values[c] for c in COLUMNS) / len(COLUMNS)
        row.values[decoding] = values
    for decoding, found in _missing_issues(row, unusable).items():
        issues[decoding] += found
    for decoding in DECODING_ORDER:
        if limit is not None:
            issues[decoding].insert(0, f"limit={limit}: a smoke test on the first {limit} problems")
        block = summary["decodings"].get(decoding) or {}
        if block.get("complete") is False and not issues[decoding]:
            issues[decoding].append(f"complete=false ({_label(decoding)})")
    row.issues = {d: found for d, found in issues.items() if found}
    return row


def load_inputs(inputs: Sequence[str], allow_partial: bool = False) -> list[Row]:
    """Rows from summary.json files and/or markdown tables (``SCALE:METHOD=path`` relabels a summary).

    Raises:
        ValueError: a row is partial (see :func:`row_from_summary`; names every such input, row
            and issue) and ``allow_partial`` is False; unreadable or duplicate inputs.
    """
    rows = []
    for spec in inputs:
        label = None
        if "=" in spec and ":" in spec.split("=", 1)[0]:
            head, spec = spec.split("=", 1)
            label = tuple(head.split(":", 1))
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"table input not found: {path}")
        if path.suffix.lower() == ".json":
            try:
                summary = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc
            rows.append(row_from_summary(summary, str(path), label))
        else:
            rows.extend(parse_markdown_table(path.read_text(), str(path)))
    seen = set()
    for row in rows:
        if (row.scale, row.method) in seen:
            raise ValueError(f"duplicate row {row.scale} {row.method} among the inputs")
        seen.add((row.scale, row.method))
    partial = [r for r in rows if r.partial()]
    if partial and not allow_partial:
        listed = "; ".join(f"{r.source}: {r.scale} {r.method}: {r.describe_issues()}" for r in partial)
        raise ValueError(
            f"partial results refused: {listed}. Table 2 needs all six benchmarks under both decoding settings "
            "from full runs; pass --allow-partial to show such rows marked and left out of the headline"
        )
    return rows


# ----------------------------------------------------------------------------------------------
# analysis
# ----------------------------------------------------------------------------------------------
def _scale_key(scale: str) -> tuple:
    match = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([bBmM]?)", scale)
    if not match:
        return (1, 0.0, scale)
    factor = 1e-3 if match.group(2).lower() == "m" else 1.0
    return (0, float(match.group(1)) * factor, scale)


def scales(rows: Sequence[Row]) -> list[str]:
    """Distinct scales, smallest model first."""
    return sorted({r.scale for r in rows}, key=_scale_key)


def inconsistent_rows(rows: Sequence[Row], tol: float = 0.01) -> list[tuple[str, str, str, float, float]]:
    """``(scale, method, decoding, printed_avg, recomputed_avg)`` where they differ by more than ``tol``."""
    bad = []
    for row in rows:
        for decoding in DECODING_ORDER:
            printed, recomputed = row.value(decoding, AVG), row.recomputed_avg(decoding)
            if printed is not None and recomputed is not None and abs(printed - recomputed) > tol:
                bad.append((row.scale, row.method, decoding, printed, recomputed))
    return bad


@dataclass(frozen=True)
class ScaleGain:
    """STAPO's relative gain at one scale."""

    scale: str
    stapo_avg: float
    best_method: str
    best_avg: float

    @property
    def gain_pct(self) -> float:
        return 100.0 * (self.stapo_avg - self.best_avg) / self.best_avg


def headline(rows: Sequence[Row], decoding: str, stapo_method: str = "STAPO", printed: bool = True) -> tuple[Optional[float], list[ScaleGain]]:
    """Mean over scales of STAPO's relative gain (%) over the strongest other method.

    Only rows that are complete under ``decoding`` with a finite Avg count; scales without such a
    STAPO row, without such another method, or with a non-positive best Avg are skipped
    (:func:`left_out` names them). Returns ``(mean_gain_pct or None, per-scale gains)``.
    """
    gains = []
    for scale in scales(rows):
        at_scale = [r for r in _usable(rows, decoding, printed) if r.scale == scale]
        stapo = next((r for r in at_scale if r.method == stapo_method), None)
        others = [(r.avg(decoding, printed), r.method) for r in at_scale if r.method != stapo_method]
        if stapo is None or not others:
            continue
        best_avg, best_method = max(others)
        if best_avg <= 0:
            continue
        gains.append(ScaleGain(scale, stapo.avg(decoding, printed), best_method, best_avg))
    mean = sum(g.gain_pct for g in gains) / len(gains) if gains else None
    return mean, gains


def _finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def _usable(rows: Sequence[Row], decoding: str, printed: bool = True) -> list[Row]:
    """Rows that take part in the headline under ``decoding``: complete, with a finite Avg."""
    return [r for r in rows if not r.partial(decoding) and _finite(r.avg(decoding, printed))]


def left_out(rows: Sequence[Row], decoding: str, stapo_method: str = "STAPO", printed: bool = True) -> list[str]:
    """What the headline of ``decoding`` leaves out, and why: one ``"SCALE METHOD [reason]"`` per
    unusable row, then one ``"SCALE [reason]"`` per scale that has rows but gives no gain."""
    usable = _usable(rows, decoding, printed)
    notes = [
        f"{r.scale} {r.method} [{r.describe_issues(decoding) or f'no finite {_label(decoding)} Avg'}]"
        for r in rows
        if r not in usable
    ]
    gained = {g.scale for g in headline(rows, decoding, stapo_method, printed)[1]}
    for scale in scales(rows):
        at_scale = [r for r in usable if r.scale == scale]
        if scale in gained:
            continue
        if not any(r.method == stapo_method for r in at_scale):
            notes.append(f"{scale} [no usable {stapo_method} row]")
        elif not any(r.method != stapo_method for r in at_scale):
            notes.append(f"{scale} [no usable baseline]")
        else:
            notes.append(f"{scale} [best baseline Avg <= 0]")
    return notes


# ----------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------
def _best(rows: Sequence[Row], scale: str, decoding: str, column: str) -> Optional[float]:
    """Best value of a column at a scale among the rows complete under ``decoding``."""
    candidates = [r for r in rows if r.scale == scale and not r.partial(decoding)]
    values = [r.avg(decoding) if column == AVG else r.value(decoding, column) for r in candidates]
    values = [v for v in values if _finite(v)]
    return max(values) if values else None


def _fmt(value: Optional[float], best: Optional[float], bold: tuple[str, str]) -> str:
    if not _finite(value):
        return "-"
    text = f"{value:.2f}"
    return f"{bold[0]}{text}{bold[1]}" if best is not None and round(value, 2) == round(best, 2) else text


def render(rows: Sequence[Row], fmt: str = "markdown") -> str:
    """Table 2 layout: rows scale x method, cells ``"1.0/1.0 (0.7/0.9)"``, best per column and
    scale (and decoding) in bold among complete rows; a partial row's method carries :data:`MARK`."""
    if fmt not in ("markdown", "latex"):
        raise ValueError(f"--format must be markdown or latex, got {fmt!r}")
    bold = ("**", "**") if fmt == "markdown" else ("\\textbf{", "}")
    columns = (*COLUMNS, AVG)
    body = []
    for scale in scales(rows):
        for row in (r for r in rows if r.scale == scale):
            cells = []
            for column in columns:
                parts = []
                for decoding in DECODING_ORDER:
                    value = row.avg(decoding) if column == AVG else row.value(decoding, column)
                    best = None if row.partial(decoding) else _best(rows, scale, decoding, column)
                    parts.append(_fmt(value, best, bold))
                cells.append(f"{parts[0]} ({parts[1]})")
            body.append((scale, row.method, cells, row.partial()))
    if fmt == "markdown":
        lines = ["| model | method | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
        lines += [f"| {s} | {m}{' ' + MARK if p else ''} | " + " | ".join(c) + " |" for s, m, c, p in body]
        return "\n".join(lines) + "\n"
    lines = [
        "\\begin{tabular}{ll" + "c" * len(columns) + "}",
        "\\toprule",
        "Model & Method & " + " & ".join(columns) + " \\\\",
        "\\midrule",
    ]
    previous = None
    for s, m, c, p in body:
        if previous is not None and s != previous:
            lines.append("\\midrule")
        previous = s
        mark = "$^\\dagger$" if p else ""
        lines.append(f"{s} & {_latex_escape(m)}{mark} & " + " & ".join(c) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def _latex_escape(text: str) -> str:
    return re.sub(r"([&%$#_{}])", r"\\\1", text)


def report(rows: Sequence[Row], fmt: str = "markdown", stapo_method: str = "STAPO") -> str:
    """Table, partial-row notes, headline per decoding setting (naming what it left out) and
    average-consistency notes."""
    parts = [render(rows, fmt), ""]
    for row in rows:
        if row.partial():
            parts.append(f"{MARK} {row.scale} {row.method} is partial: {row.describe_issues()} ({row.source})")
    for decoding in DECODING_ORDER:
        mean, gains = headline(rows, decoding, stapo_method)
        missing = left_out(rows, decoding, stapo_method)
        tail = f"; left out: {', '.join(missing)}" if missing else ""
        if mean is None:
            parts.append(f"Headline {DECODING_LABEL[decoding]}: n/a (needs {stapo_method} and a baseline at some scale){tail}")
            continue
        detail = ", ".join(f"{g.scale}: {g.gain_pct:+.2f}% vs {g.best_method}" for g in gains)
        parts.append(
            f"Headline {DECODING_LABEL[decoding]}: {stapo_method} {mean:+.2f}% mean relative gain over the strongest "
            f"baseline ({detail}){tail}"
        )
    for scale, method, decoding, printed, recomputed in inconsistent_rows(rows):
        parts.append(
            f"Note: {scale} {method} {DECODING_LABEL[decoding]}: printed Avg {printed:.2f} != mean of cells {recomputed:.2f}"
        )
    return "\n".join(parts) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.eval.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="summary.json files ([SCALE:METHOD=]path) and/or markdown tables")
    parser.add_argument("--format", default="markdown", choices=["markdown", "latex"])
    parser.add_argument("--stapo-method", default="STAPO", help="method name whose gain is the headline")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    parser.add_argument(
        "--allow-partial", action="store_true",
        help="show partial inputs (smoke tests, missing benchmarks, non-finite values) marked, left out of the headline",
    )
    args = parser.parse_args(argv)
    try:
        text = report(load_inputs(args.inputs, args.allow_partial), args.format, args.stapo_method)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        from stapo_core.fileio import atomic_write_text

        atomic_write_text(args.out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
