"""The method list is the method YAMLs: each file's name, table row and token selection, read once."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from recipe.stapo import methods as methods_module
from recipe.stapo.driver import compose
from recipe.stapo.methods import METHOD_DIR, TOKEN_SELECTION_KEY, methods
from stapo_core.rules import token_selections


def test_every_method_yaml_is_a_method_in_table_order():
    assert sorted(methods()) == sorted(p.stem for p in METHOD_DIR.glob("*.yaml"))
    rows = [m.table_row for m in methods().values()]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)
    assert list(methods())[:4] == ["grpo", "entropy20", "justrl", "stapo"]  # the paper's table


@pytest.mark.parametrize("name", sorted(p.stem for p in METHOD_DIR.glob("*.yaml")))
def test_a_method_says_the_token_selection_its_composed_config_runs(name):
    method = methods()[name]
    composed = OmegaConf.select(compose([f"method={name}", "model=qwen3_8b"]), TOKEN_SELECTION_KEY)
    assert method.token_selection == composed and method.token_selection in token_selections()


def test_a_method_file_without_its_row_is_refused_naming_the_file(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("recipe:\n  method: mine\n")
    monkeypatch.setattr(methods_module, "METHOD_DIR", tmp_path)
    methods.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"mine\.yaml: expected recipe.method: mine and an integer recipe.table_row"):
            methods()
    finally:
        monkeypatch.undo()
        methods.cache_clear()
