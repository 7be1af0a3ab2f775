"""A relaunched run continues what the earlier launches left: the metrics file and checkpoint retention.

Resuming a run is relaunching the same command (verl's ``resume_mode=auto`` loads the newest
checkpoint). Two things of verl's would lose or keep too much across launches:

- verl's file logger opens its file with ``"wb"``: a relaunch wipes every step logged before.
  :func:`wrap_file_logger` replaces it by a logger that keeps the file and writes each step once:
  the first step a process logs, ``s``, drops the records the earlier launch wrote after ``s``
  (steps it trained past its last checkpoint, which the relaunch trains again); a step logged again
  (the validation a relaunch runs at its resume step, or two calls for one step) is merged into
  that step's record, the new values winning. A line that is not a step record (one cut by a killed
  process, a garbage line anywhere) is moved to ``<file>.unreadable`` with a warning naming its
  line; the records after it are kept. One process writes a file at a time: a second logger of the
  same file (another launch into the same folder) stops at its start, naming the file and the
  writer's pid.
- verl's checkpoint manager prunes (``trainer.max_actor_ckpt_to_keep``) only the checkpoints its
  own process saved, so those of earlier launches are never removed.
  :func:`wrap_checkpoint_save` counts them: before a manager's first save, the
  ``global_step_<k>/<role>`` folders of earlier launches with ``k`` below the step being saved join
  its list, oldest first, and verl's own pruning then keeps the newest ones. Pruning removes only
  ``global_step_<k>/<role>``, as verl does: the data-loader state and the Hugging Face copy
  ``run_scripts/eval.sh`` writes to ``global_step_<k>/merged_hf`` stay.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import orjson

from stapo_core.fileio import atomic_write

#: a checkpoint folder verl writes: ``<default_local_dir>/global_step_<k>``
STEP_FOLDER = re.compile(r"^global_step_(\d+)$")


# ------------------------------------------------------------------------------------------------
# the metrics file
# ------------------------------------------------------------------------------------------------


def file_logger_path(project_name: str, experiment_name: str, environ=os.environ) -> str:
    """Where verl's file logger writes: ``$VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root default: the working directory)."""
    path = environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return path
    root = os.path.expanduser(environ.get("VERL_FILE_LOGGER_ROOT", "."))
    return os.path.join(root, project_name, f"{experiment_name}.jsonl")


def scan_step_lines(path: str | os.PathLike) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """``(records, unreadable)`` of a metrics file (both ``[]`` if it is absent): ``(step, line)`` of
    each ``{"step": <int>, ...}`` JSON object line, and ``(line_number, line)`` (1-based) of every
    other line, in file order. A bad line anywhere (a last line cut by a killed process, a garbage
    line in the middle) is listed on its own: the records after it are still read."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return [], []
    records, unreadable = [], []
    for number, line in enumerate(raw.splitlines(keepends=True), start=1):
        try:
            obj = orjson.loads(line) if line.endswith(b"\n") else None
        except orjson.JSONDecodeError:
            obj = None
        step = obj.get("step") if isinstance(obj, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            if line.strip():
                unreadable.append((number, line))
            continue
        records.append((step, line))
    return records, unreadable


def read_step_lines(path: str | os.PathLike) -> list[tuple[int, bytes]]:
    """The records of :func:`scan_step_lines`."""
    return scan_step_lines(path)[0]


def unreadable_lines_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".unreadable")


def writer_lock_path(path: str | os.PathLike) -> Path:
    """The lock file a writer of ``path`` holds (it holds the writer's pid)."""
    path = Path(path)
    return path.with_name(f".{path.name}.writer")


class MetricsFileBusy(RuntimeError):
    """Another process is writing the metrics file (its two writers would lose records)."""


def claim_metrics_file(path: str | os.PathLike) -> int:
    """Take the one-writer lock of ``path``; returns its file descriptor (closing it releases the
    lock; so does the process's end, however it ends). ``MetricsFileBusy`` when another process (or
    another open logger of this one) holds it."""
    lock = writer_lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise MetricsFileBusy(
            f"{path}: another process (pid {holder}) is writing this metrics file; two writers would lose each "
            f"other's records. Wait for it to end (or stop it), or give this run its own trainer.default_local_dir "
            f"/ experiment name"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class ResumableFileLog:
    """A metrics file of ``{"step": s, "data": {...}}`` lines in which every step appears once (the
    module docstring's rules). Opening keeps the file as it is: nothing is lost if the process dies
    before its first step."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd: Optional[int] = claim_metrics_file(self.path)
        self._records, self._unreadable = scan_step_lines(self.path)
        self._first = True
        self._last: Optional[tuple[int, dict, int]] = None  # step, data, byte offset of its line
        self.fp = None

    def _rewrite(self, lines: list[bytes]) -> None:
        def write(tmp: str) -> None:
            with open(tmp, "wb") as handle:
                handle.writelines(lines)
                handle.flush()
                os.fsync(handle.fileno())

        atomic_write(self.path, write)

    def _start(self, step: int) -> None:
        """First record of this process: keep the earlier records up to ``step``, open for appending."""
        kept = [(s, line) for s, line in self._records if s <= step]
        on_disk = self.path.stat().st_size if self.path.exists() else 0
        if self._unreadable:
            self._quarantine()
        if len(kept) != len(self._records) or sum(len(line) for _, line in kept) != on_disk:
            self._rewrite([line for _, line in kept])
        self.fp = open(self.path, "ab", buffering=0)
        if kept and kept[-1][0] == step:
            offset = sum(len(line) for _, line in kept[:-1])
            self._last = (step, orjson.loads(kept[-1][1])["data"], offset)
        self._records = []

    def _quarantine(self) -> None:
        """Append the unreadable lines to :func:`unreadable_lines_path` (before the file is rewritten
        without them, so a kill in between loses nothing) and say so."""
        target = unreadable_lines_path(self.path)
        with open(target, "ab") as handle:
            handle.writelines(line if line.endswith(b"\n") else line + b"\n" for _, line in self._unreadable)
            handle.flush()
            os.fsync(handle.fileno())
        numbers = ", ".join(str(n) for n, _ in self._unreadable[:10]) + (" ..." if len(self._unreadable) > 10 else "")
        print(f"WARNING: {self.path}: line(s) {numbers} not a step record (a garbage line, or one cut by a killed "
              f"process); moved to {target}, every readable step kept", file=sys.stderr)
        self._unreadable = []

    def log(self, data: dict, step: int) -> None:
        if self._first:
            self._start(step)
            self._first = False
        if self._last is not None and self._last[0] == step:
            data = {**self._last[1], **data}
            offset = self._last[2]
            self.fp.truncate(offset)
        else:
            offset = self.fp.seek(0, os.SEEK_END)
        self.fp.write(orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._last = (step, data, offset)

    def close(self) -> None:
        if self.fp is not None:
            self.fp.close()
            self.fp = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def wrap_file_logger(original: type) -> type:
    """verl's ``FileLogger`` class -> a subclass writing through :class:`ResumableFileLog` (same path
    rule, same constructor and methods; verl's constructor, which truncates the file, is not run)."""

    class FileLogger(original):
        def __init__(self, project_name: str, experiment_name: str):
            self.project_name = project_name
            self.experiment_name = experiment_name
            self.filepath = file_logger_path(project_name, experiment_name)
            print(f"Creating file logger at {os.path.abspath(self.filepath)} (continuing its earlier steps)")
            self._log = ResumableFileLog(self.filepath)

        def log(self, data, step):
            self._log.log(data, step)

        def finish(self):
            self._log.close()

    FileLogger.__qualname__ = original.__qualname__
    FileLogger.__module__ = original.__module__
    return FileLogger


# ------------------------------------------------------------------------------------------------
# checkpoint retention
# ------------------------------------------------------------------------------------------------


def earlier_checkpoints(local_path: str | os.PathLike) -> list[str]:
    """The checkpoints of earlier launches that ``local_path`` (``<dir>/global_step_<n>/<role>``)
    competes with for retention: the existing ``<dir>/global_step_<k>/<role>`` folders with
    ``k < n``, oldest first. ``[]`` for a path of another layout."""
    path = Path(local_path)
    match = STEP_FOLDER.match(path.parent.name)
    if match is None or not path.parent.parent.is_dir():
        return []
    step, role = int(match.group(1)), path.name
    found = []
    for folder in path.parent.parent.iterdir():
        m = STEP_FOLDER.match(folder.name)
        if m is not None and int(m.group(1)) < step and (folder / role).is_dir():
            found.append((int(m.group(1)), str(folder / role)))
    return [p for _, p in sorted(found)]


def _local_path_argument(args: tuple, kwargs: dict) -> Any:
    return kwargs["local_path"] if "local_path" in kwargs else (args[0] if args else None)


def wrap_checkpoint_save(original):
    """``CheckpointManager.save_checkpoint`` -> the same, after the manager's list of saved
    checkpoints (what verl prunes from) got those of earlier launches (:func:`earlier_checkpoints`),
    once per manager."""

    def save_checkpoint(self, *args, **kwargs):
        local_path = _local_path_argument(args, kwargs)
        if local_path is not None and not getattr(self, "_stapo_counted_earlier", False):
            self._stapo_counted_earlier = True
            earlier = earlier_checkpoints(local_path)
            mine = [p for p in self.previous_saved_paths if p not in earlier]
            self.previous_saved_paths = earlier + mine
        return original(self, *args, **kwargs)

    return save_checkpoint
