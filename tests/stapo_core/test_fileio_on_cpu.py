"""The one way the project writes files (stapo_core.fileio), through every writer that uses it.

Each writer is given what an output path must never be (a FIFO, a character device, a symbolic link
to a regular file or to a device, a folder): it refuses, naming the path, and leaves the node and
what a link points to as they were, without waiting on a FIFO. A failing write is injected at the
``os`` level (``os.write`` / ``os.replace`` raising ENOSPC or EROFS): one error naming the file, and
nothing already in the file cut.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
from pathlib import Path

import pytest

from stapo_core.fileio import (FileError, append_lines, atomic_write, atomic_write_json, open_regular, probe_writable,
                               read_bytes)

PRECIOUS = b"a file a planted link points to\n"


@contextlib.contextmanager
def within(seconds: int = 10):
    """Fail the block when it takes longer (an open of a FIFO waiting for the other end)."""

    def blocked(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _char_device(path: Path) -> Path:
    """A character device at ``path`` (the null device's numbers: opening it does nothing)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:  # not root: "link to a device" still gives every writer a device
        pytest.skip("making a device node takes root")
    return path


def _plant(kind: str, path: Path) -> tuple[Path, Path]:
    """Put ``kind`` at ``path``; returns (the path a writer is given, the file a link points to)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.parent / "target.bin"
    target.write_bytes(PRECIOUS)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "char device":
        path = _char_device(path)
    elif kind == "link to a file":
        path.symlink_to(target)
    elif kind == "link to a device":
        path.symlink_to("/dev/null")
    elif kind == "folder":
        path.mkdir()
    return path, target


def _node(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_mode, st.st_ino


def _metrics_writers():
    from verl_patches.resume import ResumableFileLog, claim_metrics_file, writer_lock_path

    def log(path):
        ResumableFileLog(path).log({"loss": 1.0}, 1)

    def claim(tmp):
        claim_metrics_file(tmp / "metrics.jsonl").close()

    return {
        "metrics file": (lambda tmp: tmp / "metrics.jsonl", lambda tmp: log(tmp / "metrics.jsonl")),
        "metrics writer lock": (lambda tmp: writer_lock_path(tmp / "metrics.jsonl"), claim),
    }


def _writers():
    """name -> (where the writer writes under a folder, the write)."""
    from recipe.stapo.data.prepare import LOCK_NAME, _folder_lock
    from recipe.stapo.eval.generate import JsonlStore
    from recipe.stapo.eval.parallel import OutputLock
    from recipe.stapo.plots import _pyplot, _save
    from stapo_core.token_records import step_file, write_step

    def folder_lock(tmp):
        with _folder_lock(tmp):
            pass

    return {
        "atomic_write (summaries, reports, Table 2, benchmark JSON)": (
            lambda tmp: tmp / "summary.md", lambda tmp: atomic_write(tmp / "summary.md", "# summary\n")),
        "atomic_write_json (run_config.json, manifests)": (
            lambda tmp: tmp / "run_config.json", lambda tmp: atomic_write_json(tmp / "run_config.json", {"a": 1})),
        "evaluation records": (lambda tmp: tmp / "g.jsonl",
                               lambda tmp: JsonlStore(tmp / "g.jsonl").append([{"problem_index": 0, "sample": 0}])),
        "token dump": (lambda tmp: step_file(tmp, 1), lambda tmp: write_step(tmp, 1, [])),
        "plot": (lambda tmp: tmp / "loss.png", lambda tmp: _save(_pyplot().figure(), tmp / "loss.png")),
        "data folder lock": (lambda tmp: tmp / LOCK_NAME, folder_lock),
        "evaluation output lock": (lambda tmp: OutputLock(tmp).path, lambda tmp: OutputLock(tmp).acquire()),
        **_metrics_writers(),
    }


KINDS = ["fifo", "char device", "link to a file", "link to a device", "folder"]
#: the metrics file follows a link to its file by design (a rewrite replaces the file, not the link:
#: tests/verl_patches/test_resume_on_cpu.py); the file it resolves to is held to the rule
CASES = [(w, k) for w in _writers() for k in KINDS if (w, k) != ("metrics file", "link to a file")]


@pytest.mark.parametrize(("writer", "kind"), CASES)
def test_every_writer_refuses_what_is_not_a_regular_file_and_changes_nothing(tmp_path, writer, kind):
    where, write = _writers()[writer]
    given, target = _plant(kind, where(tmp_path))
    before = _node(given)
    with within(), pytest.raises(FileError) as info:
        write(tmp_path)
    named = given.resolve() if writer == "metrics file" else given
    assert f"{named} is a" in str(info.value) and "not a regular file: refused" in str(info.value)
    assert _node(given) == before and target.read_bytes() == PRECIOUS and Path("/dev/null").is_char_device()
    assert not [p for p in given.parent.iterdir() if p.name.endswith(".tmp")]


def test_the_preflights_look_at_a_planted_writer_lock_refuses_it_and_writes_nothing(tmp_path):
    """The writer lock's target was truncated and given the writer's pid by the logger; the
    preflight's check opened it too."""
    from verl_patches.resume import check_no_writer, claim_metrics_file, writer_lock_path

    metrics = tmp_path / "run" / "metrics.jsonl"
    given, target = _plant("link to a file", writer_lock_path(metrics))
    for look in (check_no_writer, claim_metrics_file):
        with pytest.raises(FileError, match=f"{given} is a symbolic link"):
            look(metrics)
        assert given.is_symlink() and target.read_bytes() == PRECIOUS


def test_a_fifo_as_the_metrics_file_is_refused_at_once_by_the_logger_and_the_preflights_check(tmp_path):
    from verl_patches.resume import ResumableFileLog, check_no_writer

    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    with within():
        for look in (check_no_writer, ResumableFileLog):
            with pytest.raises(FileError, match=f"{fifo} is a FIFO"):
                look(fifo)


def test_a_fifo_as_the_secrets_file_is_refused_at_once_by_every_process_and_the_preflight(tmp_path):
    from recipe.stapo.preflight import check_environment
    from verl_patches.env_file import SECRETS_FILE_ENV, load_secrets_file

    fifo = tmp_path / "secrets.env"
    os.mkfifo(fifo, 0o600)
    with within():
        with pytest.raises(ValueError, match=f"{SECRETS_FILE_ENV}={fifo} is a FIFO"):
            load_secrets_file({SECRETS_FILE_ENV: str(fifo)})  # what every verl process runs on import
        (problem,) = check_environment({SECRETS_FILE_ENV: str(fifo)})
    assert problem.key == SECRETS_FILE_ENV and f"{fifo} is a FIFO (named pipe), not a regular file" in str(problem)


def test_a_read_of_a_user_named_file_follows_a_link_but_never_waits_on_a_fifo(tmp_path):
    target = tmp_path / "data.jsonl"
    target.write_bytes(PRECIOUS)
    (tmp_path / "link").symlink_to(target)
    assert read_bytes(tmp_path / "link") == PRECIOUS
    os.mkfifo(tmp_path / "fifo")
    with within(), pytest.raises(FileError, match="is a FIFO"):
        read_bytes(tmp_path / "fifo")
    with pytest.raises(FileError, match="is a symbolic link"):
        open_regular(tmp_path / "link", os.O_RDONLY | os.O_NOFOLLOW)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "absent")


def test_a_node_planted_between_the_check_and_the_open_is_refused_by_what_was_opened(tmp_path, monkeypatch):
    """``fstat`` of the opened descriptor decides, whatever the path looked like a moment before."""
    from stapo_core import fileio

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(fileio, "check_regular", lambda path, follow=False: None)  # the race: the check saw a file
    with within():
        with pytest.raises(FileError, match="is a FIFO"):
            open_regular(fifo, os.O_RDONLY)  # opens (no writer needed under O_NONBLOCK), then fstat refuses
        with pytest.raises(FileError, match="is a FIFO"):
            open_regular(fifo, os.O_WRONLY)  # no reader: the open itself refuses (ENXIO)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    with pytest.raises(FileError, match="is a symbolic link"):
        open_regular(link, os.O_WRONLY | os.O_CREAT)
    assert not (tmp_path / "target").exists()


def test_a_whole_file_is_replaced_through_a_synced_temp_file_and_a_failure_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "out" / "summary.json"
    atomic_write(path, "old\n")
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append((a, b)), real_replace(a, b)))
    atomic_write(path, b"new\n")
    ((tmp, final),) = renamed
    assert Path(tmp).parent == path.parent and Path(tmp).name.startswith(".summary.json.") and final == path
    assert synced == [tmp] and path.read_bytes() == b"new\n"

    def boom(tmp):
        Path(tmp).write_text("half")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError):
        atomic_write(path, boom)
    assert path.read_bytes() == b"new\n" and sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("at", ["write", "replace"])
def test_a_full_or_read_only_disk_is_one_error_naming_the_file_and_the_old_file_stays(tmp_path, monkeypatch, code, at):
    path = tmp_path / "run_config.json"
    atomic_write_json(path, {"evaluated": 1})

    def refused(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, at, refused)
    with pytest.raises(FileError) as info:
        atomic_write_json(path, {"evaluated": 2})
    monkeypatch.undo()
    assert info.value.errno == code and str(info.value).startswith(f"{path}: cannot write it ({os.strerror(code)})")
    assert json.loads(path.read_text()) == {"evaluated": 1} and os.listdir(tmp_path) == ["run_config.json"]


def _fill_after(monkeypatch, room: int, code: int = errno.ENOSPC) -> None:
    """``os.write`` writes ``room`` more bytes, then the disk is full."""
    real_write, left = os.write, [room]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(code, os.strerror(code))
        done = real_write(fd, bytes(data[:left[0]]))
        left[0] -= done
        return done

    monkeypatch.setattr(os, "write", write)


def test_an_append_that_fills_the_disk_midway_is_cut_back_to_the_lines_before(tmp_path, monkeypatch):
    path = tmp_path / "grades.jsonl"
    append_lines(path, ['{"a": 1}', '{"a": 2}'])
    before = path.read_bytes()
    _fill_after(monkeypatch, room=5)  # half of the next line fits
    with pytest.raises(FileError, match=f"^{path}: cannot write it \\(No space left on device\\)"):
        append_lines(path, ['{"a": 3}', '{"a": 4}'])
    monkeypatch.undo()
    assert path.read_bytes() == before
    append_lines(path, ['{"a": 3}'])
    assert path.read_bytes() == before + b'{"a": 3}\n'


def test_a_full_disk_loses_no_logged_metrics_step_and_names_the_file(tmp_path, monkeypatch):
    """A step's line was cut where the disk filled up, silently, and the next relaunch moved it to
    ``.unreadable``: that step's training metrics were gone."""
    from verl_patches.resume import ResumableFileLog, read_step_lines

    path = tmp_path / "metrics.jsonl"
    log = ResumableFileLog(path)
    log.log({"loss": 1.0}, 1)
    log.log({"loss": 0.5}, 2)
    before = path.read_bytes()
    _fill_after(monkeypatch, room=7)
    with pytest.raises(FileError, match=f"^{path}: cannot write it \\(No space left on device\\)"):
        log.log({"loss": 0.25}, 3)
    assert path.read_bytes() == before
    with pytest.raises(FileError):  # step 2 again (validation merged into it): its record is put back
        log.log({"val/acc": 0.1}, 2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    log.log({"loss": 0.25}, 3)
    log.close()
    assert [json.loads(line) for _, line in read_step_lines(path)] == [
        {"step": 1, "data": {"loss": 1.0}}, {"step": 2, "data": {"loss": 0.5}}, {"step": 3, "data": {"loss": 0.25}}]


def test_a_full_disk_keeps_the_evaluation_records_and_the_token_dump_written_before(tmp_path, monkeypatch):
    from recipe.stapo.eval.generate import JsonlStore
    from stapo_core.token_records import step_file, write_step

    token = {"kind": "token", "step": 1, "method": "stapo", "uid": "u", "response_index": 0, "position": 0,
             "token_id": 5, "token": "t", "context_before": "", "context_after": "", "prob": 0.001, "entropy": 0.5,
             "advantage": 1.0, "candidate": True, "silenced": True, "grad_norm": 1.0, "top5": []}
    store = JsonlStore(tmp_path / "generations.jsonl")
    store.append([{"problem_index": 0, "sample": 0}])
    write_step(tmp_path, 1, [token])
    before = store.path.read_bytes(), step_file(tmp_path, 1).read_bytes()
    _fill_after(monkeypatch, room=3, code=errno.EROFS)
    with pytest.raises(FileError, match="Read-only file system"):
        store.append([{"problem_index": 1, "sample": 0}, {"problem_index": 2, "sample": 0}])
    with pytest.raises(FileError, match=f"{step_file(tmp_path, 1)}: cannot write it"):
        write_step(tmp_path, 1, [dict(token, silenced=False)])
    monkeypatch.undo()
    assert (store.path.read_bytes(), step_file(tmp_path, 1).read_bytes()) == before
    assert [r["problem_index"] for _, r in store.read()] == [0]


def _summaries(folder: Path) -> list[str]:
    """Two evaluation summaries Table 2 reads (8B, JustRL 40 and STAPO 50 on every benchmark)."""
    names = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
    paths = []
    for method, value in (("JustRL", 40.0), ("STAPO", 50.0)):
        block = {"benchmarks": {name: {"mean_at_n": value} for name in names}}
        path = folder / f"{method}.json"
        path.write_text(json.dumps({"scale": "8B", "method": method, "prompt_form": "justrl-eval",
                                    "decodings": {"train": block, "justrl": block}}))
        paths.append(str(path))
    return paths


def _run(folder: Path) -> str:
    """A run folder with three logged steps."""
    (folder / "run").mkdir()
    (folder / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "data": {"critic/score/mean": step / 10}}) + "\n" for step in (1, 2, 3)))
    return str(folder / "run")


def _commands(folder: Path) -> dict:
    """``{name: main(out)}``: every command-line writer's ``--out`` (or ``--out-dir``), the rest valid."""
    from recipe.stapo import inspect, plots
    from recipe.stapo.data import prepare
    from recipe.stapo.eval import run_eval, tables
    from stapo_cpu import quickstart

    return {"tables": lambda out: tables.main([*_summaries(folder), "--out", out]),
            "plots": lambda out: plots.main([_run(folder), "--out", out]),
            "inspect": lambda out: inspect.main([_run(folder), "--out", out]),
            "prepare": lambda out: prepare.main(["train", "--out-dir", out]),
            "run_eval": lambda out: run_eval.main(["--model", "m", "--benchmarks-dir", str(folder), "--out", out]),
            "quickstart --out": lambda out: quickstart.main(["--out", out]),
            "quickstart --assets": lambda out: quickstart.main(["--out", str(folder / "q"), "--assets", out])}


@pytest.mark.parametrize("blank", ["", " "])
@pytest.mark.parametrize("command", ["tables", "plots", "inspect", "prepare", "run_eval", "quickstart --out",
                                     "quickstart --assets"])
def test_an_empty_output_path_is_refused_never_read_as_the_working_folder(tmp_path, monkeypatch, capsys, command, blank):
    """``Path('')`` is the working folder: `plots --out ''` wrote its PNGs there, `quickstart --assets ''`
    began building the tiny assets in it, `tables --out ''` wrote nothing and said nothing."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as exit_:
        _commands(tmp_path)[command](blank)
    assert exit_.value.code == 2 and "an empty path" in capsys.readouterr().err
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("name", ["afile/", "new/"])
def test_an_output_file_named_with_a_trailing_separator_is_refused_and_the_file_there_kept(tmp_path, capsys, name):
    """`tables --out afile/` replaced the file afile with the table; `--out new/` wrote a file named new."""
    (tmp_path / "afile").write_bytes(PRECIOUS)
    assert _commands(tmp_path)["tables"](f"{tmp_path}{os.sep}{name}") == 2
    assert f"ends with {os.sep}, as a folder does" in capsys.readouterr().err
    assert (tmp_path / "afile").read_bytes() == PRECIOUS and not (tmp_path / "new").exists()


def test_an_output_folder_too_long_to_name_or_a_dangling_link_is_named(tmp_path):
    """A name over the system's limit was an OSError traceback out of the quickstart; a link to nothing
    passed, then mkdir failed with 'File exists'."""
    from stapo_core.fileio import output_folder_problem

    assert "File name too long" in output_folder_problem("--out", tmp_path / ("n" * 300))
    (tmp_path / "link").symlink_to(tmp_path / "nothing")
    assert "is a symbolic link to nothing" in output_folder_problem("--out", tmp_path / "link")
    from stapo_cpu import quickstart

    with pytest.raises(SystemExit) as exit_:
        quickstart.parse_options(["--out", str(tmp_path / "q"), "--assets", str(tmp_path / ("a" * 300))])
    assert exit_.value.code == 2


def test_an_input_that_is_a_fifo_or_a_device_is_named_as_such_not_as_missing(tmp_path, capsys):
    """Table 2's input and a plotted run: 'not found' for a FIFO or /dev/zero, which exist."""
    from recipe.stapo import plots
    from recipe.stapo.eval import tables

    os.mkfifo(tmp_path / "fifo")
    with within():
        assert tables.main([*_summaries(tmp_path), str(tmp_path / "fifo")]) == 2
        assert "is a FIFO (named pipe), not a regular file" in capsys.readouterr().err
        assert plots.main(["/dev/zero", "--out", str(tmp_path / "plots")]) == 2
        assert "/dev/zero is a character device, not a regular file" in capsys.readouterr().err


def test_a_json_line_nested_too_deeply_is_named_not_a_recursion_error(tmp_path):
    from stapo_core.fileio import iter_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "data": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}\n")
    with pytest.raises(ValueError, match="line 1 nests JSON too deeply to read"):
        list(iter_jsonl(path))


@pytest.mark.parametrize("length", [240, 255])
def test_a_whole_file_whose_name_is_as_long_as_a_name_can_be_is_written(tmp_path, length):
    path = tmp_path / ("t" * (length - 3) + ".md")
    atomic_write(path, "| a |\n")
    atomic_write(path, "| b |\n")
    assert path.read_text() == "| b |\n" and os.listdir(tmp_path) == [path.name]


def test_an_output_folder_where_nothing_can_be_made_is_named_even_where_access_says_writable(tmp_path):
    """As root, os.access calls /sys writable; a folder cannot be made there (sysfs)."""
    from stapo_core.fileio import output_folder_problem

    assert output_folder_problem("--out", "/sys/stapo_out").startswith(
        "--out /sys/stapo_out cannot be created: /sys is not writable: ")
    assert output_folder_problem("--out", "/sys").startswith("--out /sys is not writable: ")
    assert output_folder_problem("--out", tmp_path / "new" / "out") is None and os.listdir(tmp_path) == []


def test_probe_creates_nothing_it_leaves_behind(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert probe_writable(target) is None
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    assert probe_writable(existing) is None and list(existing.iterdir()) == []
