"""Small file helpers shared by every layer: atomic writes, hashes, JSON Lines (no torch, no verl).

They live at the bottom of the import graph because the actor-side token dump writes with them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


def output_folder_problem(option: str, path: str | os.PathLike) -> Optional[str]:
    """Why files cannot be written into the folder ``path`` (created if missing), named after the
    command-line ``option`` that gave it; None when they can. Nothing is created."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            return f"{option} {path} is a file, not a folder: give a folder path (it is created if missing)"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{option} {path} is not writable: give a folder you can write to"
        return None
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{option} {path} cannot be created: {parent} is a file; give a folder path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{option} {path} cannot be created: {parent} is not writable; give a folder you can write to"
    return None


def check_output_folder(option: str, path: str | os.PathLike) -> None:
    """Raise ``ValueError`` with :func:`output_folder_problem`'s message when there is one."""
    problem = output_folder_problem(option, path)
    if problem is not None:
        raise ValueError(problem)


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: str | os.PathLike, write_fn: Callable[[str], None]) -> Path:
    """Write ``path`` via ``write_fn(tmp_path)`` on a temp file in the same folder, then rename: a
    crash or an exception inside ``write_fn`` leaves ``path`` as it was (absent or old)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write a UTF-8 text file."""

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    return atomic_write(path, _write)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def append_lines(path: str | os.PathLike, lines: Sequence[str]) -> None:
    """Append ``lines`` (no newlines inside: one record per line) to a text file in one write,
    then fsync, so a crash leaves at most the last line partly written."""
    if not lines:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
        handle.flush()
        os.fsync(handle.fileno())


def iter_jsonl(path: str | os.PathLike):
    """``(line_number, object)`` for each line of a JSON Lines file (1-based numbers).

    A blank, undecodable (not UTF-8) or unparsable line raises ValueError naming the file and the
    line, except a LAST line without its newline that does not parse (a write cut short): it is
    skipped with a warning.
    """
    with open(path, "rb") as handle:
        lines = handle.read().split(b"\n")
    complete = lines[-1] == b""  # the file ends with a newline
    body = lines[:-1] if complete else lines
    for number, raw in enumerate(body, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: line {number} is not UTF-8 text (byte {exc.start}): not a JSON Lines file?") from None
        if not line.strip():
            raise ValueError(f"{path}: line {number} is empty")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(body) and not complete:
                warnings.warn(f"{path}: ignoring truncated last line {number} ({exc.msg})", stacklevel=2)
                return
            raise ValueError(f"{path}: line {number} is not valid JSON: {exc.msg} (column {exc.colno})") from None
        yield number, obj

