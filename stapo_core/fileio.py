"""The one way the project writes files, and file helpers shared by every layer (no torch, no verl).

Every file the project writes goes through :func:`atomic_write` (whole files), :func:`append` /
:func:`write_end` (whole lines at a file's end) or :func:`open_regular` (lock files, a child's log),
and every read of a file a user names through :func:`open_regular` / :func:`read_bytes`: only a
regular file is written or replaced (a link, FIFO, device or folder at the path is refused, naming
it), nothing waits on a FIFO, and a failed write (a full disk, a read-only file system) is one
:class:`FileError` naming the file, which is left as it was. At the bottom of the import graph
because the actor-side token dump writes with it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import itertools
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

#: what a path that is not a regular file is, as a refusal says it
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
#: what ``os.open`` met when it refuses with these errors under ``O_NOFOLLOW | O_NONBLOCK``
_OPEN_REFUSALS = {errno.ELOOP: stat.S_IFLNK, errno.ENXIO: stat.S_IFIFO}


class FileError(OSError):
    """A file that cannot be opened or written: not a regular file (``errno`` EINVAL), or a write the
    system refused (``errno`` its cause: ENOSPC, EROFS...). The message names the file; the file is as
    it was before."""

    def __str__(self) -> str:
        return self.strerror


def _not_regular(path: str | os.PathLike, mode: int) -> FileError:
    kind = next((name for test, name in _KINDS if test(mode)), "another kind of file")
    return FileError(errno.EINVAL, f"{path} is {kind}, not a regular file: refused; give the path of a regular "
                                   "file, or move that one away")


def check_regular(path: str | os.PathLike, follow: bool = False) -> None:
    """Raise :class:`FileError` when ``path`` exists and is not a regular file (a symbolic link to one
    passes only with ``follow``)."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # absent (a folder the write's own mkdir refuses)
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)


def open_regular(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """The file descriptor ``os.open(path, flags, mode)`` of a regular file, else :class:`FileError`.

    A write (``os.O_WRONLY`` / ``os.O_RDWR``) never follows a link at ``path`` (``os.O_NOFOLLOW``
    added), a read only without ``os.O_NOFOLLOW`` in ``flags``; ``os.O_NONBLOCK`` never waits on a
    FIFO, and ``fstat`` checks what was opened (a link or FIFO put there after the check). Other
    OSErrors are ``os.open``'s.
    """
    if flags & (os.O_WRONLY | os.O_RDWR):
        flags |= os.O_NOFOLLOW
    check_regular(path, follow=not flags & os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in _OPEN_REFUSALS:  # a link or a FIFO put there since the check
            raise _not_regular(path, _OPEN_REFUSALS[exc.errno]) from None
        raise
    opened = os.fstat(fd).st_mode
    if not stat.S_ISREG(opened):
        os.close(fd)
        raise _not_regular(path, opened)
    return fd


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`: a FIFO or device is refused)."""
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as handle:
        return handle.read()


@contextlib.contextmanager
def _named(path: str | os.PathLike):
    """An OSError of writing ``path`` as one :class:`FileError` naming it."""
    try:
        yield
    except FileError:
        raise
    except OSError as exc:
        raise FileError(exc.errno, f"{path}: cannot write it ({exc.strerror or exc}); nothing of this write was "
                                   "kept, the file is as it was") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_end(fd: int, path: str | os.PathLike, data: bytes, at: Optional[int] = None) -> int:
    """Write ``data`` at the end of ``path`` open as ``fd`` (:func:`open_regular`, ``os.O_RDWR | os.O_APPEND``),
    over its bytes from offset ``at`` on when given, then fsync; returns where ``data`` starts. A
    failed write puts the file back as it was and raises :class:`FileError` naming ``path``."""
    end = os.lseek(fd, 0, os.SEEK_END)
    at = end if at is None else at
    old = os.pread(fd, end - at, at)
    with _named(path):
        try:
            os.ftruncate(fd, at)
            _write_all(fd, data)
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, at)
            os.pwrite(fd, old, at)  # the room the cut freed: they fit again
            raise
    return at


def append(path: str | os.PathLike, data: bytes, at: Optional[int] = None) -> None:
    """:func:`write_end` on ``path`` (created, with its folder, if missing)."""
    path = Path(path)
    with _named(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        write_end(fd, path, data, at)
    finally:
        os.close(fd)


def append_lines(path: str | os.PathLike, lines: Sequence[str | bytes]) -> None:
    """Append ``lines`` (no newline inside: one record each; text as UTF-8) to ``path`` in one write
    (:func:`append`): a failure leaves none of them."""
    if lines:
        append(path, b"".join((line.encode("utf-8") if isinstance(line, str) else line) + b"\n" for line in lines))


def atomic_write(path: str | os.PathLike, content: str | bytes | Callable[[str], None],
                 before_replace: Optional[Callable[[str], None]] = None) -> Path:
    """Replace ``path`` whole with ``content`` (text as UTF-8, bytes, or a function writing the temp
    file whose path it is given): a temp file ``.<name>.<random>.tmp`` beside it (the name's first 200
    bytes), fsynced, given to ``before_replace`` if any, renamed over ``path``. :class:`FileError` when
    ``path`` is not a regular file or a write fails; on any exception ``path`` is as it was and the temp
    file gone."""
    path = Path(path)
    check_regular(path)
    with _named(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        stem = os.fsdecode(os.fsencode(path.name)[:200])  # the temp name fits where the name itself does
        tmp = str(path.with_name(f".{stem}.{os.urandom(6).hex()}.tmp"))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # the umask applies, as to open()'s
        try:
            try:
                if callable(content):
                    content(tmp)
                else:
                    _write_all(fd, content.encode("utf-8") if isinstance(content, str) else content)
                os.fsync(fd)
            finally:
                os.close(fd)
            if before_replace is not None:
                before_replace(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON."""
    return atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def cli_path(text: str | os.PathLike) -> str | os.PathLike:
    """An ``argparse`` ``type`` for a path a command writes: an empty or blank one is refused (``Path``
    reads it as the working folder, where the files would then go)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("an empty path: give a path ('.' for the working folder)")
    return text


def probe_writable(path: Path) -> Optional[str]:
    """None when ``path`` can be created (if missing) and a file written in it; else the reason.
    Writes and removes one probe file, and removes every folder it had to create."""
    missing = list(itertools.takewhile(lambda p: not p.exists(), [path, *path.parents]))  # deepest first
    existing = missing[-1].parent if missing else path
    if not existing.is_dir():
        return f"{existing} exists and is not a folder"
    try:
        for folder in reversed(missing):
            folder.mkdir()
        probe = path / f".stapo_probe_{os.getpid()}_{os.urandom(4).hex()}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        return f"{e.strerror or e} ({e.filename or path})"
    finally:
        for folder in missing:  # those not created (after a failure) are not there to remove
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None


def output_folder_problem(option: str, path: str | os.PathLike) -> Optional[str]:
    """Why files cannot be written into the folder ``path`` (created if missing), named after the
    command-line ``option`` that gave it; None when they can. Nothing is left behind."""
    path = Path(path)
    try:
        if path.is_symlink() and not path.exists():
            return f"{option} {path} is a symbolic link to nothing: give a folder path, or remove the link"
        if path.exists():
            if not path.is_dir():
                return f"{option} {path} is a file, not a folder: give a folder path (it is created if missing)"
            why = probe_writable(path)
            if why:
                return f"{option} {path} is not writable: {why}; give a folder you can write to"
            return None
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
    except OSError as exc:  # a name too long, a loop of links
        return f"{option} {path}: {exc.strerror}; give another folder path"
    if not parent.is_dir():
        return f"{option} {path} cannot be created: {parent} is a file; give a folder path"
    why = probe_writable(path)
    if why:
        return f"{option} {path} cannot be created: {parent} is not writable: {why}; give a folder you can write to"
    return None


def check_output_folder(option: str, path: str | os.PathLike) -> None:
    """Raise ``ValueError`` with :func:`output_folder_problem`'s message when there is one."""
    problem = output_folder_problem(option, path)
    if problem is not None:
        raise ValueError(problem)


def check_output_file(option: str, path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming the command-line ``option`` when the file ``path`` cannot be
    written: it exists and is not a regular file (:func:`check_regular`), or its folder cannot be
    written (:func:`output_folder_problem`), or the path ends with a separator (a folder's)."""
    if str(path).endswith(os.sep):
        raise ValueError(f"{option} {path} ends with {os.sep}, as a folder does: give the path of a file")
    try:
        check_regular(path)
    except FileError as exc:
        raise ValueError(f"{option} {exc}") from None
    check_output_folder(option, Path(path).parent)


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def iter_jsonl(path: str | os.PathLike):
    """``(line_number, object)`` for each line of a JSON Lines file (1-based numbers).

    A blank, undecodable (not UTF-8) or unparsable line raises ValueError naming the file and the
    line, except a LAST line without its newline that does not parse (a write cut short): it is
    skipped with a warning.
    """
    lines = read_bytes(path).split(b"\n")
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
        except RecursionError:
            raise ValueError(f"{path}: line {number} nests JSON too deeply to read") from None
        except json.JSONDecodeError as exc:
            if number == len(body) and not complete:
                warnings.warn(f"{path}: ignoring truncated last line {number} ({exc.msg})", stacklevel=2)
                return
            raise ValueError(f"{path}: line {number} is not valid JSON: {exc.msg} (column {exc.colno})") from None
        yield number, obj

