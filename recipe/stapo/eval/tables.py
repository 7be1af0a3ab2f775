"""The paper's Table 2 and its headline number, from run summaries or a markdown table.

CLI::

    python -m recipe.stapo.eval.tables INPUT... [--format markdown|latex] [--stapo-method STAPO] [--out FILE]

Each INPUT is a ``summary.json`` written by ``recipe.stapo.eval.run_eval`` (its ``scale`` and
``method`` label the row; override with ``SCALE:METHOD=path``), or a markdown file holding a
table in the paper's layout (``| model | method | AIME24 | ... | Avg |`` with cells
``"1.0/1.0 (0.7/0.9)"``, e.g. ``recipe/stapo/data/fixtures/paper_table2.md``).

Headline (STAPO_SPEC.md section 6): per decoding setting, the mean over model scales of STAPO's
relative gain ``100 * (Avg_STAPO - Avg_best) / Avg_best`` where ``Avg_best`` is the highest Avg
among the other methods at that scale. The paper's printed Avg column is used when the input is
a table (that reproduces its +7.13%); :func:`inconsistent_rows` lists rows whose printed Avg
differs from the mean of their six cells.
"""

from __future__ import annotations

import argparse
import json
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
_CELL = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?|-|–)\s*(?:\(\s*([-+]?\d+(?:\.\d+)?|-|–)\s*\))?\s*$")


@dataclass
class Row:
    """One (scale, method) row: ``values[decoding][column]`` in percent (Avg included if known)."""

    scale: str
    method: str
    values: dict[str, dict[str, float]] = field(default_factory=dict)

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
        row = Row(scale=cells[0], method=cells[1])
        for name, cell in zip(header[2:], cells[2:]):
            for decoding, value in _parse_cell(cell, f"{source}: line {number}, column {name}").items():
                row.values.setdefault(decoding, {})[name] = value
        rows.append(row)
    if header is None:
        raise ValueError(f"{source}: no '| model | method | ...' table header found")
    return rows


def row_from_summary(summary: dict, source: str, label: Optional[tuple[str, str]] = None) -> Row:
    """A row from a run_eval ``summary.json`` dict.

    Raises:
        ValueError: no scale/method label (pass ``SCALE:METHOD=path``), or no decodings.
    """
    scale, method = label or (summary.get("scale"), summary.get("method"))
    if not scale or not method:
        raise ValueError(f"{source}: summary has no scale/method; pass it as SCALE:METHOD={source}")
    if not summary.get("decodings"):
        raise ValueError(f"{source}: summary has no decodings")
    row = Row(scale=str(scale), method=str(method))
    for decoding, block in summary["decodings"].items():
        values = {BENCH_TO_COLUMN[b]: v["mean_at_n"] for b, v in block.get("benchmarks", {}).items() if b in BENCH_TO_COLUMN}
        if all(c in values for c in COLUMNS):
            values[AVG] = sum(values[c] for c in COLUMNS) / len(COLUMNS)
        row.values[decoding] = values
    return row


def load_inputs(inputs: Sequence[str]) -> list[Row]:
    """Rows from summary.json files and/or markdown tables (``SCALE:METHOD=path`` relabels a summary)."""
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

    Scales without a STAPO row, without another method, or with a non-positive best Avg are
    skipped. Returns ``(mean_gain_pct or None, per-scale gains)``.
    """
    gains = []
    for scale in scales(rows):
        at_scale = [r for r in rows if r.scale == scale]
        stapo = next((r for r in at_scale if r.method == stapo_method), None)
        others = [(r.avg(decoding, printed), r.method) for r in at_scale if r.method != stapo_method]
        others = [(a, m) for a, m in others if a is not None]
        if stapo is None or stapo.avg(decoding, printed) is None or not others:
            continue
        best_avg, best_method = max(others)
        if best_avg <= 0:
            continue
        gains.append(ScaleGain(scale, stapo.avg(decoding, printed), best_method, best_avg))
    mean = sum(g.gain_pct for g in gains) / len(gains) if gains else None
    return mean, gains


# ----------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------
def _best(rows: Sequence[Row], scale: str, decoding: str, column: str) -> Optional[float]:
    values = [r.avg(decoding) if column == AVG else r.value(decoding, column) for r in rows if r.scale == scale]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _fmt(value: Optional[float], best: Optional[float], bold: tuple[str, str]) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}"
    return f"{bold[0]}{text}{bold[1]}" if best is not None and round(value, 2) == round(best, 2) else text


def render(rows: Sequence[Row], fmt: str = "markdown") -> str:
    """Table 2 layout: rows scale x method, cells ``"1.0/1.0 (0.7/0.9)"``, best per column and
    scale (and decoding) in bold."""
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
                    parts.append(_fmt(value, _best(rows, scale, decoding, column), bold))
                cells.append(f"{parts[0]} ({parts[1]})")
            body.append((scale, row.method, cells))
    if fmt == "markdown":
        lines = ["| model | method | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
        lines += [f"| {s} | {m} | " + " | ".join(c) + " |" for s, m, c in body]
        return "\n".join(lines) + "\n"
    lines = [
        "\\begin{tabular}{ll" + "c" * len(columns) + "}",
        "\\toprule",
        "Model & Method & " + " & ".join(columns) + " \\\\",
        "\\midrule",
    ]
    previous = None
    for s, m, c in body:
        if previous is not None and s != previous:
            lines.append("\\midrule")
        previous = s
        lines.append(f"{s} & {_latex_escape(m)} & " + " & ".join(c) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def _latex_escape(text: str) -> str:
    return re.sub(r"([&%$#_{}])", r"\\\1", text)


def report(rows: Sequence[Row], fmt: str = "markdown", stapo_method: str = "STAPO") -> str:
    """Table, headline per decoding setting and average-consistency notes."""
    parts = [render(rows, fmt), ""]
    for decoding in DECODING_ORDER:
        mean, gains = headline(rows, decoding, stapo_method)
        if mean is None:
            parts.append(f"Headline {DECODING_LABEL[decoding]}: n/a (needs {stapo_method} and a baseline at some scale)")
            continue
        detail = ", ".join(f"{g.scale}: {g.gain_pct:+.2f}% vs {g.best_method}" for g in gains)
        parts.append(f"Headline {DECODING_LABEL[decoding]}: {stapo_method} {mean:+.2f}% mean relative gain over the strongest baseline ({detail})")
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
    args = parser.parse_args(argv)
    try:
        text = report(load_inputs(args.inputs), args.format, args.stapo_method)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        from recipe.stapo.data.fileio import atomic_write_text

        atomic_write_text(args.out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
