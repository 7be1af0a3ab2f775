"""What killed processes leave in /dev/shm (recipe/stapo/eval/shm.py): only what no process uses goes,
told by inode. Each case is built: a segment in use, one held open only, a live named semaphore
whose holder maps it under another name (glibc's temporary one), and orphans of each kind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from multiprocessing import shared_memory

import pytest

from recipe.stapo.eval.shm import SHM_DIR, remove_orphaned_shm_segments

#: a process that creates the named semaphore argv[1] (as multiprocessing does outside the fork
#: context: kept under its name), says so, and holds it until its stdin closes (argv[2] == "hold") or
#: exits at once, leaving the name (argv[2] == "leave")
SEMAPHORE = textwrap.dedent("""
    import sys, _multiprocessing
    sem = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False)
    print("ready", flush=True)
    if sys.argv[2] == "hold":
        sys.stdin.read()
""")
#: a process that opens the file argv[1] without mapping it, says so, and holds it until its stdin closes
HOLD_OPEN = textwrap.dedent("""
    import os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    print("ready", flush=True)
    sys.stdin.read()
""")


def _start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _semaphore(tag: str) -> tuple[str, str]:
    """(the name sem_open is given, its file in /dev/shm), unique to this test run."""
    name = f"/mp-stapo-test-{tag}-{uuid.uuid4().hex[:8]}"
    return name, f"{SHM_DIR}/sem.{name[1:]}"


def _mapped(pid: int) -> tuple[set[str], set[int]]:
    """(paths, inodes) of the /dev/shm files process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    shm = [f for f in fields if len(f) == 6 and f[5].startswith(SHM_DIR + "/")]
    return {f[5].strip() for f in shm}, {int(f[4]) for f in shm}


@pytest.fixture
def cleanup():
    paths, procs = [], []
    yield paths, procs
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=60)
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def test_only_new_segments_no_process_uses_are_removed(cleanup):
    """A killed process's segment goes; one that existed before, one still mapped, one another process
    holds open without mapping it, and a file that is not multiprocessing's stay."""
    paths, procs = cleanup
    mapped = shared_memory.SharedMemory(create=True, size=64)  # in use (mapped by this process)
    older = shared_memory.SharedMemory(create=True, size=64)
    older.close()  # unmapped, but there before the run
    paths += [f"{SHM_DIR}/{s.name}" for s in (mapped, older)]
    before = set(os.listdir(SHM_DIR))
    orphan = shared_memory.SharedMemory(create=True, size=64)
    orphan.close()  # unmapped, never unlinked: what a killed creator leaves
    held = shared_memory.SharedMemory(create=True, size=64)
    held.close()
    other = f"{SHM_DIR}/stapo-test-{uuid.uuid4().hex[:8]}"  # not a multiprocessing name
    open(other, "w").close()
    paths += [f"{SHM_DIR}/{s.name}" for s in (orphan, held)] + [other]
    holder = _start(HOLD_OPEN, f"{SHM_DIR}/{held.name}")
    procs.append(holder)
    assert not _mapped(holder.pid)[1] & {os.stat(f"{SHM_DIR}/{held.name}").st_ino}  # open, not mapped

    removed = remove_orphaned_shm_segments(before)

    assert orphan.name in removed and not os.path.exists(f"{SHM_DIR}/{orphan.name}")
    assert not {mapped.name, older.name, held.name, os.path.basename(other)} & set(removed)
    assert all(os.path.exists(p) for p in (f"{SHM_DIR}/{mapped.name}", f"{SHM_DIR}/{older.name}",
                                           f"{SHM_DIR}/{held.name}", other))
    mapped.close()


def test_a_live_semaphore_mapped_under_another_name_stays_and_an_orphaned_one_goes(cleanup):
    """glibc creates a named semaphore under a temporary name, maps it, then links it to its name: its
    holder's mapping never carries the name in /dev/shm (a check by name would remove a live one).
    By inode it is in use and stays; the semaphore of a process that ended without removing it goes."""
    paths, procs = cleanup
    before = set(os.listdir(SHM_DIR))
    live_name, live = _semaphore("live")
    orphan_name, orphan = _semaphore("orphan")
    paths += [live, orphan]
    holder = _start(SEMAPHORE, live_name, "hold")
    procs.append(holder)
    done = subprocess.run([sys.executable, "-c", SEMAPHORE, orphan_name, "leave"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and os.path.exists(orphan), done.stderr
    names, inodes = _mapped(holder.pid)
    assert live not in names and os.stat(live).st_ino in inodes  # the event: mapped, but not by its name

    removed = remove_orphaned_shm_segments(before)

    assert os.path.basename(orphan) in removed and not os.path.exists(orphan)
    assert os.path.basename(live) not in removed and os.path.exists(live)
