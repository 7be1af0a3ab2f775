"""docs/trl.md's examples: the CPU one runs as written (offline, the shipped tiny model, from the
repository's root); the paper-scale one (a GPU, a hub model) trains with the paper's settings."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.heavy  # the CPU runs it starts take a machine turn (tests/conftest.py)

DOC = REPO / "docs" / "trl.md"


def python_block(heading: str) -> str:
    """The first ```python block after the markdown heading ``heading``."""
    text = DOC.read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.mark.slow
def test_the_cpu_example_runs_as_written(assets, tmp_path):
    """The block, written to a file and run by Python in a folder laid out as the repository's root
    (the shipped assets, here the session's copy of them), with the hub switched off."""
    (tmp_path / "stapo_cpu").mkdir()
    (tmp_path / "stapo_cpu" / "shipped_assets").symlink_to(assets, target_is_directory=True)
    block = python_block("### On a CPU, offline")
    (tmp_path / "example.py").write_text(block)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))  # this checkout's stapo_trl
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = re.findall(r"\{'loss': .*?'s2t/tokens': '(\d+)'.*?\}", done.stdout + done.stderr)
    assert len(steps) == 4 and all(int(n) > 0 for n in steps)
    assert (tmp_path / "results" / "stapo-tiny").is_dir()


def test_without_bf16_false_a_machine_without_gpu_refuses_the_config(tmp_path):
    """Why the CPU example sets bf16=False: TRL's default bf16=True, refused without a GPU."""
    import torch

    from stapo_trl import STAPOConfig

    if torch.cuda.is_available():
        pytest.skip("the refusal is a CPU-only machine's; this one has a GPU")
    with pytest.raises(ValueError, match="Your setup doesn't support bf16/gpu"):
        STAPOConfig(output_dir=str(tmp_path))
    assert STAPOConfig(output_dir=str(tmp_path), bf16=False).bf16 is False


def test_the_paper_scale_example_has_the_papers_settings(tmp_path):
    from stapo_trl import STAPOConfig

    block = python_block("### At paper scale (a GPU, a model from the hub)")
    (call,) = [node for node in ast.walk(ast.parse(block))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "STAPOConfig"]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    kwargs.update(output_dir=str(tmp_path), bf16=False, use_cpu=True)  # what a CPU needs to build it
    args = STAPOConfig(**kwargs)
    settings = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, delta=10.0, tau_p=0.002, q=0.75)
    assert {k: getattr(args, k) for k in settings} == settings
    assert ", ".join(f"`{k}={v!r}`" if k != "loss_type" else "`loss_type=\"dapo\"` (TRL's default)"
                     for k, v in settings.items()) in DOC.read_text().replace("\n", " ")
