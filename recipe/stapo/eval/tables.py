"""The paper's Table 2 and its headline number, from run summaries or a markdown table.

Rows are refused, not silently averaged, when partial or of another protocol than the table's:
a headline over mixed rows would not be the paper's number. docs/eval.md ("Build Table 2") gives
the inputs, the headline's formula and the whole contract.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from recipe.stapo.data.prepare import PROMPT_SUFFIX
from stapo_core.fileio import atomic_write, check_output_file, check_regular, cli_path

COLUMNS = ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad")
AVG = "Avg"
BENCH_TO_COLUMN = {
    "aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23",
    "math500": "MATH500", "minerva": "Minerva", "olympiadbench": "Olympiad",
}
DECODING_ORDER = ("train", "justrl")  # cell order: "1.0/1.0 (0.7/0.9)"
DECODING_LABEL = {"train": "1.0/1.0", "justrl": "0.7/0.9"}
MARK = "\u2020"  # after the method of a partial row
MIXED_MARK = "\u2021"  # after the method of a row with another protocol
GRADINGS = ("as-run", "rule-only")
PRINTED = "a printed table (protocol not recorded)"
UNRECORDED_FORM = "unrecorded (a summary from before prompt forms were recorded)"
EVAL_FORM = "justrl-eval"  # the prompt form of Table 2's rows: JustRL's evaluation prompt
EVAL_PROMPT = f"JustRL's evaluation prompt ({EVAL_FORM}: the problem, one space, \"{PROMPT_SUFFIX}\")"
_CELL = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?|-|–)\s*(?:\(\s*([-+]?\d+(?:\.\d+)?|-|–)\s*\))?\s*$")


@dataclass
class Row:
    """One (scale, method) row: ``values[decoding][column]`` in percent (Avg included if known);
    ``issues[decoding]`` lists why the row is partial under that decoding setting."""

    scale: str
    method: str
    values: dict[str, dict[str, float]] = field(default_factory=dict)
    issues: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""
    protocol: dict[str, object] = field(default_factory=dict)
    protocol_issues: list[str] = field(default_factory=list)
    grading: str = PRINTED
    prompt: str = PRINTED

    def partial(self, decoding: Optional[str] = None) -> bool:
        """Whether the row has issues under ``decoding`` (any decoding when None)."""
        if decoding is None:
            return any(self.issues.values())
        return bool(self.issues.get(decoding))

    def excluded(self, decoding: Optional[str] = None) -> bool:
        """Whether the row stays out of bolding and the headline: partial, or another protocol."""
        return self.partial(decoding) or bool(self.protocol_issues)

    def describe_issues(self, decoding: Optional[str] = None) -> str:
        """The row's issues (under ``decoding``, or all of them once each) and its protocol
        differences, joined by "; "."""
        found: list[str] = []
        for name in [decoding] if decoding else list(self.issues):
            found += [i for i in self.issues.get(name, []) if i not in found]
        return "; ".join(found + self.protocol_issues)

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
    """Rows of a paper-layout markdown table (header row names the columns; others ignored)."""
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
        row = Row(scale=cells[0].strip(), method=cells[1].strip(), source=f"{source}: line {number}", protocol={"protocol": PRINTED})
        bad: dict[str, list[str]] = {}
        unusable: dict[str, set] = {}
        for name, cell in zip(header[2:], cells[2:]):
            for decoding, value in _parse_cell(cell, f"{source}: line {number}, column {name}").items():
                problem = _cell_issue(name, decoding, value)
                if problem:
                    bad.setdefault(decoding, []).append(problem)
                    unusable.setdefault(decoding, set()).add(name)
                else:
                    row.values.setdefault(decoding, {})[name] = value
        row.issues = _merge_issues(bad, _missing_issues(row, unusable), _fraction_issues(row))
        rows.append(row)
    if header is None:
        raise ValueError(f"{source}: no '| model | method | ...' table header found")
    return rows


def _label(decoding: str) -> str:
    return DECODING_LABEL.get(decoding, decoding)


def _cell_issue(column: str, decoding: str, value: object) -> Optional[str]:
    """Why the cell's ``value`` is no mean@N in percent: not a number, not finite, or not in [0, 100]
    (None when it is one)."""
    where = f"{column} ({_label(decoding)})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{where} is not a number"
    if not math.isfinite(value):
        return f"{where} is not a finite number"
    return None if 0.0 <= value <= 100.0 else f"{where} = {value:g} is not a percentage in [0, 100]"


def _whole_samples(value: float, total: Optional[int]) -> bool:
    """Whether ``value`` percent of ``total`` samples is a whole number of samples."""
    if not total:
        return False
    hits = value * total / 100.0
    return abs(hits - round(hits)) <= 1e-6 * max(1.0, hits)


def _fraction_issues(row: Row, samples: Optional[dict[tuple[str, str], int]] = None) -> dict[str, list[str]]:
    """Issues of values in (0, 1] that read as fractions, not percentages: a row whose nonzero values
    are all at most 1 (mean@N fractions; no model of these tables scores <= 1% on MATH500) gets one
    for every decoding setting, a cell in (0, 1] among percentages (``0.55`` for 55%) one of its own.
    Zeros are no evidence (a model that solves nothing scores 0 in both units), nor is a cell of a
    run summary that is a whole number of correct samples out of ``samples[(decoding, column)]``
    (problems times N: ``0.83`` = 8 of 960 samples is a genuine small mean@N)."""
    small = [(d, c, v) for d, block in row.values.items() for c, v in block.items()
             if c != AVG and 0.0 < v <= 1.0 and not _whole_samples(v, (samples or {}).get((d, c)))]
    if not small:
        return {}
    if max(v for block in row.values.values() for v in block.values()) <= 1.0:
        return {d: ["every nonzero value is <= 1: fractions, not percentages? Table 2 takes mean@N in percent"]
                for d in DECODING_ORDER}
    issues: dict[str, list[str]] = {}
    for decoding, column, value in small:
        issues.setdefault(decoding, []).append(
            f"{column} ({_label(decoding)}) = {value:g} is <= 1 among percentages: a fraction, not a percentage? "
            "Table 2 takes mean@N in percent")
    return issues


def _merge_issues(*parts: dict[str, list[str]]) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for part in parts:
        for decoding, found in part.items():
            merged.setdefault(decoding, []).extend(i for i in found if i not in merged.get(decoding, []))
    return {d: found for d, found in merged.items() if found}


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


def grading_of(summary: dict, grading: str = "as-run") -> tuple[str, str]:
    """``(key, description)`` of the grading of a summary's values under ``grading`` (``as-run``
    or ``rule-only``); a summary without a grading record gets a key naming its ``verifier``."""
    record = summary.get("grading") if isinstance(summary.get("grading"), dict) else None
    if record is None:
        verifier = summary.get("verifier", "none")
        if grading == "rule-only" or verifier in (None, "none"):
            return "rule-only (unrecorded rule)", "rule-only (lenient rule; summary without a grading record)"
        return f"rule+verifier {verifier} (unrecorded)", f"lenient rule, then the {verifier} verifier (unrecorded)"
    if grading == "rule-only":
        grader = record.get("grader") if isinstance(record.get("grader"), dict) else {}
        name = grader.get("grader", "an unrecorded grader")
        name = "JustRL's grader" if name == "justrl" else f"{name} grader"
        return (f"rule-only {str(record.get('grader_key', 'unrecorded'))[:12]}",
                f"rule-only: {name}, no verifier (not the paper's grading)")
    label = record.get("label", "?")
    return f"{label} {record.get('key', '?')[:12]}", str(record.get("description", label))


def grading_protocol_of(summary: dict) -> str:
    """The grading protocol a summary records (``justrl``, ``compassverifier``), or ``unnamed`` for
    a summary written before protocols were named (lenient grader, the policy's whole user message)."""
    record = summary.get("grading") if isinstance(summary.get("grading"), dict) else {}
    return str(record.get("protocol") or "unnamed")


def protocol_of(summary: dict, grading: str = "as-run") -> dict[str, object]:
    """The protocol fields of a summary, each compared across the rows of a table: ``protocol``
    (recorded, against a printed table's unrecorded one), ``max_new_tokens``, ``grading``, ``decoding <label>``
    (temperature/top-p), ``N (<column>)``, ``problems (<column>)`` (count and content hash; under
    the first decoding that has it)."""
    protocol: dict[str, object] = {
        "protocol": "recorded in a run summary",
        "max_new_tokens": summary.get("max_new_tokens"),
        "grading": grading_of(summary, grading)[0],
        "grading protocol": grading_protocol_of(summary),
    }
    for decoding, block in (summary.get("decodings") or {}).items():
        if not isinstance(block, dict):
            continue
        protocol[f"decoding {_label(decoding)}"] = f"temperature {block.get('temperature')}, top-p {block.get('top_p')}"
        for bench, result in (block.get("benchmarks") or {}).items():
            if isinstance(result, dict):
                column = BENCH_TO_COLUMN.get(bench, bench)
                protocol[f"N ({column}, {_label(decoding)})"] = result.get("n_samples")
                data = result.get("data_sha256")
                protocol.setdefault(f"problems ({column})", f"{result.get('problems')}" + (f" [{data[:12]}]" if data else ""))
    return protocol


def row_from_summary(summary: dict, source: str, label: Optional[tuple[str, str]] = None, grading: str = "as-run") -> Row:
    """A row from a run_eval ``summary.json`` dict, its issues (what makes it partial, as docs/eval.md
    lists them; an unusable cell is left empty and no Avg is computed) in ``Row.issues``."""
    scale, method = label or (summary.get("scale"), summary.get("method"))
    if not scale or not method:
        raise ValueError(f"{source}: summary has no scale/method; pass it as SCALE:METHOD={source}")
    if any(char in str(scale) + str(method) for char in "|\n\r"):  # each would cut the Markdown table's row
        raise ValueError(f"{source}: scale {scale!r} / method {method!r} holds a '|' or a line break; relabel it as "
                         f"SCALE:METHOD={source}")
    if not summary.get("decodings"):
        raise ValueError(f"{source}: summary has no decodings")
    if not isinstance(summary["decodings"], dict):
        raise ValueError(f"{source}: 'decodings' is a {type(summary['decodings']).__name__}, not an object of "
                         "decoding settings; not a summary written by recipe.stapo.eval.run_eval")
    for decoding, block in summary["decodings"].items():
        if not isinstance(block, dict) or not isinstance(block.get("benchmarks", {}), (dict, type(None))):
            what = block if not isinstance(block, dict) else block.get("benchmarks")
            where = f"decodings.{decoding}" + ("" if not isinstance(block, dict) else ".benchmarks")
            raise ValueError(f"{source}: {where} is {json.dumps(what)[:40]} ({type(what).__name__}), not an object; "
                             "not a summary written by recipe.stapo.eval.run_eval (rerun the evaluation or fix the file)")
    key = "grader_mean_at_n" if grading == "rule-only" else "mean_at_n"
    form = summary.get("prompt_form", UNRECORDED_FORM)
    row = Row(scale=str(scale).strip(), method=str(method).strip(), source=source, protocol=protocol_of(summary, grading),
              grading=grading_of(summary, grading)[1], prompt=EVAL_PROMPT if form == EVAL_FORM else f"prompt form {form}")
    issues: dict[str, list[str]] = {d: [] for d in DECODING_ORDER}
    unusable: dict[str, set] = {d: set() for d in DECODING_ORDER}
    limit = summary.get("limit")
    samples: dict[tuple[str, str], int] = {}
    for decoding, block in summary["decodings"].items():
        values = {}
        for bench, result in (block.get("benchmarks") or {}).items():
            column = BENCH_TO_COLUMN.get(bench, bench)
            result = result if isinstance(result, dict) else {}  # not an object: its value is not a number
            counts = [result.get("problems"), result.get("n_samples")]
            if all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts):
                samples[(decoding, column)] = counts[0] * counts[1]
            if grading == "rule-only" and key not in result:
                raise ValueError(f"{source}: {bench} ({_label(decoding)}) has no grader_mean_at_n (a summary from an "
                                 "older version); rerun eval.sh on its folder (generations are reused)")
            value = result.get(key)
            if limit is None:
                limit = result.get("limit")
            ungraded = result.get("ungraded")
            if isinstance(ungraded, int) and not isinstance(ungraded, bool) and ungraded > 0:
                issues.setdefault(decoding, []).append(
                    f"{column} ({_label(decoding)}): {ungraded} answers ungraded (their check could not run; rerun "
                    "eval.sh on its folder to grade them)")
            problem = _cell_issue(column, decoding, value)
            if problem:
                issues.setdefault(decoding, []).append(problem)
                unusable.setdefault(decoding, set()).add(column)
            else:
                values[column] = float(value)
        if all(c in values for c in COLUMNS):
            values[AVG] = sum(values[c] for c in COLUMNS) / len(COLUMNS)
        row.values[decoding] = values
    for decoding, found in _merge_issues(_missing_issues(row, unusable), _fraction_issues(row, samples)).items():
        issues[decoding] += found
    for decoding in DECODING_ORDER:
        if limit is not None:
            issues[decoding].insert(0, f"limit={limit}: a smoke test on the first {limit} problems")
        if form != EVAL_FORM:
            issues[decoding].append(f"prompt form {form}, not JustRL's evaluation prompt ({EVAL_FORM})")
        block = summary["decodings"].get(decoding) or {}
        if block.get("complete") is False and not issues[decoding]:
            issues[decoding].append(f"complete=false ({_label(decoding)})")
    row.issues = {d: found for d, found in issues.items() if found}
    return row


def check_protocol(rows: Sequence[Row]) -> None:
    """Set ``protocol_issues`` of every row whose protocol differs from the table's: per field, the
    value more than half of the rows have; without such a majority every row that has the field is
    marked (docs/eval.md, "One protocol per table"). A field a row lacks is not compared: that row is
    partial anyway."""
    for row in rows:
        row.protocol_issues = []
    for name in dict.fromkeys(f for row in rows for f in row.protocol):
        having = [row for row in rows if name in row.protocol]
        counts = Counter(json.dumps(row.protocol[name], sort_keys=True) for row in having)
        if len(counts) == 1:
            continue
        majority = [key for key, count in counts.items() if 2 * count > len(having)]
        if majority:
            reference = json.loads(majority[0])
            for row in having:
                if row.protocol[name] != reference:
                    row.protocol_issues.append(f"{name} is {_shown(row.protocol[name], reference)}, "
                                               f"the table's is {_shown(reference, row.protocol[name])}")
            continue
        distinct = [json.loads(key) for key in counts]
        for row in having:
            others = ", ".join(_shown(v, row.protocol[name]) for v in distinct if v != row.protocol[name])
            row.protocol_issues.append(f"{name} is {_shown(row.protocol[name], distinct[0])}, other rows have {others} "
                                       "(no value shared by most rows)")


def _shown(value: object, other: object) -> str:
    """``value`` as a protocol message writes it: as is, or with its type when it reads the same
    as ``other`` (the text ``'32'`` beside the number ``32``)."""
    if str(value) == str(other) and value != other:
        return f"{value!r} ({type(value).__name__})"
    return str(value)


def load_inputs(inputs: Sequence[str], allow_partial: bool = False, allow_mixed_protocol: bool = False,
                grading: str = "as-run") -> list[Row]:
    """Rows from summary.json files and/or markdown tables (``SCALE:METHOD=path`` relabels a summary).
    ``allow_mixed_protocol`` never admits rule-only rows beside verified ones."""
    if grading not in GRADINGS:
        raise ValueError(f"--grading must be one of {list(GRADINGS)}, got {grading!r}")
    rows = []
    for spec in inputs:
        label = None
        if "=" in spec and ":" in spec.split("=", 1)[0]:
            head, spec = spec.split("=", 1)
            label = tuple(part.strip() for part in head.split(":", 1))
        path = Path(spec)
        check_regular(path, follow=True)  # a FIFO, device or folder: named as such
        if not path.is_file():
            raise FileNotFoundError(f"table input not found: {path}")
        is_summary = path.suffix.lower() == ".json"
        if not is_summary and grading == "rule-only":
            raise ValueError(f"{path}: --grading rule-only needs summary.json inputs (a printed table has one grading)")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            expected = "not a summary written by recipe.stapo.eval.run_eval" if is_summary else "expected a markdown table"
            raise ValueError(f"{path}: not UTF-8 text (byte {exc.start + 1}); {expected}") from None
        if not is_summary:
            rows.extend(parse_markdown_table(text, str(path)))
            continue
        try:
            summary = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc
        if not isinstance(summary, dict):
            raise ValueError(f"{path}: not a summary (a JSON object)")
        rows.append(row_from_summary(summary, str(path), label, grading))
    seen = set()
    for row in rows:
        if (row.scale, row.method) in seen:
            raise ValueError(f"duplicate row {row.scale} {row.method} among the inputs")
        seen.add((row.scale, row.method))
    labels = {str(r.protocol.get("grading", "")).split(" ")[0] for r in rows}
    if {"rule-only", "rule+verifier"} <= labels:
        listed = _listed(rows, lambda r: str(r.protocol.get("grading", "")).split(" ")[0], "grading")
        raise ValueError(
            f"rule-only and verifier-graded rows are never mixed in one table: {listed}. Evaluate the rule-only "
            "runs with the verifier (rerun eval.sh on their folders: generations are reused), or pass "
            "--grading rule-only for a rule-only table of every row"
        )
    protocols = {r.protocol["grading protocol"] for r in rows if "grading protocol" in r.protocol}
    if len(protocols) > 1:
        listed = _listed(rows, lambda r: r.protocol["grading protocol"], "grading protocol")
        raise ValueError(
            f"rows graded under different grading protocols are never mixed in one table: {listed}. Rerun "
            "eval.sh on the odd folders with the table's --grading-protocol (generations are reused)"
        )
    partial = [r for r in rows if r.partial()]
    if partial and not allow_partial:
        listed = _listed(partial, Row.describe_issues)
        raise ValueError(
            f"partial results refused: {listed}. Table 2 needs all six benchmarks under both decoding settings "
            "from full runs; pass --allow-partial to show such rows marked and left out of the headline"
        )
    check_protocol(rows)
    mixed = [r for r in rows if r.protocol_issues]
    if mixed and not allow_mixed_protocol:
        listed = _listed(mixed, lambda r: "; ".join(r.protocol_issues))
        raise ValueError(
            f"rows with another protocol refused: {listed}. Rows of one table share N per benchmark, decoding, "
            "max_new_tokens and grading (a changed answer grader or verifier: rerun eval.sh on the older folders to regrade, "
            "generations and cached verdicts are reused); pass --allow-mixed-protocol to show such rows marked "
            "and left out of the headline"
        )
    return rows


def _listed(rows: Sequence[Row], what: Callable[[Row], object], field: Optional[str] = None) -> str:
    """``"<source>: <scale> <method>: <what(row)>"`` of each row (that has protocol ``field``), joined by "; "."""
    return "; ".join(f"{r.source}: {r.scale} {r.method}: {what(r)}" for r in rows if field is None or field in r.protocol)


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
    """``(mean over scales of STAPO's relative gain in % or None, per-scale gains)``; a scale
    without a usable STAPO row and baseline is skipped (:func:`left_out` names it)."""
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
    """Rows that take part in the headline under ``decoding``: complete, of the table's protocol,
    with a finite Avg."""
    return [r for r in rows if not r.excluded(decoding) and _finite(r.avg(decoding, printed))]


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
    """Best value of a column at a scale among the rows complete under ``decoding`` and of the
    table's protocol."""
    candidates = [r for r in rows if r.scale == scale and not r.excluded(decoding)]
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
    scale (and decoding) in bold among complete rows of the table's protocol; a partial row's
    method carries :data:`MARK`, a row of another protocol :data:`MIXED_MARK`. A benchmark outside
    the six gets a column of its own after Avg (not in Avg)."""
    if fmt not in ("markdown", "latex"):
        raise ValueError(f"--format must be markdown or latex, got {fmt!r}")
    bold = ("**", "**") if fmt == "markdown" else ("\\textbf{", "}")
    others = sorted({c for r in rows for block in r.values.values() for c in block} - {*COLUMNS, AVG})
    columns = (*COLUMNS, AVG, *others)
    body = []
    for scale in scales(rows):
        for row in (r for r in rows if r.scale == scale):
            cells = []
            for column in columns:
                parts = []
                for decoding in DECODING_ORDER:
                    value = row.avg(decoding) if column == AVG else row.value(decoding, column)
                    best = None if row.excluded(decoding) else _best(rows, scale, decoding, column)
                    parts.append(_fmt(value, best, bold))
                cells.append(f"{parts[0]} ({parts[1]})")
            marks = (MARK if row.partial() else "") + (MIXED_MARK if row.protocol_issues else "")
            body.append((scale, row.method, cells, marks))
    if fmt == "markdown":
        return markdown_table(["model", "method", *columns], [[s, m + (" " + p if p else ""), *c] for s, m, c, p in body]) + "\n"
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
        mark = ("$^\\dagger$" if MARK in p else "") + ("$^\\ddagger$" if MIXED_MARK in p else "")
        lines.append(f"{s} & {_latex_escape(m)}{mark} & " + " & ".join(c) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table: the header row, its rule, one line per row (each cell as ``str`` gives it, no escaping)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def _latex_escape(text: str) -> str:
    return re.sub(r"([&%$#_{}])", r"\\\1", text)


def report(rows: Sequence[Row], fmt: str = "markdown", stapo_method: str = "STAPO") -> str:
    """Table, partial-row notes, headline per decoding setting (naming what it left out) and
    average-consistency notes."""
    parts = [render(rows, fmt), ""]
    for name, values in (("Prompt", [r.prompt for r in rows]), ("Grading", [r.grading for r in rows])):
        shared = [v for r, v in zip(rows, values) if not r.protocol_issues] or values
        parts.append(f"{name}: {max(set(shared), key=shared.count)}")
    for row in rows:
        if row.partial():
            parts.append(f"{MARK} {row.scale} {row.method} is partial: {'; '.join(dict.fromkeys(i for v in row.issues.values() for i in v))} ({row.source})")
        if row.protocol_issues:
            parts.append(f"{MIXED_MARK} {row.scale} {row.method} has another protocol: {'; '.join(row.protocol_issues)} "
                         f"(grading: {row.grading}; {row.source})")
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
    parser.add_argument("--out", type=cli_path, default=None, help="also write the report to this file")
    parser.add_argument(
        "--allow-partial", action="store_true",
        help="show partial inputs (smoke tests, missing benchmarks, non-finite values) marked, left out of the headline",
    )
    parser.add_argument(
        "--allow-mixed-protocol", action="store_true",
        help="show rows of another protocol (N, decoding, max_new_tokens, grading) marked, left out of the headline",
    )
    parser.add_argument("--grading", default="as-run", choices=list(GRADINGS),
                        help="as-run: each summary's grading (rows must share it); rule-only: every row's rule-only mean@N")
    args = parser.parse_args(argv)
    try:
        if args.out:
            check_output_file("--out", args.out)
        rows = load_inputs(args.inputs, args.allow_partial, args.allow_mixed_protocol, args.grading)
        text = report(rows, args.format, args.stapo_method)
        if args.out:
            atomic_write(args.out, text)
    except (ValueError, OSError) as exc:  # an OSError of writing --out names the file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
