"""What killed processes leave in /dev/shm, and its removal after a vLLM engine's processes ended
(:class:`recipe.stapo.eval.backends.VLLMBackend`'s ``close``, on GPUs as on a CPU).

Python's multiprocessing names its shared memory ``psm_*`` and its named semaphores ``sem.mp-*``;
their creator removes the names when it shuts down, which a killed process never does (vLLM's
engine processes are killed, not shut down). Whether a name is still in use is told by
its inode, not by its name: every process using a segment maps it or holds it open
(``/proc/<pid>/maps``' inode column, ``/proc/<pid>/fd``), and glibc creates a semaphore under a
temporary name, maps it, links it to its final name and removes the temporary one, so even its
creator maps it under a name that is not the one in /dev/shm.
"""

from __future__ import annotations

import os
import time

SHM_DIR = "/dev/shm"
#: the names Python's multiprocessing gives its shared memory and its named semaphores
SEGMENT_PREFIXES = ("psm_", "sem.mp-")


def shm_segments() -> set[str]:
    """The names in /dev/shm now (empty where there is none)."""
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


def inodes_in_use() -> set[int]:
    """Inodes of the /dev/shm files some process maps or holds open now (processes that end
    meanwhile, or that this user may not read, are skipped)."""
    used = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                fields = (line.split(maxsplit=5) for line in maps)
                used.update(int(f[4]) for f in fields if len(f) == 6 and f[5].startswith(SHM_DIR + "/"))
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(link).startswith(SHM_DIR + "/"):
                    used.add(os.stat(link).st_ino)
            except OSError:  # closed meanwhile
                continue
    return used


def remove_orphaned_shm_segments(before: set[str]) -> list[str]:
    """Remove this user's multiprocessing segments and semaphores in /dev/shm that are not in
    ``before`` (:func:`shm_segments` when the run started) and that no process maps or holds open
    (:func:`inodes_in_use`): what the run's killed processes left (and what another program of
    this user killed meanwhile left: no process holds it either). Returns the removed names."""
    return remove_unused(shm_segments() - before, SEGMENT_PREFIXES, min_age_s=0.0)


def remove_unused(names: set[str], prefixes: tuple[str, ...], min_age_s: float) -> list[str]:
    """Remove those of ``names`` that start with one of ``prefixes``, are this user's, older than
    ``min_age_s`` (0: any age) and used by no process; returns the removed names."""
    candidates = {}
    newest = time.time() - min_age_s
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            continue
        if name.startswith(prefixes) and stat.st_uid == os.getuid() \
                and (min_age_s <= 0 or stat.st_mtime <= newest):
            candidates[name] = (path, stat.st_ino)
    if not candidates:
        return []
    used = inodes_in_use()
    removed = []
    for name, (path, inode) in sorted(candidates.items()):
        if inode not in used:
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
