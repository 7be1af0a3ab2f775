"""The resume inputs (``recipe.stapo.preflight.paths.check_resume``): what verl's trainer would refuse
after Ray starts, or run silently wrong, is refused by the driver's preflight, naming the key and the
file. Every case builds its input and runs ``recipe.stapo.driver.prepare`` on a paper run (64 GPUs)
composed on the stand-in cluster storage of tests/helpers/cluster_files.py."""

from __future__ import annotations

import pytest

from tests.recipe.test_preflight_on_cpu import cluster, paper, passes, problem, refused  # noqa: F401


# ------------------------------------------------------------------------------------------------
# resuming: verl's checkpoint tracker and resume_from_path
# ------------------------------------------------------------------------------------------------


def _checkpoint(run_dir, step: int, world: int = 64):
    actor = run_dir / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    (actor / f"model_world_size_{world}_rank_0.pt").write_bytes(b"")
    return actor.parent


@pytest.mark.parametrize("content, phrase", [
    ("abc", "ValueError: invalid literal for int() with base 10: 'abc'"),
    ("", "ValueError: invalid literal for int() with base 10: ''"),
    ("global_step_100", "invalid literal for int() with base 10: 'global_step_100'"),
    (None, "IsADirectoryError"),
])
def test_a_checkpoint_tracker_verl_cannot_read_is_refused(cluster, content, phrase):
    """verl reads latest_checkpointed_iteration.txt as int() of its text, after Ray, the model load and vLLM's start."""
    run_dir = cluster["ckpt"] / "qwen3_8b_stapo"
    _checkpoint(run_dir, 100)
    tracker = run_dir / "latest_checkpointed_iteration.txt"
    tracker.mkdir() if content is None else tracker.write_text(content)
    problem(refused(paper(cluster)), "trainer.default_local_dir", str(tracker), phrase,
            "write the step of a checkpoint", "100 there", "trainer.resume_mode=disable")
    passes(paper(cluster, "trainer.resume_mode=disable"))


def test_a_tracker_naming_a_step_whose_folder_is_gone_is_refused(cluster):
    """verl trained from step 0 without a word when the tracker's checkpoint folder was missing."""
    run_dir = cluster["ckpt"] / "qwen3_8b_stapo"
    _checkpoint(run_dir, 100)
    (run_dir / "latest_checkpointed_iteration.txt").write_text("200")
    problem(refused(paper(cluster)), "trainer.default_local_dir", "names step 200",
            f"{run_dir / 'global_step_200'} does not exist", "from step 0 without a word", "(100 there)")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("100\n")  # what verl writes: passes
    passes(paper(cluster))


def test_a_checkpoint_saved_on_another_gpu_count_is_refused(cluster):
    run_dir = cluster["ckpt"] / "qwen3_8b_stapo"
    _checkpoint(run_dir, 100, world=8)
    (run_dir / "latest_checkpointed_iteration.txt").write_text("100")
    problem(refused(paper(cluster)), "trainer.default_local_dir", "holds no model shards for 64 GPUs",
            "saved for: 8")
    passes(paper(cluster, "trainer.nnodes=1"))


def test_resume_from_path_with_a_trailing_slash_is_normalised_and_a_folder_inside_is_refused(cluster):
    """verl takes the step from what follows 'global_step_' in the path: '100/' or '100/actor' stopped the
    trainer after Ray. The driver makes the path absolute, which drops a trailing slash."""
    step = _checkpoint(cluster["ckpt"] / "elsewhere", 100)
    config = paper(cluster, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}/")
    passes(config)
    assert config.trainer.resume_from_path == str(step)
    problem(refused(paper(cluster, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}/actor")),
            "trainer.resume_from_path", "verl takes the step to resume at from the folder's name",
            "the global_step_<k> folder itself")
