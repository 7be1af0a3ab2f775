"""A relaunched run continues what the earlier launches left: the metrics file and checkpoint retention.

Resuming a run is relaunching the same command (verl's ``resume_mode=auto`` loads the newest
checkpoint), but verl's file logger opens its file with ``"wb"``, so a relaunch would wipe every step
logged before, and verl's checkpoint manager prunes (``trainer.max_actor_ckpt_to_keep``) only the
checkpoints its own process saved, so those of earlier launches would never be removed.
"""

from __future__ import annotations

import codecs
import fcntl
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import orjson

from stapo_core.fileio import append_lines, atomic_write, open_regular, read_bytes, write_end

#: a checkpoint folder verl writes: ``<default_local_dir>/global_step_<k>``
STEP_FOLDER = re.compile(r"^global_step_(\d+)$")


def file_logger_path(project_name: str, experiment_name: str, environ=os.environ) -> str:
    """Where verl's file logger writes: ``$VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root default: the working directory)."""
    path = environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return path
    root = os.path.expanduser(environ.get("VERL_FILE_LOGGER_ROOT", "."))
    return os.path.join(root, project_name, f"{experiment_name}.jsonl")


def _parse_line(line: bytes) -> Any:
    """A JSON value of one line: orjson's reading, or Python's json where orjson refuses what Python
    writes (``NaN``, ``Infinity``); raises ``ValueError`` for a line that is not JSON."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)  # UnicodeDecodeError and JSONDecodeError are ValueErrors


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def record_data(obj: dict) -> dict:
    """The metrics of a step record: its ``data`` object (verl's lines), or every key but ``step``
    (the flat ``{"step": s, "<metric>": v}`` lines :mod:`recipe.stapo.metrics` reads too)."""
    data = obj.get("data")
    return data if isinstance(data, dict) else {k: v for k, v in obj.items() if k != "step"}


#: what a line that is not a step record is, as the warnings say it
CUT_LINE = "a last line without its newline, cut by a killed process"
NOT_JSON = "not JSON"
NOT_A_RECORD = 'JSON, but not a {"step": <int>, "data": {...}} record'


def scan_step_lines(path: str | os.PathLike) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes, str]]]:
    """``(records, unreadable)`` of a metrics file (both ``[]`` if it is absent): ``(step, line)`` of
    each ``{"step": <int>, ...}`` JSON object line whose ``data``, if any, is an object (a record
    holding ``NaN`` / ``Infinity`` included; a complete last record without its newline gets one; a
    byte-order mark before the first line dropped), and ``(line_number, line, what)``
    (1-based; ``what``: :data:`CUT_LINE`, :data:`NOT_JSON` or :data:`NOT_A_RECORD`) of every other
    non-blank line, in file order. A bad line anywhere is listed on its own: the records after it are
    still read."""
    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        return [], []
    records, unreadable = [], []
    if raw.startswith(codecs.BOM_UTF8):  # an editor's byte-order mark: not part of the first record
        raw = raw[len(codecs.BOM_UTF8):]
    for number, line in enumerate(raw.splitlines(keepends=True), start=1):
        if not line.strip():
            continue
        try:
            obj = _parse_line(line)
        except ValueError:
            unreadable.append((number, line, NOT_JSON if line.endswith(b"\n") else CUT_LINE))
            continue
        if not isinstance(obj, dict) or not _is_step(obj.get("step")) or not isinstance(obj.get("data", {}), dict):
            unreadable.append((number, line, NOT_A_RECORD))
            continue
        records.append((obj["step"], line if line.endswith(b"\n") else line + b"\n"))
    return records, unreadable


def read_step_lines(path: str | os.PathLike) -> list[tuple[int, bytes]]:
    """The records of :func:`scan_step_lines`."""
    return scan_step_lines(path)[0]


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` -> ``"1-3, 5, 7-8"``."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def writer_lock_path(path: str | os.PathLike) -> Path:
    """The lock file a writer of ``path`` holds (it holds the writer's pid), beside the real file (every
    symbolic link resolved, so that two names of one file are one file to the lock)."""
    real = Path(os.path.realpath(path))
    return real.with_name(f".{real.name}.writer")


class MetricsFileBusy(RuntimeError):
    """Another process is writing the metrics file (its two writers would lose records)."""


def _lock_or_busy(fd: int, path: str | os.PathLike, holder: Callable[[int], str]) -> int:
    """``fd`` with an exclusive ``flock`` taken; if another holds it, ``fd`` closed and ``MetricsFileBusy``
    naming ``path`` and the pid ``holder(fd)`` reads."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = holder(fd)
        os.close(fd)
        raise MetricsFileBusy(
            f"{path}: another process (pid {pid}) is writing this metrics file; two writers would lose each "
            f"other's records. Wait for it to end (or stop it), or give this run its own trainer.default_local_dir "
            f"/ experiment name"
        ) from None
    return fd


def _lock_file_pid(fd: int) -> str:
    """The pid a lock file holds (``?`` if empty)."""
    return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"


def _flock_holder(fd: int) -> str:
    """The pid holding a ``flock`` on the file of ``fd`` (from ``/proc/locks``; ``?`` if not found)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if "FLOCK" in fields and inode in fields:
                    return fields[fields.index(inode) - 1]
    except OSError:
        pass
    return "?"


def _lock_file_inode(path: Path, shown: str | os.PathLike) -> Optional[int]:
    """An fd holding a ``flock`` on the metrics file itself (its inode: a hard link of another name,
    with a lock file of its own, is the same inode), None when there is no file yet. ``FileError``
    when it is not a regular file (a FIFO is refused, never waited on)."""
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    return _lock_or_busy(fd, shown, _flock_holder)


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class MetricsFileClaim:
    """The one-writer lock of a metrics file: the lock file of its real path (holding the writer's
    pid) and a ``flock`` on the file's inode; :meth:`close` (or the process's end, however it ends)
    releases both."""

    def __init__(self, lock_fd: int, file_fd: Optional[int]):
        self._fds = [fd for fd in (lock_fd, file_fd) if fd is not None]
        self._inodes = {_inode(file_fd)} if file_fd is not None else set()

    def hold(self, fd: int) -> None:
        """Also lock the file open as ``fd`` (the file a rewrite put in place of the claimed one, or
        the one the first record created), unless it is the inode already locked."""
        if _inode(fd) not in self._inodes:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._inodes.add(_inode(fd))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def claim_metrics_file(path: str | os.PathLike) -> MetricsFileClaim:
    """Take the one-writer lock of ``path`` (:class:`MetricsFileClaim`). ``MetricsFileBusy`` when
    another process (or another open logger of this one) holds it, under this name or another
    (a symbolic or hard link). ``FileError`` when the file or its lock file is not a regular file (a
    lock file planted as a link is refused, its target never written)."""
    real = Path(os.path.realpath(path))
    lock = writer_lock_path(real)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock_or_busy(open_regular(lock, os.O_RDWR | os.O_CREAT), path, _lock_file_pid)
    try:
        file_fd = _lock_file_inode(real, path)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return MetricsFileClaim(fd, file_fd)


def check_no_writer(path: str | os.PathLike) -> None:
    """``MetricsFileBusy`` when a process holds the writer lock of ``path`` (its lock file or the
    file's inode); creates nothing (the preflight's check). ``FileError`` as :func:`claim_metrics_file`."""
    real = Path(os.path.realpath(path))
    lock = writer_lock_path(real)
    if os.path.lexists(lock):
        os.close(_lock_or_busy(open_regular(lock, os.O_RDONLY | os.O_NOFOLLOW), path, _lock_file_pid))
    file_fd = _lock_file_inode(real, path)
    if file_fd is not None:
        os.close(file_fd)


def _same_value(a: Any, b: Any) -> bool:
    """Two metric values are one value as the file writes them (NaN, infinity and ``null`` alike)."""
    try:
        return orjson.dumps(a, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(b, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return False


class ResumableFileLog:
    """A metrics file of ``{"step": s, "data": {...}}`` lines in which every step appears once.

    Opening keeps the file as it is: nothing is lost if the process dies before its first step. The
    first step this process logs, ``s``, ends the earlier launches' history at ``s``: their records
    after ``s`` (steps trained past the last checkpoint, which the relaunch trains again; or a whole
    earlier run, when the relaunch found no checkpoint) leave the file, and a step logged again (the
    validation a relaunch runs at its resume step, or two calls for one step) is merged into that
    step's record, the new values winning. Nothing of an earlier launch is deleted: the records a
    relaunch replaces are first copied to ``<file>.superseded.<n>`` (one per relaunch that replaced
    something), with a warning naming the steps and the copy. A line that is not a step record
    (:func:`scan_step_lines`) is moved to ``<file>.unreadable`` with a warning naming its line and what
    it is; the records after it are kept. One process writes a file at a time
    (:func:`claim_metrics_file`, under any name of the file). ``path`` is followed to the real file (a
    rewrite replaces the file a link points to, not the link).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.path.realpath(path))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._claim: Optional[MetricsFileClaim] = claim_metrics_file(path)
        self._records, self._unreadable = scan_step_lines(self.path)
        self._first = True
        self._last: Optional[tuple[int, dict, int]] = None  # step, data, byte offset of its line
        self._inherited: Optional[bytes] = None  # the earlier launch's line of step _last[0], not yet copied
        self.fd: Optional[int] = None

    def _start(self, step: int) -> None:
        """First record of this process: keep the earlier records up to ``step`` (those after it
        copied aside first), open for appending."""
        kept = [(s, line) for s, line in self._records if s <= step]
        later = [(s, line) for s, line in self._records if s > step]
        on_disk = self.path.stat().st_size if self.path.exists() else 0
        if self._unreadable:
            self._quarantine()
        inherited = kept[-1][1] if kept and kept[-1][0] == step else None
        self._inherited = inherited
        if later:
            self._supersede(step, ([(step, inherited)] if inherited is not None else []) + later)
            self._inherited = None
        if len(kept) != len(self._records) or sum(len(line) for _, line in kept) != on_disk:
            atomic_write(self.path, b"".join(line for _, line in kept))
        self.fd = open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        self._claim.hold(self.fd)
        if inherited is not None:
            offset = sum(len(line) for _, line in kept[:-1])
            self._last = (step, record_data(_parse_line(inherited)), offset)
        self._records = []

    def _supersede(self, step: int, records: list[tuple[int, bytes]]) -> None:
        """Copy the earlier launch's ``records`` that this launch replaces to ``<file>.superseded.<n>``,
        the first ``n`` (1, 2, ...) not taken (before the file changes, so a kill in between loses
        nothing) and say so."""
        n = 1
        while self.path.with_name(f"{self.path.name}.superseded.{n}").exists():
            n += 1
        target = self.path.with_name(f"{self.path.name}.superseded.{n}")
        atomic_write(target, b"".join(line for _, line in records))
        print(f"WARNING: {self.path}: this launch logs step {step} first, so it replaces what an earlier launch "
              f"logged for step(s) {step_ranges([s for s, _ in records])}; those records are copied to {target}. "
              f"A launch resumes at its checkpoint's step, or at step 0 when it loads none (trainer.resume_mode="
              f"disable, another trainer.default_local_dir / CKPT_DIR, deleted checkpoints): to continue the earlier "
              f"run, relaunch with its checkpoints (resume_mode=auto, the same default_local_dir)", file=sys.stderr)

    def _quarantine(self) -> None:
        """Append the unreadable lines to ``<file>.unreadable`` (before the file is
        rewritten without them, so a kill in between loses nothing) and say what each is."""
        target = self.path.with_name(self.path.name + ".unreadable")
        append_lines(target, [line.removesuffix(b"\n") for _, line, _ in self._unreadable])
        by_kind: dict[str, list[int]] = {}
        for number, _, what in self._unreadable:
            by_kind.setdefault(what, []).append(number)
        listed = "; ".join(f"line(s) {', '.join(map(str, numbers[:10]))}{' ...' if len(numbers) > 10 else ''} not a "
                           f"step record ({what})" for what, numbers in by_kind.items())
        print(f"WARNING: {self.path}: {listed}; moved to {target}, every readable step kept", file=sys.stderr)
        self._unreadable = []

    def log(self, data: dict, step: int) -> None:
        if self._first:
            self._start(step)
            self._first = False
        if self._last is not None and self._last[0] == step:
            old = self._last[1]
            if self._inherited is not None and any(k in old and not _same_value(old[k], v) for k, v in data.items()):
                self._supersede(step, [(step, self._inherited)])
                self._inherited = None
            data = {**old, **data}
            at = self._last[2]
        else:
            self._inherited = None
            at = None
        line = orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        self._last = (step, data, write_end(self.fd, self.path, line, at))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._claim is not None:
            self._claim.close()
            self._claim = None


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


def wrap_checkpoint_save(original):
    """``CheckpointManager.save_checkpoint`` -> the same, after the manager's list of saved
    checkpoints (what verl prunes from) got those of earlier launches (:func:`earlier_checkpoints`,
    oldest first), once per manager, so verl's own pruning keeps the newest ones. Pruning removes
    ``global_step_<k>/<role>`` only, as verl does: the data-loader state and the Hugging Face copy
    ``run_scripts/eval.sh`` writes to ``global_step_<k>/merged_hf`` stay."""

    def save_checkpoint(self, *args, **kwargs):
        local_path = kwargs["local_path"] if "local_path" in kwargs else (args[0] if args else None)
        if local_path is not None and not getattr(self, "_stapo_counted_earlier", False):
            self._stapo_counted_earlier = True
            earlier = earlier_checkpoints(local_path)
            mine = [p for p in self.previous_saved_paths if p not in earlier]
            self.previous_saved_paths = earlier + mine
        return original(self, *args, **kwargs)

    return save_checkpoint
