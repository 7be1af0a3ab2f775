"""The evaluation commands README.md and docs/eval.md show that a CPU can run, run as written: in a
copy of the repository's tracked files (a fresh clone, so nothing is written into this checkout),
from its root, with the project's interpreter first on PATH (an activated environment)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.eval_models import SessionSegments, outliving
from tests.helpers.paths import REPO, tracked_copy

pytestmark = pytest.mark.heavy  # the CPU runs it starts take a machine turn (tests/conftest.py)

CPU_EVAL = "PRESET=cpu bash run_scripts/eval.sh"
PAPER_TABLE = "python -m recipe.stapo.eval.tables recipe/stapo/data/fixtures/paper_table2.md          # the paper's table"
FETCH = "python -m recipe.stapo.eval.verifier fetch-prompt --out $STAPO_DATA_DIR/compassverifier/prompts.py"


def _bash_lines(path: Path) -> list[str]:
    """The lines of the ```bash blocks of a markdown file."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            lines.append(line)
    return lines


def _clone(tmp_path: Path) -> Path:
    """The repository's tracked files, copied (what a fresh clone holds)."""
    return tracked_copy(tmp_path / "clone")


def _env(**env) -> dict[str, str]:
    """A shell's environment with the project's interpreter first on PATH, none of eval.sh's settings."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("PYTHON", "OUT", "STAPO_DATA_DIR", "BENCH_DIR", "PRESET", "MODEL", "PYTHONPATH")}
    full.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env)
    return full


def _run(command: str, cwd: Path, timeout: int, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _popen(command: str, cwd: Path, log: Path) -> subprocess.Popen:
    """``command`` started in a session of its own (its processes found by session id), its output
    written to ``log``."""
    with open(log, "w") as handle:
        return subprocess.Popen(["bash", "-c", command], cwd=cwd, env=_env(), stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_the_cpu_evaluation_is_shown_in_eval_md_as_run_here():
    assert CPU_EVAL in _bash_lines(REPO / "docs" / "eval.md")


def _part_lines(out: Path) -> int:
    return sum(path.read_bytes().count(b"\n") for path in out.glob("workers/rank*/generations/*.jsonl"))


@pytest.mark.slow
def test_the_cpu_evaluation_as_written_survives_kill_9_resumes_and_shows_progress_bars(tmp_path):
    """The documented CPU evaluation (vLLM's CPU build, 4 samples of each of the tiny task's 64
    held-out problems: 256 prompts, more than one engine step's token budget, which a chunk-prefilled
    seeded request on a CPU once killed the engine for; batches of 64), killed with SIGKILL once its
    worker has saved a batch: the worker (its parent-death signal) and its engine processes end, no
    /dev/shm segment the run used stays. The same command, run again as written, generates only what
    was missing, JustRL's grader grades all 256, and the console shows both bars, after a line saying
    what the wait before the first batch is."""
    clone = _clone(tmp_path)
    out = clone / "results" / "eval" / "cpu_shipped_assets_model"
    log = tmp_path / "killed.log"
    proc = _popen(CPU_EVAL, clone, log)
    watch = SessionSegments(proc.pid).start()
    deadline = time.monotonic() + 600
    while _part_lines(out) < 64 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None and _part_lines(out) < 256, f"the run ended before it could be killed:\n{log.read_text()[-3000:]}"
    # bash -c execs eval.sh's bash, which execs run_eval: proc.pid is the evaluation's main process
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not outliving(proc.pid), "the worker or its engine outlived the killed evaluation"
    used = watch.stop()
    assert any(name.startswith("psm_") for name in used), used  # vLLM's message queues were seen
    assert not [name for name in used if Path("/dev/shm", name).exists()], "the killed evaluation left /dev/shm segments"
    saved = _part_lines(out)
    assert 64 <= saved < 256

    start = time.monotonic()
    again = _run(CPU_EVAL, clone, timeout=900)
    elapsed = time.monotonic() - start
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"-> {out}" in again.stderr
    # what the wait at 0/256 is, said before it starts
    assert "[stapo] a worker process starts vLLM's CPU engine first (three processes each load torch and vLLM" in again.stderr
    plan = json.loads((out / "workers" / "rank0" / "plan.json").read_text())
    missing = 256 - saved
    assert len(plan["items"]) == missing  # only the missing samples were generated
    assert re.search(rf"generate \(1 worker\): 100%\|.*\| {missing}/{missing}", again.stderr), again.stderr[-3000:]
    assert re.search(r"grade val/justrl: 100%\|.*\| 256/256", again.stderr), again.stderr[-3000:]
    records = [json.loads(line) for line in (out / "generations" / "val__justrl.jsonl").read_text().splitlines()]
    assert len(records) == len({(r["problem_id"], r["sample"]) for r in records}) == 256
    summary = json.loads((out / "summary.json").read_text())
    block = summary["decodings"]["justrl"]["benchmarks"]["val"]
    assert (block["n_samples"], block["problems"], block["ungraded"]) == (4, 64, 0)
    assert summary["grading"]["label"] == "rule-only"
    assert (round(block["mean_at_n"], 2), round(block["mean_at_n_se"], 2)) == (60.94, 4.72)  # docs/eval.md's numbers
    assert summary["backend"] == "vllm" and summary["max_new_tokens"] == 160
    print(f"{CPU_EVAL}, resumed for {missing} samples: {elapsed:.0f} s, mean@4 {block['mean_at_n']:.2f}")


def test_the_papers_table_is_built_as_written(tmp_path):
    assert PAPER_TABLE in _bash_lines(REPO / "docs" / "eval.md")
    proc = _run(PAPER_TABLE, _clone(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "+7.13%" in proc.stdout and "| 8B | STAPO |" in proc.stdout


def test_fetch_prompt_as_written_fetches_the_official_prompt_or_says_what_to_do_offline(tmp_path):
    for doc in (REPO / "README.md", REPO / "docs" / "eval.md", REPO / "docs" / "cluster.md"):
        assert any(line.startswith(FETCH) for line in _bash_lines(doc)), doc
    proc = _run(FETCH, REPO, timeout=300, STAPO_DATA_DIR=str(tmp_path / "data"))
    written = tmp_path / "data" / "compassverifier" / "prompts.py"
    if proc.returncode == 0:  # a machine with internet
        assert "official CV_PROMPT of open-compass/CompassVerifier@c5d6700" in proc.stdout and written.is_file()
        return
    assert proc.returncode == 2 and not written.exists()
    assert "error: cannot download https://raw.githubusercontent.com/open-compass/CompassVerifier/" in proc.stderr
    assert "fetch-prompt --source FILE --out" in proc.stderr and "--verifier none" in proc.stderr
