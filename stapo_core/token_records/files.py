"""Where a run's dump lives, and writing and reading it.

One JSON Lines file (UTF-8, one record per line) per training step:
``RUN_DIR/s2t_tokens/step_{step:06d}.jsonl``. The writer replaces a step's file atomically; the
writer and the reader validate every record (:mod:`.schema`) and name the file and the record or
line of a bad one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from tqdm import tqdm

from ..fileio import atomic_write, iter_jsonl
from .schema import RecordError, validate_record

#: folder of the per-step dump files inside a run folder
TOKEN_DUMP_DIR = "s2t_tokens"
#: how a per-step file is named
STEP_FILE_PATTERN = "step_{step:06d}.jsonl"
_STEP_FILE_RE = re.compile(r"^step_(\d+)\.jsonl$")
#: how to produce a dump, told when a run folder holds none
_ENABLE_HINT = "run training with the token dump on: the override recipe.token_dump.dir=<run folder>"


def step_file(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / TOKEN_DUMP_DIR / STEP_FILE_PATTERN.format(step=step)


def _encode(path: Path, records: Iterable[Mapping]) -> str:
    """Validate every record and return them as JSON Lines text (ValueError names ``path`` and the
    index of the first bad record; nothing is written)."""
    lines = []
    for i, rec in enumerate(records):
        try:
            lines.append(json.dumps(validate_record(rec), ensure_ascii=False, allow_nan=False))
        except RecordError as exc:
            raise ValueError(f"{path}: record #{i} is invalid: {exc}") from None
    return "".join(line + "\n" for line in lines)


def write_step(run_dir: str | os.PathLike, step: int, records: Iterable[Mapping]) -> Path:
    """Write ``records`` as the step's file, replacing it atomically (a resumed run rewrites the
    steps it trains again); a bad record raises ValueError and leaves the file as it was."""
    path = step_file(run_dir, step)
    return atomic_write(path, _encode(path, records))


def dump_files(run_dir: str | os.PathLike) -> list[Path]:
    """The step files of a run, in step order (``run_dir`` may also be its ``s2t_tokens`` folder).

    Raises:
        FileNotFoundError: ``run_dir`` is not a folder, or holds no step file (the message says how
            to produce one).
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such run folder (pass the folder that holds {TOKEN_DUMP_DIR}/)")
    folder = root if root.name == TOKEN_DUMP_DIR else root / TOKEN_DUMP_DIR
    steps = []
    if folder.is_dir():
        steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE_RE.match(p.name)))
    if not steps:
        raise FileNotFoundError(f"{root}: no spurious-token dump (no {TOKEN_DUMP_DIR}/step_*.jsonl); {_ENABLE_HINT}")
    return [p for _, p in steps]


@dataclass(frozen=True)
class Dump:
    """What :func:`read_dump` found: validated records in file order, and the files that held no
    record (``(path, reason)``), e.g. an empty step file left by a run killed while writing."""

    tokens: list
    responses: list
    skipped: list


def read_dump(run_dir: str | os.PathLike, progress: bool = True) -> Dump:
    """All validated records of a run's step files (:func:`dump_files`).

    Raises:
        FileNotFoundError: no dump. ValueError: an unreadable line or a bad record (names the file
            and line).
    """
    tokens: list = []
    responses: list = []
    skipped: list = []
    files = dump_files(run_dir)
    for path in tqdm(files, desc="reading token dump", unit="file", disable=not progress or len(files) < 2):
        count = 0
        for number, obj in iter_jsonl(path):
            try:
                rec = validate_record(obj)
            except RecordError as exc:
                raise ValueError(f"{path}: line {number}: {exc}") from None
            (tokens if rec["kind"] == "token" else responses).append(rec)
            count += 1
        if count == 0:
            skipped.append((str(path), "no record (empty file)"))
    return Dump(tokens, responses, skipped)
