"""verl's per-step metrics file: where a run's is, and how it is read (the one reader of the project).

verl's ``FileLogger`` (``verl/utils/tracking.py``) writes ``{"step": <int>, "data": {<metric>: <value>, ...}}``
per line to ``$VERL_FILE_LOGGER_PATH``, or else to ``$VERL_FILE_LOGGER_ROOT/<project_name>/<experiment_name>.jsonl``
(root default: the working directory). The recipe's CPU path sets ``VERL_FILE_LOGGER_PATH=RUN_DIR/metrics.jsonl``.

So a run is found (:func:`find_metrics_file`) as: ``RUN_DIR`` itself when it is a file; else
``RUN_DIR/metrics.jsonl``; else the single ``*.jsonl`` file under ``RUN_DIR`` (searched recursively, the
token dump excluded) whose first line is a step record. Several such files is an error that lists them.

:func:`read_metrics` accepts verl's lines and flat ``{"step": s, "<metric>": v, ...}`` lines. A blank or
malformed line is an error naming the file and line, except a truncated last line (a run killed or still
writing), which is skipped with a warning. Repeated steps (e.g. validation logged separately) merge; for one
metric the later value wins. A diverged metric (NaN or infinite) is written as ``null`` by verl's file logger
(orjson) and as ``NaN`` / ``Infinity`` by Python's json: :func:`metric_series` keeps the finite values,
:func:`nonfinite_values` lists the others.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

from stapo_core.checks import is_number
from stapo_core.fileio import check_regular, iter_jsonl, open_regular
from stapo_core.token_records import TOKEN_DUMP_DIR

#: where the recipe's CPU path points verl's file logger
METRICS_FILE = "metrics.jsonl"

#: a metric's series: steps (ascending) and values, same length
Series = tuple[list[int], list[float]]


def _is_step_record(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("step"), int) and not isinstance(obj.get("step"), bool)


def _first_record(path: Path):
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), encoding="utf-8") as handle:
            return json.loads(handle.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def find_metrics_file(run: str | os.PathLike) -> Path:
    """The file-logger JSONL of a run (rule in the module docstring).

    Raises:
        FileNotFoundError: no run folder, or no step-record JSONL in it.
        ValueError: several candidate files (they are listed).
    """
    run = Path(run)
    if run.is_file():
        return run
    if not run.is_dir():
        check_regular(run, follow=True)  # a FIFO or device: named as such
        raise FileNotFoundError(f"{run}: no such run folder or metrics file")
    if (run / METRICS_FILE).is_file():
        return run / METRICS_FILE
    found = sorted(
        p for p in run.rglob("*.jsonl")
        if TOKEN_DUMP_DIR not in p.relative_to(run).parts and _is_step_record(_first_record(p))
    )
    if not found:
        raise FileNotFoundError(f"{run}: no metrics JSONL (neither {METRICS_FILE} nor any *.jsonl "
                                f"of {{'step', 'data'}} lines); run with trainer.logger including 'file'")
    if len(found) > 1:
        listed = ", ".join(str(p) for p in found)
        raise ValueError(f"{run}: several metrics files ({listed}); pass the one to read instead of the folder")
    return found[0]


def read_metrics(path: str | os.PathLike) -> dict[int, dict]:
    """Per-step metrics of a file-logger JSONL: ``{step: {metric: value}}`` (steps merged).

    Raises:
        ValueError: no such file, or a blank or malformed line or a line without an integer ``step``
            (names the file and line; a truncated last line is skipped with a warning instead).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no metrics file {path}")
    steps: dict[int, dict] = {}
    for number, obj in iter_jsonl(path):
        if not _is_step_record(obj):
            raise ValueError(f"{path}: line {number} is not a step record (a JSON object with an integer 'step')")
        data = obj.get("data", {k: v for k, v in obj.items() if k != "step"})
        if not isinstance(data, dict):
            raise ValueError(f"{path}: line {number}: 'data' must be a JSON object, got {type(data).__name__}")
        steps.setdefault(obj["step"], {}).update(data)
    return steps


def nonfinite_values(steps: dict[int, dict]) -> dict[str, list[tuple[int, Optional[float]]]]:
    """``{metric: [(step, value), ...]}`` (steps ascending) of the values :func:`metric_series` leaves
    out because they are not finite: NaN, +inf, -inf, and None (``null``: how verl's file logger
    writes NaN and infinity, so which of them it was is lost). A diverged step."""
    found: dict[str, list[tuple[int, Optional[float]]]] = {}
    for step in sorted(steps):
        for key, value in steps[step].items():
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                found.setdefault(key, []).append((step, value))
    return found


def metric_series(steps: dict[int, dict]) -> dict[str, Series]:
    """``{metric: (steps, values)}`` of every finite numeric metric of :func:`read_metrics`' result."""
    by_metric: dict[str, dict[int, float]] = {}
    for step in sorted(steps):
        for key, value in steps[step].items():
            if is_number(value):  # finite: strings, lists, NaN, inf and booleans left out
                by_metric.setdefault(key, {})[step] = float(value)
    return {key: (sorted(vals), [vals[s] for s in sorted(vals)]) for key, vals in by_metric.items()}
