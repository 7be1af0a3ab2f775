"""Secrets every process reads from a private file instead of receiving them in its environment.

A variable in a Ray job's runtime environment (``WANDB_API_KEY``, ``HF_TOKEN``...) is shown in plain
text by ``ray job list`` and the dashboard. With ``STAPO_SECRETS_FILE=<path>`` the job carries only
that path: every verl process (driver, task runner, workers) loads the file when it imports
``verl_patches.activate`` (through ``VERL_USE_EXTERNAL_MODULES``, before any of them needs a secret). The
file must be readable by its owner only (``chmod 600``) and on storage every node sees.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import MutableMapping, Optional


#: the variable naming the file
SECRETS_FILE_ENV = "STAPO_SECRETS_FILE"
_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def parse_env_file(path: str | os.PathLike) -> dict[str, str]:
    """``{name: value}`` of an env file: one ``NAME=value`` per line (``export NAME=value`` too), ``#``
    comments and blank lines ignored, a value may be quoted with ``'`` or ``"``.

    Raises:
        ValueError: naming the file, never a value: a missing file, one that is not a regular file (a
            FIFO is refused, never waited on), a file others can read, or a malformed line (by its number).
    """
    # stapo_core's package imports torch: only a process that reads a secrets file loads it (the patch
    # table imports this module, and `python -m verl_patches check` imports no torch)
    from stapo_core.fileio import FileError, read_bytes

    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = read_bytes(path).decode("utf-8")
    except FileError as exc:
        raise ValueError(f"{SECRETS_FILE_ENV}={exc}") from None
    except OSError as exc:
        raise ValueError(f"{SECRETS_FILE_ENV}={path}: cannot read it ({exc.strerror}); the file must exist on "
                         f"every node (shared storage)") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{SECRETS_FILE_ENV}={path}: group or others may access it (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    values = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{SECRETS_FILE_ENV}={path}, line {number}: expected NAME=value")
        name, value = match.group(1), match.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def load_secrets_file(environ: Optional[MutableMapping[str, str]] = None) -> list[str]:
    """Set the variables of ``$STAPO_SECRETS_FILE`` that ``environ`` (default ``os.environ``) does not
    have (a variable already set wins); returns their names (``[]`` without the variable)."""
    environ = os.environ if environ is None else environ
    path = environ.get(SECRETS_FILE_ENV, "").strip()
    if not path:
        return []
    added = []
    for name, value in parse_env_file(path).items():
        if name not in environ:
            environ[name] = value
            added.append(name)
    return added
