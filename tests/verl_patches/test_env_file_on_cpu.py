"""Secrets from a private file (verl_patches.env_file): what every verl process loads from
``STAPO_SECRETS_FILE`` instead of receiving the values in the Ray job's runtime environment."""

from __future__ import annotations

import os

import pytest

from verl_patches.env_file import SECRETS_FILE_ENV, load_secrets_file, parse_env_file

SECRET = "wandb-secret-0123456789abcdef"


def _file(tmp_path, text, mode=0o600):
    path = tmp_path / "secrets.env"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_formats_a_shell_env_file_uses(tmp_path):
    path = _file(tmp_path, f"# wandb\nWANDB_API_KEY={SECRET}\n\nexport HF_TOKEN='hf_x y'\n  WANDB_ENTITY=\"team\"  \nEMPTY=\n")
    assert parse_env_file(path) == {"WANDB_API_KEY": SECRET, "HF_TOKEN": "hf_x y", "WANDB_ENTITY": "team", "EMPTY": ""}


def test_variables_already_set_win_and_only_new_ones_are_reported(tmp_path):
    path = _file(tmp_path, f"WANDB_API_KEY={SECRET}\nHF_TOKEN=hf_file\n")
    environ = {SECRETS_FILE_ENV: str(path), "HF_TOKEN": "hf_shell"}
    assert load_secrets_file(environ) == ["WANDB_API_KEY"]
    assert environ["WANDB_API_KEY"] == SECRET and environ["HF_TOKEN"] == "hf_shell"
    assert load_secrets_file({}) == []


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_file_others_can_read_is_refused(tmp_path, mode):
    path = _file(tmp_path, f"WANDB_API_KEY={SECRET}\n", mode)
    with pytest.raises(ValueError, match=rf"{SECRETS_FILE_ENV}=.*group or others.*chmod 600") as info:
        load_secrets_file({SECRETS_FILE_ENV: str(path)})
    assert SECRET not in str(info.value)


def test_a_missing_file_and_a_malformed_line_are_named_without_values(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read it .*every node"):
        parse_env_file(tmp_path / "absent.env")
    path = _file(tmp_path, f"WANDB_API_KEY={SECRET}\nnot a line {SECRET}\n")
    with pytest.raises(ValueError, match=r"line 2: expected NAME=value") as info:
        parse_env_file(path)
    assert SECRET not in str(info.value)


def test_installing_the_patches_loads_the_file(tmp_path, monkeypatch):
    """``verl_patches.install`` (what ``import verl_patches.activate`` runs in every verl process) loads it."""
    from verl_patches.install import install

    path = _file(tmp_path, "STAPO_TEST_SECRET_FROM_FILE=loaded\n")
    monkeypatch.setenv(SECRETS_FILE_ENV, str(path))
    monkeypatch.setenv("STAPO_TEST_SECRET_FROM_FILE", "")  # recorded, so the variable is removed afterwards
    monkeypatch.delenv("STAPO_TEST_SECRET_FROM_FILE")
    install()
    assert os.environ["STAPO_TEST_SECRET_FROM_FILE"] == "loaded"
