"""``run_scripts/eval.sh`` refuses a checkpoint that does not exist or is not completely written,
naming what is missing, before anything is written (no output folder, no conversion)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.eval_models import bench_dir, fixture_rows
from tests.helpers.paths import REPO

EVAL = REPO / "run_scripts" / "eval.sh"


def _run(cwd, model, out, bench, **env):
    full = {**os.environ, "MODEL": model, "OUT": str(out), "STAPO_DATA_DIR": str(bench), "PYTHON": sys.executable,
            "BACKEND": "hf", "VERIFIER": "none", **env}
    return subprocess.run(["bash", str(EVAL), "--benchmarks", "aime24", "--decoding", "train"], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)


def _written(tmp_path, *paths):
    return [p for p in paths if Path(p).exists()]


@pytest.fixture()
def bench(tmp_path):
    return bench_dir(tmp_path / "bench", fixture_rows())


def test_a_checkpoint_not_saved_yet_is_refused_before_anything_is_written(tmp_path, bench):
    """A relative global_step_N path that does not exist is a missing path, never a hub id."""
    proc = _run(tmp_path, "ck/qwen3_8b_stapo/global_step_200", tmp_path / "out", bench)
    assert proc.returncode == 2, proc.stderr
    assert f"{tmp_path}/ck/qwen3_8b_stapo/global_step_200: no such folder" in proc.stderr
    assert "relative paths are taken from" not in proc.stderr  # eval.sh passed it made absolute: no other base named
    assert "Traceback" not in proc.stderr and "OSError" not in proc.stderr
    assert not (tmp_path / "out").exists()


def _shard(actor: Path, world: int, rank: int) -> None:
    actor.mkdir(parents=True, exist_ok=True)
    (actor / f"model_world_size_{world}_rank_{rank}.pt").write_bytes(b"")


@pytest.mark.parametrize("case", ["no_actor", "no_hf_config", "missing_rank", "being_saved"])
def test_a_half_written_checkpoint_is_refused_naming_what_is_missing(tmp_path, bench, case):
    runs = tmp_path / "ck" / "qwen3_8b_stapo"
    step = runs / "global_step_200"
    actor = step / "actor"
    step.mkdir(parents=True)
    (runs / "latest_checkpointed_iteration.txt").write_text("200")
    if case != "no_actor":
        (actor / "huggingface").mkdir(parents=True)
        if case != "no_hf_config":
            (actor / "huggingface" / "config.json").write_text("{}")
        _shard(actor, 2, 0)
        if case != "missing_rank":
            _shard(actor, 2, 1)
    if case == "being_saved":
        (runs / "latest_checkpointed_iteration.txt").write_text("100")
    expected = {
        "no_actor": f"{actor}/ (the actor's folder)",
        "no_hf_config": f"{actor}/huggingface/config.json",
        "missing_rank": f"{actor}/model_world_size_2_rank_1.pt (rank 1 of 2)",
        "being_saved": "says the last finished save is step 100",
    }[case]
    proc = _run(tmp_path, str(step), tmp_path / "out", bench)
    assert proc.returncode == 2, proc.stderr
    assert "is not a completely written verl checkpoint" in proc.stderr and expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not _written(tmp_path, tmp_path / "out", actor / "merged_hf", actor / "merged_hf.partial")


def test_a_complete_merged_checkpoint_skips_the_checks(tmp_path, bench):
    """With the converted copy present, eval.sh goes on to run_eval (which refuses the empty weights)."""
    step = tmp_path / "ck" / "run" / "global_step_5"
    (step / "actor").mkdir(parents=True)  # a checkpoint's shards are not looked at once it is converted
    merged = step / "merged_hf"  # beside actor/, where retention does not reach
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    (merged / "model.safetensors").write_bytes(b"")
    proc = _run(tmp_path, str(step), tmp_path / "out", bench, PYTHON=str(_fake_python(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[argv.index("--model") + 1] == str(merged)
    assert argv[argv.index("--verifier") + 1] == "none"


def _fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "fakepython"
    fake.write_text('#!/usr/bin/env bash\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    return fake


def test_the_default_grading_is_the_papers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VERIFIER", "VERIFIER_PROMPT")}
    env.update(MODEL="Qwen/Qwen3-8B", PYTHON=str(_fake_python(tmp_path)), VERIFIER_PROMPT="cv/prompts.py")
    proc = subprocess.run(["bash", str(EVAL)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[argv.index("--verifier") + 1] == "auto"
    assert argv[argv.index("--verifier-prompt-file") + 1] == str(tmp_path / "cv" / "prompts.py")


def _zip_shard(actor: Path, world: int, rank: int, cut: bool = False) -> None:
    """A shard written as torch.save writes (a zip archive); ``cut``: its last bytes missing, as a
    save killed mid-write leaves it."""
    import io
    import zipfile

    actor.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", b"x" * 4096)
    data = buffer.getvalue()
    (actor / f"model_world_size_{world}_rank_{rank}.pt").write_bytes(data[: len(data) // 2] if cut else data)


def _first_checkpoint(tmp_path, cut_rank=None, hf_config="{}"):
    """The first checkpoint of a run (no latest_checkpointed_iteration.txt yet: verl writes it after a save)."""
    step = tmp_path / "ck" / "qwen3_8b_stapo" / "global_step_10"
    actor = step / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text(hf_config)
    for rank in range(2):
        _zip_shard(actor, 2, rank, cut=rank == cut_rank)
    return step, actor


def test_a_first_checkpoint_killed_mid_save_is_refused(tmp_path, bench):
    step, actor = _first_checkpoint(tmp_path, cut_rank=1)
    proc = _run(tmp_path, str(step), tmp_path / "out", bench)
    assert proc.returncode == 2, proc.stderr
    assert f"the end of {actor}/model_world_size_2_rank_1.pt (cut off" in proc.stderr
    assert "rank_0" not in proc.stderr
    assert not _written(tmp_path, tmp_path / "out", step / "merged_hf", step / "merged_hf.partial")


def test_a_damaged_checkpoint_config_is_refused(tmp_path, bench):
    step, actor = _first_checkpoint(tmp_path, hf_config='{"model_type": ')
    proc = _run(tmp_path, str(step), tmp_path / "out", bench)
    assert proc.returncode == 2 and f"a readable {actor}/huggingface/config.json" in proc.stderr


def test_a_failing_merger_leaves_no_partial_folder(tmp_path, bench):
    step, actor = _first_checkpoint(tmp_path)
    fake = tmp_path / "python_merger_fails"
    fake.write_text(f'#!/usr/bin/env bash\n[ "$2" = verl.model_merger ] && {{ echo merger exploded >&2; '
                    f'mkdir -p "${{@: -1}}"; exit 1; }}\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    proc = _run(tmp_path, str(step), tmp_path / "out", bench, PYTHON=str(fake))
    assert proc.returncode == 2, proc.stderr
    assert "merger exploded" in proc.stderr and "verl's model merger failed" in proc.stderr
    assert not _written(tmp_path, tmp_path / "out", step / "merged_hf", step / "merged_hf.partial")


# ----------------------------------------------------------------------------------------------
# one evaluation path: the run scripts' data folder; what eval.sh announces is what it uses
# ----------------------------------------------------------------------------------------------
def _argv_of(tmp_path, *args, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("OUT", "STAPO_DATA_DIR", "BENCH_DIR", "PRESET")}
    full.update({"MODEL": "Qwen/Qwen3-8B", "PYTHON": str(_fake_python(tmp_path)), **env})
    proc = subprocess.run(["bash", str(EVAL), *args], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=60)
    return proc, proc.stdout.splitlines()


def _value(argv, flag):
    assert argv.count(flag) == 1, argv  # passed once: what run_eval uses is what eval.sh announced
    return argv[argv.index(flag) + 1]


def test_the_benchmarks_come_from_the_run_scripts_data_folder(tmp_path):
    proc, argv = _argv_of(tmp_path, STAPO_DATA_DIR="shared/data")
    assert proc.returncode == 0, proc.stderr
    assert _value(argv, "--benchmarks-dir") == str(tmp_path / "shared" / "data")
    proc, argv = _argv_of(tmp_path)  # unset: the run scripts' default
    assert _value(argv, "--benchmarks-dir") == str(REPO / "data" / "stapo")
    proc, _ = _argv_of(tmp_path, BENCH_DIR="bench")
    assert proc.returncode == 2
    assert "BENCH_DIR is not read: eval.sh reads the benchmarks from STAPO_DATA_DIR" in proc.stderr
    assert "set STAPO_DATA_DIR=bench" in proc.stderr


@pytest.mark.parametrize("args", [["--out", "elsewhere"], ["--out=elsewhere"]])
def test_an_out_argument_is_the_folder_announced_and_used(tmp_path, args):
    proc, argv = _argv_of(tmp_path, *args, "--limit", "2", OUT="ignored")
    assert proc.returncode == 0, proc.stderr
    assert _value(argv, "--out") == str(tmp_path / "elsewhere")
    assert f"-> {tmp_path / 'elsewhere'}" in proc.stderr and "ignored" not in proc.stderr
    assert argv[-2:] == ["--limit", "2"]  # the other extra arguments pass through
    proc, argv = _argv_of(tmp_path, "--benchmarks-dir", "mine")
    assert _value(argv, "--benchmarks-dir") == str(tmp_path / "mine") and f"on {tmp_path / 'mine'}" in proc.stderr


def test_the_cpu_preset_evaluates_the_shipped_tiny_model_on_its_held_out_problems(tmp_path):
    proc, argv = _argv_of(tmp_path, "--n-samples", "2", MODEL="", PRESET="cpu")
    assert proc.returncode == 0, proc.stderr
    shipped = REPO / "stapo_cpu" / "shipped_assets"
    assert _value(argv, "--model") == str(shipped / "model")
    assert _value(argv, "--benchmarks-dir") == str(shipped)
    assert (_value(argv, "--decoding"), _value(argv, "--verifier")) == ("justrl", "none")
    assert _value(argv, "--out") == str(REPO / "results" / "eval" / "cpu_shipped_assets_model")
    assert argv[argv.index("--benchmarks") + 1] == "val" and argv[-2:] == ["--n-samples", "2"]  # the user's last
    proc, _ = _argv_of(tmp_path, PRESET="gpu")
    assert proc.returncode == 2 and "PRESET=gpu: unknown preset" in proc.stderr


def test_a_converted_copy_cut_off_is_refused_naming_the_folder_to_remove(tmp_path, bench, assets):
    """A merged_hf whose weights end early (a conversion into another filesystem killed in its final
    move, a copy cut off): eval.sh reuses a converted copy, so run_eval's model check refuses it,
    before anything is written, naming the folder to remove for eval.sh to convert again."""
    import shutil

    step = tmp_path / "ck" / "run" / "global_step_5"
    (step / "actor").mkdir(parents=True)
    merged = Path(shutil.copytree(Path(assets) / "model", step / "merged_hf"))
    weights = merged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = _run(tmp_path, str(step), tmp_path / "out", bench)
    assert proc.returncode == 2, proc.stderr
    assert f"{weights}: " in proc.stderr and "cut off while being written or copied?" in proc.stderr
    assert f"remove {merged} and rerun eval.sh on the checkpoint: it converts it again" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
