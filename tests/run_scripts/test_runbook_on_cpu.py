"""The runbook's first steps on a cluster (README.md's "Paper runs", docs/cluster.md) as written, with
stand-ins for the tools a CPU machine lacks (``hf`` recording its downloads, ``sbatch`` recording its
jobs): the models land where the model configs read them, wandb's login comes before the first check
(which refuses a wandb run without it), and the 12 runs are the 12 run scripts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from recipe.stapo.driver import MODELS, compose
from recipe.stapo.eval.verifier import DEFAULT_COMPASS_MODEL
from tests.helpers.cluster_files import fake_cluster
from tests.helpers.paths import REPO, bash_lines

DOCS = (REPO / "README.md", REPO / "docs" / "cluster.md")


def _recorder(folder: Path, name: str, record: Path, extra: str = "") -> Path:
    """A stand-in for the command ``name``: appends its arguments to ``record``, then runs ``extra``."""
    folder.mkdir(exist_ok=True)
    tool = folder / name
    tool.write_text(f'#!/usr/bin/env bash\necho "${{RUN:-}} $*" >> {record}\n{extra}\n')
    tool.chmod(0o755)
    return folder


def _bash(command: str, cwd: Path, path_first: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "RUN", "LAUNCH", "WANDB_"))}
    full.update(PATH=f"{path_first}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def test_the_documented_downloads_are_where_the_runs_and_the_grading_look(tmp_path, monkeypatch):
    models = tmp_path / "models"
    monkeypatch.setenv("STAPO_MODEL_DIR", str(models))
    expected = {(f"Qwen/{Path(str(compose([f'model={m}']).actor_rollout_ref.model.path)).name}",
                 str(compose([f"model={m}"]).actor_rollout_ref.model.path)) for m in MODELS}
    expected.add((DEFAULT_COMPASS_MODEL, None))  # the grading's default, by its hub name: the HF cache
    for doc in DOCS:
        record = tmp_path / f"{doc.name}.hf"
        # hf download REPO [--local-dir DIR]: the folder gets a config.json
        hf = _recorder(tmp_path / "bin", "hf", record,
                       'case "$3" in --local-dir) mkdir -p "$4" && echo "{}" > "$4/config.json" ;; esac')
        lines = [line for line in bash_lines(doc) if line.lstrip().startswith(("hf download", "for m in"))]
        assert lines, doc
        for line in lines:
            proc = _bash(line, tmp_path, hf, STAPO_MODEL_DIR=str(models))
            assert proc.returncode == 0, proc.stderr
        downloads = set()
        for call in record.read_text().split("\n")[:-1]:
            args = call.split()
            assert args[0] == "download", call
            downloads.add((args[1], args[3] if args[2:3] == ["--local-dir"] else None))
        assert downloads == expected, doc
        for _, folder in expected - {(DEFAULT_COMPASS_MODEL, None)}:
            assert (Path(folder) / "config.json").is_file()


def _check(cwd: Path, home: Path, cluster: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "LAUNCH", "CKPT_DIR", "GPU_MEM",
                                                                      "WANDB_", "NETRC", "LOGGER"))}
    env.update(cluster, HOME=str(home), PYTHON=sys.executable)
    (check,) = [line.split("#")[0].strip() for line in bash_lines(REPO / "README.md") if "STAPO_DRY_RUN=check" in line]
    return subprocess.run(["bash", "-c", check], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_wandb_login_comes_before_the_first_check_which_needs_it(tmp_path):
    for doc in DOCS:
        lines = bash_lines(doc)
        login = next(i for i, line in enumerate(lines) if line.startswith("wandb login"))
        assert login < next(i for i, line in enumerate(lines) if "STAPO_DRY_RUN=check" in line), doc
    cluster = fake_cluster(tmp_path / "shared")
    home = tmp_path / "home"
    home.mkdir()
    refused = _check(tmp_path, home, cluster)
    assert refused.returncode == 1 and "run `wandb login`" in refused.stderr, refused.stderr[-3000:]
    netrc = home / ".netrc"  # what `wandb login` writes
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'0123456789abcdef' * 2}01234567\n")
    netrc.chmod(0o600)
    passed = _check(tmp_path, home, cluster)
    assert passed.returncode == 0 and "config OK" in passed.stderr, passed.stderr[-3000:]


def test_the_12_runs_are_the_12_run_scripts_submitted_as_the_runbook_says(tmp_path):
    (readme,) = [line for line in bash_lines(REPO / "README.md") if "LAUNCH=submit bash run_scripts/qwen3_" in line]
    assert "one of the 12 runs" in readme and "all 12: docs/cluster.md, section 5" in readme
    (loop,) = [line for line in bash_lines(REPO / "docs" / "cluster.md") if line.startswith("for run in")
               and "sbatch" in line]
    record = tmp_path / "sbatch_jobs"
    sbatch = _recorder(tmp_path / "bin", "sbatch", record)
    proc = _bash(loop, REPO, sbatch)
    assert proc.returncode == 0, proc.stderr
    jobs = [line.split() for line in record.read_text().splitlines()]
    assert all(args == ["run_scripts/slurm/stapo.sbatch"] for _, *args in jobs)
    scripts = sorted(f"run_scripts/{p.name}" for p in (REPO / "run_scripts").glob("qwen3_*_*.sh"))
    assert sorted(run for run, *_ in jobs) == scripts and len(scripts) == 12


def test_the_interpreters_default_is_said_alike_everywhere():
    """README's "Paper runs", the launch settings (docs/cluster.md section 5) and the evaluation (section 7)."""
    said = "`python3` when it has the recipe's requirements, else the project's `.venv`"
    cluster = (REPO / "docs" / "cluster.md").read_text()
    sections = dict(re.findall(r"^## (\d+)\. [^\n]*\n(.*?)(?=^## |\Z)", cluster, flags=re.S | re.M))
    paper_runs = (REPO / "README.md").read_text().split("## Paper runs", 1)[1].split("\n## ", 1)[0]
    for text in (paper_runs, sections["5"], sections["7"]):
        assert said in " ".join(text.split()), text[:300]
    assert "default `python3`, the one with vLLM" not in " ".join(cluster.split())
