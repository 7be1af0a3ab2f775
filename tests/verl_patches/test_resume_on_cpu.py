"""Relaunching a run (verl_patches.resume): the metrics file keeps every earlier step and holds each
step once; checkpoint retention counts the checkpoints of earlier launches.

The references are verl's own: its ``FileLogger`` (what the patched logger writes for a fresh run must
be byte-identical to it) and its checkpoint manager's pruning methods (``ensure_checkpoint_capacity``,
``register_checkpoint``, ``remove_previous_save_local_path``), called in the order its FSDP manager
calls them on rank 0. The real FSDP manager under the patch runs in tests/e2e/test_two_node_on_cpu.py.
"""

from __future__ import annotations

import json
import os

import pytest

from verl_patches.registry import original_of
from verl_patches.resume import MetricsFileBusy, ResumableFileLog, check_no_writer, claim_metrics_file, \
    earlier_checkpoints, read_step_lines, step_ranges, wrap_checkpoint_save, wrap_file_logger


def _verl_file_logger():
    from verl.utils import tracking

    return original_of(tracking.FileLogger)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _records(path) -> dict[int, dict]:
    return {json.loads(line)["step"]: json.loads(line)["data"] for line in path.read_text().splitlines()}


def _log_all(logger, calls) -> None:
    for step, data in calls:
        logger.log(data=data, step=step)
    logger.finish()


CALLS = [(0, {"val/acc": 0.5}), (1, {"loss": 1.0, "n": 3}), (2, {"loss": 0.5, "n": 4}), (3, {"loss": 0.25, "n": 5})]


def test_a_fresh_run_writes_exactly_what_verls_logger_writes(tmp_path, monkeypatch):
    original = _verl_file_logger()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl.jsonl"))
    _log_all(original("p", "e"), CALLS)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "deep" / "ours.jsonl"))  # parent created
    _log_all(wrap_file_logger(original)("p", "e"), CALLS)
    assert (tmp_path / "deep" / "ours.jsonl").read_bytes() == (tmp_path / "verl.jsonl").read_bytes()


def test_the_path_rule_is_verls(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    logger = wrap_file_logger(_verl_file_logger())("proj", "exp")
    _log_all(logger, CALLS[:1])
    assert logger.filepath == str(tmp_path / "proj" / "exp.jsonl") and _steps(tmp_path / "proj" / "exp.jsonl") == [0]


def test_a_relaunch_keeps_earlier_steps_and_writes_each_step_once(tmp_path, monkeypatch):
    """Earlier launch: steps 1-5 (checkpoint at 3, then killed). Relaunch from 3: validation at 3,
    then 4, 5, 6. Steps 1-2 keep their bytes; 3 merges the earlier training metrics with the new
    validation; 4-5 are the relaunch's; verl's own logger would have kept only the relaunch's steps."""
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    original = _verl_file_logger()
    _log_all(original("p", "e"), [(s, {"loss": float(s), "launch": 1}) for s in range(1, 6)])
    earlier_lines = path.read_bytes().splitlines(keepends=True)

    relaunch = [(3, {"val/acc": 0.75}), (4, {"loss": 40.0, "launch": 2}), (5, {"loss": 50.0, "launch": 2}),
                (6, {"loss": 60.0, "launch": 2})]
    _log_all(wrap_file_logger(original)("p", "e"), relaunch)
    assert _steps(path) == [1, 2, 3, 4, 5, 6]
    assert path.read_bytes().splitlines(keepends=True)[:2] == earlier_lines[:2]
    records = _records(path)
    assert records[3] == {"loss": 3.0, "launch": 1, "val/acc": 0.75}
    assert [records[s]["launch"] for s in (4, 5, 6)] == [2, 2, 2] and records[5]["loss"] == 50.0

    _log_all(original("p", "e"), relaunch)  # the reference: verl's own logger on a relaunch
    assert _steps(path) == [3, 4, 5, 6]


def test_a_step_logged_twice_in_one_process_is_one_record(tmp_path):
    log = ResumableFileLog(tmp_path / "m.jsonl")
    for step, data in [(1, {"a": 1}), (1, {"b": 2}), (2, {"a": 3}), (2, {"a": 4})]:
        log.log(data, step)
    log.close()
    assert _steps(tmp_path / "m.jsonl") == [1, 2] and _records(tmp_path / "m.jsonl") == {1: {"a": 1, "b": 2}, 2: {"a": 4}}


def test_opening_changes_nothing_until_the_first_step(tmp_path):
    """A relaunch that dies before its first step (out of memory at start-up) loses nothing."""
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step":1,"data":{"a":1}}\n{"step":2,"data":{"a":2}}\n')
    before = path.read_bytes()
    ResumableFileLog(path).close()
    assert path.read_bytes() == before


def test_a_line_cut_by_a_killed_process_is_dropped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step":1,"data":{"a":1}}\n{"step":2,"data":{"a":2}}\n{"step":3,"da')
    assert [s for s, _ in read_step_lines(path)] == [1, 2]
    log = ResumableFileLog(path)
    log.log({"a": 30}, 3)
    log.close()
    assert _records(path) == {1: {"a": 1}, 2: {"a": 2}, 3: {"a": 30}}


def test_a_bad_middle_line_is_moved_aside_and_no_later_step_is_lost(tmp_path, capsys):
    """Steps 1-10 with a garbage line after step 3; a relaunch resuming past 10 logs step 11: every
    step stays (the earlier rule ended the scan at the bad line and kept [1, 2, 3, 11])."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "data": {"loss": float(s)}}).encode() + b"\n" for s in range(1, 11)]
    lines.insert(3, b"this is not json\n")
    path.write_bytes(b"".join(lines))
    log = ResumableFileLog(path)
    log.log({"loss": 11.0}, 11)
    log.close()
    assert _steps(path) == list(range(1, 12))
    assert (tmp_path / "metrics.jsonl.unreadable").read_bytes() == b"this is not json\n"
    err = capsys.readouterr().err
    assert f"{path}: line(s) 4 not a step record" in err and "metrics.jsonl.unreadable" in err


def test_a_relaunch_from_an_earlier_step_keeps_steps_around_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step":1,"data":{"a":1}}\n[1, 2]\n{"step":2,"data":{"a":2}}\n{"step":3,"data":{"a":3}}\n')
    log = ResumableFileLog(path)
    log.log({"a": 20}, 2)  # resumes at 2: step 3 is trained again, step 1 and 2 merge
    log.close()
    assert _records(path) == {1: {"a": 1}, 2: {"a": 20}}
    assert (tmp_path / "metrics.jsonl.unreadable").read_bytes() == b"[1, 2]\n"


def test_a_second_writer_of_one_metrics_file_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = ResumableFileLog(path)
    first.log({"a": 1}, 1)
    with pytest.raises(MetricsFileBusy, match=rf"{path}: another process \(pid {os.getpid()}\) is writing"):
        ResumableFileLog(path)
    first.log({"a": 2}, 2)
    first.close()
    second = ResumableFileLog(path)  # the first writer is done: the file is free again
    second.log({"a": 3}, 3)
    second.close()
    assert _records(path) == {1: {"a": 1}, 2: {"a": 2}, 3: {"a": 3}}


def test_a_second_writer_in_another_process_is_refused(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "metrics.jsonl"
    first = ResumableFileLog(path)
    code = ("import sys; from verl_patches.resume import ResumableFileLog, MetricsFileBusy\n"
            "try:\n    ResumableFileLog(sys.argv[1])\nexcept MetricsFileBusy as exc:\n    print(exc); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    first.close()
    assert done.returncode == 3 and f"another process (pid {os.getpid()})" in done.stdout


def _earlier_launch(path, steps, **extra) -> bytes:
    lines = [json.dumps({"step": s, "data": {"loss": float(s), "launch": 1, **extra}}).encode() + b"\n" for s in steps]
    path.write_bytes(b"".join(lines))
    return path.read_bytes()


def test_a_relaunch_that_starts_over_moves_the_earlier_run_aside(tmp_path, capsys):
    """No checkpoint found (resume_mode=disable, another CKPT_DIR, deleted checkpoints): the relaunch
    logs step 0 again. The earlier launch's steps 0-5 are copied, byte for byte, to
    metrics.jsonl.superseded.1 before the file holds only the new run's steps; the warning names the
    steps, the copy and how to continue the earlier run instead."""
    path = tmp_path / "metrics.jsonl"
    earlier = _earlier_launch(path, range(6))
    log = ResumableFileLog(path)
    for step in (0, 1, 2):
        log.log({"loss": 10.0 + step, "launch": 2}, step)
    log.close()
    assert _steps(path) == [0, 1, 2] and all(r["launch"] == 2 for r in _records(path).values())
    assert (tmp_path / "metrics.jsonl.superseded.1").read_bytes() == earlier
    err = capsys.readouterr().err
    assert f"replaces what an earlier launch logged for step(s) 0-5; those records are copied to {path}.superseded.1" \
        in err and "resume_mode=auto" in err


def test_each_relaunch_that_replaces_steps_gets_its_own_copy(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _earlier_launch(path, range(1, 4))
    for launch in (2, 3):
        log = ResumableFileLog(path)
        log.log({"loss": 0.0, "launch": launch}, 1)  # step 1 is logged again: the earlier 1-3 are replaced
        log.log({"loss": 0.0, "launch": launch}, 2)
        log.close()
    first, second = (tmp_path / "metrics.jsonl.superseded.1"), (tmp_path / "metrics.jsonl.superseded.2")
    assert _steps(first) == [1, 2, 3] and _records(first)[3]["launch"] == 1
    assert _steps(second) == [1, 2] and _records(second)[2]["launch"] == 2
    assert _records(path) == {1: {"loss": 0.0, "launch": 3}, 2: {"loss": 0.0, "launch": 3}}


def test_a_resume_step_record_whose_value_is_overwritten_is_copied_first(tmp_path):
    """Relaunch from the checkpoint of step 3, whose record already holds a validation: the new
    validation wins in the file, the earlier one is kept in the copy. A relaunch adding only new
    metrics to its resume step (the usual validation at a checkpoint without one) copies nothing."""
    path = tmp_path / "metrics.jsonl"
    _earlier_launch(path, [1, 2, 3], **{"val/acc": 0.5})
    earlier_step_3 = path.read_bytes().splitlines(keepends=True)[2]
    log = ResumableFileLog(path)
    log.log({"val/acc": 0.5}, 3)  # the same value: nothing is replaced
    log.log({"val/acc": 0.625}, 3)
    log.log({"loss": 4.0}, 4)
    log.close()
    assert (tmp_path / "metrics.jsonl.superseded.1").read_bytes() == earlier_step_3
    assert _records(path)[3] == {"loss": 3.0, "launch": 1, "val/acc": 0.625}

    other = tmp_path / "other.jsonl"
    _earlier_launch(other, [1, 2, 3])
    log = ResumableFileLog(other)
    log.log({"val/acc": 0.5}, 3)
    log.log({"loss": 4.0}, 4)
    log.close()
    assert not list(tmp_path.glob("other.jsonl.superseded*")) and _steps(other) == [1, 2, 3, 4]


def test_step_ranges_are_compact():
    assert step_ranges([7, 1, 2, 3, 5, 8, 2]) == "1-3, 5, 7-8" and step_ranges([]) == ""


def test_a_record_holding_nan_is_a_record_and_bad_lines_are_named_for_what_they_are(tmp_path, capsys):
    """Python's json writes a diverged metric as NaN, which orjson does not read: such a record stays
    a record. The other bad lines are each named for what they are, not all as a killed process's."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "data": {"loss": 1.0}}\n'
                     b'{"step": 2, "data": {"loss": NaN, "grad": Infinity}}\n'
                     b"garbage\n"
                     b'{"no_step": 3}\n'
                     b'{"step": 3, "data": {"loss": 3.0}}\n'
                     b'{"step": 4, "da')
    assert [s for s, _ in read_step_lines(path)] == [1, 2, 3]
    log = ResumableFileLog(path)
    log.log({"loss": 4.0}, 4)
    log.close()
    assert _steps(path) == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl.unreadable").read_bytes() == b'garbage\n{"no_step": 3}\n{"step": 4, "da\n'
    err = capsys.readouterr().err
    assert "line(s) 3 not a step record (not JSON)" in err
    assert 'line(s) 4 not a step record (JSON, but not a {"step": <int>, "data": {...}} record)' in err
    assert "line(s) 6 not a step record (a last line without its newline, cut by a killed process)" in err
    assert "line(s) 2" not in err


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "data": {"a": 1}}\n{"step": 2, "data": {"a": 2}}')
    log = ResumableFileLog(path)
    log.log({"a": 3}, 3)
    log.close()
    assert _records(path) == {1: {"a": 1}, 2: {"a": 2}, 3: {"a": 3}}
    assert not (tmp_path / "metrics.jsonl.unreadable").exists()


def test_a_flat_record_at_the_resume_step_is_merged(tmp_path):
    """A ``{"step": s, "<metric>": v}`` line (recipe.stapo.metrics reads those too) is a record to merge into."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\n')
    log = ResumableFileLog(path)
    log.log({"val/acc": 0.5}, 1)
    log.close()
    assert _records(path) == {1: {"loss": 1.0, "val/acc": 0.5}}


@pytest.mark.parametrize("link", ["symbolic", "hard", "folder"])
def test_a_second_writer_through_a_link_of_another_name_is_refused(tmp_path, link):
    """The lock holds per file, not per name: a symbolic link to the file, a hard link of another
    name, or the file reached through a linked folder is the same file."""
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"step": 1, "data": {"a": 1}}\n')
    if link == "symbolic":
        other = tmp_path / "alias.jsonl"
        other.symlink_to(path)
    elif link == "hard":
        other = tmp_path / "alias.jsonl"
        os.link(path, other)
    else:
        (tmp_path / "linked_run").symlink_to(tmp_path / "run")
        other = tmp_path / "linked_run" / "metrics.jsonl"
    first = ResumableFileLog(path)
    with pytest.raises(MetricsFileBusy, match=rf"{other}: another process \(pid {os.getpid()}\) is writing"):
        ResumableFileLog(other)
    with pytest.raises(MetricsFileBusy, match=rf"pid {os.getpid()}"):
        check_no_writer(other)  # the preflight's check, which creates nothing
    first.log({"a": 2}, 2)
    with pytest.raises(MetricsFileBusy):  # also after the first record (the file was rewritten or appended)
        ResumableFileLog(other)
    first.close()
    check_no_writer(other)
    second = ResumableFileLog(other)
    second.log({"a": 3}, 3)
    second.close()
    assert _records(other) == {1: {"a": 1}, 2: {"a": 2}, 3: {"a": 3}}


def test_a_write_through_a_symbolic_link_keeps_the_link(tmp_path):
    """A rewrite replaces the file the link points to, not the link."""
    target = tmp_path / "store" / "metrics.jsonl"
    target.parent.mkdir()
    _earlier_launch(target, [1, 2, 3])
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(target)
    log = ResumableFileLog(link)
    log.log({"a": 2}, 2)  # drops step 3: the file is rewritten
    log.close()
    assert link.is_symlink() and _steps(target) == [1, 2]
    assert _steps(target.with_name("metrics.jsonl.superseded.1")) == [2, 3]


def test_check_no_writer_creates_nothing(tmp_path):
    check_no_writer(tmp_path / "absent" / "metrics.jsonl")
    check_no_writer(tmp_path / "metrics.jsonl")
    assert list(tmp_path.iterdir()) == []
    claim = claim_metrics_file(tmp_path / "metrics.jsonl")
    with pytest.raises(MetricsFileBusy):
        check_no_writer(tmp_path / "metrics.jsonl")
    claim.close()


def test_the_patched_logger_is_what_verls_tracking_builds(tmp_path, monkeypatch):
    """The patch table (``import verl_patches.activate``) makes verl's ``Tracking``, the trainers'
    logger, continue an existing metrics file."""
    import verl_patches.activate  # noqa: F401  (applies the patch table in this process)
    from verl.utils.tracking import Tracking

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step":1,"data":{"a":1}}\n')
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracking = Tracking("p", "e", default_backend=["file"])
    tracking.log(data={"a": 2}, step=2)
    tracking.logger["file"].finish()
    assert _records(path) == {1: {"a": 1}, 2: {"a": 2}}


# ------------------------------------------------------------------------------------------------
# checkpoint retention
# ------------------------------------------------------------------------------------------------


def _checkpoint(root, step, role="actor"):
    folder = root / f"global_step_{step}" / role
    folder.mkdir(parents=True)
    (folder / "model.pt").write_text(str(step))
    return folder


def test_earlier_checkpoints_are_those_below_the_step_being_saved_oldest_first(tmp_path):
    for step in (2, 10, 9, 12):
        _checkpoint(tmp_path, step)
    (tmp_path / "global_step_1").mkdir()  # pruned before: its data.pt stays, its actor/ is gone
    (tmp_path / "global_step_3" / "critic").mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    assert earlier_checkpoints(tmp_path / "global_step_11" / "actor") == \
        [str(tmp_path / f"global_step_{k}" / "actor") for k in (2, 9, 10)]
    assert earlier_checkpoints(tmp_path / "global_step_11" / "critic") == [str(tmp_path / "global_step_3" / "critic")]
    assert earlier_checkpoints(tmp_path / "elsewhere" / "actor") == []


class _Manager:
    """verl's retention bookkeeping (its own methods) around a save that writes one file, in the order
    of FSDPCheckpointManager.save_checkpoint on rank 0: make room, write, register."""

    def __init__(self):
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        self.previous_saved_paths = []
        for name in ("ensure_checkpoint_capacity", "register_checkpoint", "remove_previous_save_local_path"):
            setattr(self, name, getattr(BaseCheckpointManager, name).__get__(self))

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.ensure_checkpoint_capacity(max_ckpt_to_keep)
        os.makedirs(local_path, exist_ok=True)
        open(os.path.join(local_path, "model.pt"), "w").write(str(global_step))
        self.register_checkpoint(local_path, max_ckpt_to_keep)


def _launch(root, steps, keep, patched):
    manager = _Manager()
    save = wrap_checkpoint_save(_Manager.save_checkpoint) if patched else _Manager.save_checkpoint
    for step in steps:
        save(manager, local_path=str(root / f"global_step_{step}" / "actor"), global_step=step, max_ckpt_to_keep=keep)


def _kept(root) -> list[int]:
    return sorted(int(p.parent.name.split("_")[-1]) for p in root.glob("global_step_*/actor"))


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retention_counts_the_checkpoints_of_earlier_launches(tmp_path, keep):
    """Three launches of 2 saves each: the newest ``keep`` checkpoints remain, as in one launch."""
    one_launch = tmp_path / "one"
    _launch(one_launch, [1, 2, 3, 4, 5, 6], keep, patched=True)
    relaunched = tmp_path / "three"
    for steps in ([1, 2], [3, 4], [5, 6]):
        _launch(relaunched, steps, keep, patched=True)
    assert _kept(relaunched) == _kept(one_launch) == list(range(7 - keep, 7))
    unpatched = tmp_path / "verl"  # the reference: verl alone keeps `keep` per launch
    for steps in ([1, 2], [3, 4], [5, 6]):
        _launch(unpatched, steps, keep, patched=False)
    assert _kept(unpatched) == sorted({s for launch in ([1, 2], [3, 4], [5, 6]) for s in launch[-keep:]})


def test_pruning_leaves_what_sits_beside_the_checkpoint(tmp_path):
    """The Hugging Face copy eval.sh writes (global_step_<k>/merged_hf) and the data-loader state survive."""
    _launch(tmp_path, [1, 2], 2, patched=True)
    (tmp_path / "global_step_1" / "merged_hf").mkdir()
    (tmp_path / "global_step_1" / "data.pt").write_text("")
    _launch(tmp_path, [3], 2, patched=True)
    assert _kept(tmp_path) == [2, 3]
    assert (tmp_path / "global_step_1" / "merged_hf").is_dir() and (tmp_path / "global_step_1" / "data.pt").is_file()


def test_a_relaunch_from_an_older_checkpoint_does_not_count_the_newer_ones(tmp_path):
    """Resuming from step 2 while 3 and 4 exist: those are rewritten as the run reaches them."""
    _launch(tmp_path, [1, 2, 3, 4], None, patched=True)
    _launch(tmp_path, [3, 4, 5], 2, patched=True)
    assert _kept(tmp_path) == [4, 5]


@pytest.mark.parametrize("bad", [b'{"step": 2, "data": 5}\n', b'{"step": 2, "data": [1, 2]}\n'])
def test_a_record_whose_data_is_not_an_object_is_moved_aside_as_the_reader_refuses_it(tmp_path, capsys, bad):
    """The writer kept it as a record, and the project's reader (recipe.stapo.metrics.read_metrics) then
    refused the whole file."""
    from recipe.stapo.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "data": {"x": 1}}\n' + bad + b'{"step": 3, "data": {"x": 3}}\n')
    log = ResumableFileLog(path)
    log.log({"x": 4}, 4)
    log.close()
    assert sorted(read_metrics(path)) == [1, 3, 4]
    assert (tmp_path / "metrics.jsonl.unreadable").read_bytes() == bad
    assert "line(s) 2 not a step record" in capsys.readouterr().err


def test_a_byte_order_mark_before_the_first_record_is_dropped(tmp_path):
    """An editor's byte-order mark: the writer kept the file as it was, and the reader refused line 1."""
    from recipe.stapo.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"step": 1, "data": {"x": 1}}\n{"step": 2, "data": {"x": 2}}\n')
    log = ResumableFileLog(path)
    log.log({"x": 3}, 3)
    log.close()
    assert read_metrics(path) == {1: {"x": 1}, 2: {"x": 2}, 3: {"x": 3}}
    assert not path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert not (tmp_path / "metrics.jsonl.unreadable").exists()
