"""CPU trainer runs on one machine take turns (``stapo_cpu.trainer.machine_turn``): a run
started while every turn is held waits for one, says so, and its time limit counts from its own
start; a run stopped at its limit says so first in its report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stapo_cpu import trainer
from stapo_cpu.trainer import CPURun, machine_turn

HOLD = textwrap.dedent("""
    import fcntl, sys, time
    with open(sys.argv[1], "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def _hold(path: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_run_waits_for_a_turn_and_says_so(tmp_path, monkeypatch):
    lock = tmp_path / "turn.lock"
    monkeypatch.setenv(trainer.RUN_LOCK_ENV, str(lock))
    monkeypatch.setenv(trainer.RUN_SLOTS_ENV, "2")
    holders = [_hold(Path(f"{lock}.0"), 30.0), _hold(Path(f"{lock}.1"), 2.0)]  # both turns taken
    said = []
    try:
        with machine_turn(log=said.append, poll_s=0.2) as waited:  # the second turn frees 2 s on
            assert holders[0].poll() is None
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert waited >= 1.0 and len(said) == 1 and "waiting for a turn: 2 other CPU trainer run(s)" in said[0]
    said.clear()
    with machine_turn(log=said.append) as waited:  # a free machine: no wait, nothing said
        assert waited < 1.0
    assert said == []


def test_one_run_per_turn(tmp_path, monkeypatch):
    """Two turns: a third run waits even though the first two hold different locks."""
    lock = tmp_path / "turn.lock"
    monkeypatch.setenv(trainer.RUN_LOCK_ENV, str(lock))
    monkeypatch.setenv(trainer.RUN_SLOTS_ENV, "2")
    with machine_turn(log=lambda _: None), machine_turn(log=lambda _: None):
        holder = subprocess.run([sys.executable, "-c", (
            "import fcntl, sys\nfor i in range(2):\n    h = open(sys.argv[1] + f'.{i}', 'a')\n    try:\n"
            "        fcntl.flock(h, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free', i)\n    except BlockingIOError:\n"
            "        print('taken', i)"), str(lock)], capture_output=True, text=True, timeout=60)
    assert holder.stdout.split("\n")[:2] == ["taken 0", "taken 1"]


def test_the_number_of_turns_is_named_when_bad(monkeypatch):
    assert trainer.run_slots({}) == (os.cpu_count() or 1)
    assert trainer.run_slots({trainer.RUN_SLOTS_ENV: "3"}) == 3
    for bad in ("0", "two", "-1", "１"):
        with pytest.raises(ValueError, match=trainer.RUN_SLOTS_ENV):
            trainer.run_slots({trainer.RUN_SLOTS_ENV: bad})


def test_no_turns_when_the_lock_is_switched_off(tmp_path, monkeypatch):
    lock = tmp_path / "turn.lock"
    holder = _hold(Path(f"{lock}.0"), 30.0)
    try:
        monkeypatch.setenv(trainer.RUN_LOCK_ENV, "")
        start = time.time()
        with machine_turn(log=lambda _: None) as waited:
            assert waited == 0.0 and time.time() - start < 5
    finally:
        holder.kill()
        holder.wait()


def test_a_run_stopped_at_its_limit_says_so_before_its_log(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("WARNING something unrelated\n")
    stopped = CPURun("stapo", -9, 601.2, tmp_path, tmp_path / "metrics.jsonl", log, timeout=600)
    assert stopped.timed_out and not stopped.ok
    head = stopped.tail().splitlines()[0]
    assert head.startswith("run stapo stopped after 601 s: its time limit is 600 s")
    assert "returncode=-9" in repr(stopped) and "timeout=600" in repr(stopped)  # timeout: only a run it stopped has one
    failed = CPURun("stapo", 1, 10.0, tmp_path, tmp_path / "metrics.jsonl", log)
    assert not failed.timed_out and failed.tail() == "WARNING something unrelated"
