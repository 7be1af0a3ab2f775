"""The evaluation commands README.md and docs/eval.md show that a CPU can run, run as written: in a
copy of the repository's tracked files (a fresh clone, so nothing is written into this checkout),
from its root, with the project's interpreter first on PATH (an activated environment)."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

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
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    clone = tmp_path / "clone"
    for name in filter(None, files.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    return clone


def _run(command: str, cwd: Path, timeout: int, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("PYTHON", "OUT", "STAPO_DATA_DIR", "BENCH_DIR", "PRESET", "MODEL", "PYTHONPATH")}
    full.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def test_the_cpu_evaluation_is_documented_alike_in_the_readme_and_eval_md():
    assert CPU_EVAL in _bash_lines(REPO / "README.md")
    assert CPU_EVAL in _bash_lines(REPO / "docs" / "eval.md")


@pytest.mark.slow
def test_the_cpu_evaluation_runs_as_written_with_progress_bars(tmp_path):
    """vLLM's CPU build generates 4 samples of each of the tiny task's 64 held-out problems (256
    prompts: more than one engine step's token budget, which a chunk-prefilled seeded request on a
    CPU once killed the engine for), JustRL's grader grades them; the console shows both bars."""
    clone = _clone(tmp_path)
    start = time.monotonic()
    proc = _run(CPU_EVAL, clone, timeout=1200)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = clone / "results" / "eval" / "cpu_shipped_assets_model"
    assert f"-> {out}" in proc.stderr
    assert re.search(r"generate \(1 worker\): 100%\|.*\| 256/256", proc.stderr), proc.stderr[-3000:]
    assert re.search(r"grade val/justrl: 100%\|.*\| 256/256", proc.stderr), proc.stderr[-3000:]
    import json

    summary = json.loads((out / "summary.json").read_text())
    block = summary["decodings"]["justrl"]["benchmarks"]["val"]
    assert (block["n_samples"], block["problems"], block["ungraded"]) == (4, 64, 0)
    assert 0.0 <= block["mean_at_n"] <= 100.0 and summary["grading"]["label"] == "rule-only"
    assert summary["backend"] == "vllm" and summary["max_new_tokens"] == 160
    print(f"PRESET=cpu bash run_scripts/eval.sh: {elapsed:.0f} s, mean@4 {block['mean_at_n']:.2f}")


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
