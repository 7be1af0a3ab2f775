"""The method list is the method YAMLs, read once; the paper's comparison is one tuple,
``PAPER_METHODS``. A new method file is runnable by name at once and joins no comparison unless
named."""

from __future__ import annotations

import re
import shutil

import pytest
from omegaconf import OmegaConf

from recipe.stapo import driver
from recipe.stapo import methods as methods_module
from stapo_cpu import quickstart as qs
from stapo_cpu import quickstart_report
from recipe.stapo.driver import compose, prepare
from recipe.stapo.methods import METHOD_DIR, PAPER_METHODS, TOKEN_SELECTION_KEY, methods
from stapo_core.rules import token_selections
from tests.helpers.cluster_files import use_fake_cluster
from tests.helpers.paths import REPO

#: a method beside the paper's: STAPO at another quantile, a file of its own
NEW_METHOD = """# @package _global_
recipe:
  method: stapo_q05
actor_rollout_ref:
  actor:
    policy_loss:
      token_selection: s2t
      stats_from: current
      q: 0.5
"""


@pytest.fixture
def method_dir(tmp_path, monkeypatch):
    """A copy of the recipe's config folder that the driver composes from and the method list reads;
    the test writes method files into its ``method/`` folder."""
    config = tmp_path / "config"
    shutil.copytree(driver.CONFIG_DIR, config)
    monkeypatch.setattr(driver, "CONFIG_DIR", str(config))
    monkeypatch.setattr(methods_module, "METHOD_DIR", config / "method")
    methods.cache_clear()
    yield config / "method"
    monkeypatch.undo()
    methods.cache_clear()


def test_the_papers_methods_in_its_table_order_lead_the_method_list():
    assert PAPER_METHODS == ("grpo", "entropy20", "justrl", "stapo")  # Table 2's rows, top to bottom
    assert sorted(methods()) == sorted(p.stem for p in METHOD_DIR.glob("*.yaml"))
    assert tuple(methods())[:len(PAPER_METHODS)] == PAPER_METHODS
    assert len({m.color for m in methods().values()}) == len(methods())


@pytest.mark.parametrize("name", sorted(p.stem for p in METHOD_DIR.glob("*.yaml")))
def test_a_method_says_the_token_selection_its_composed_config_runs(name):
    method = methods()[name]
    composed = OmegaConf.select(compose([f"method={name}", "model=qwen3_8b"]), TOKEN_SELECTION_KEY)
    assert method.token_selection == composed and method.token_selection in token_selections()


def test_a_method_file_naming_another_method_is_refused_naming_the_file(method_dir):
    (method_dir / "mine.yaml").write_text("recipe:\n  method: yours\n")
    with pytest.raises(ValueError, match=r"mine\.yaml: expected recipe.method: mine \(the file's name\), got "
                                         r"recipe.method='yours'"):
        methods()


def test_a_missing_paper_method_is_refused_naming_it(method_dir):
    (method_dir / "entropy20.yaml").unlink()
    with pytest.raises(ValueError, match=r"no entropy20\.yaml: the paper's methods grpo, entropy20, justrl, stapo"):
        methods()


def test_a_new_method_file_runs_by_name_and_joins_no_comparison_unasked(method_dir, tmp_path, monkeypatch):
    """One new file: ``method=stapo_q05`` composes and passes the driver's whole preflight and verl's
    validation, and the quickstart runs it when named; the quickstart's default runs, its baselines
    and the README's method table stay the paper's four."""
    others = [m for m in methods() if m not in PAPER_METHODS]
    (method_dir / "stapo_q05.yaml").write_text(NEW_METHOD)
    methods.cache_clear()
    assert list(methods()) == [*PAPER_METHODS, *sorted([*others, "stapo_q05"])]
    assert methods()["stapo_q05"].token_selection == "s2t"

    cluster = use_fake_cluster(tmp_path / "shared", monkeypatch)
    config = compose(["method=stapo_q05", "model=qwen3_8b", "trainer.logger=[console]",
                      f"trainer.default_local_dir={cluster['ckpt']}/stapo_q05"])
    assert config.actor_rollout_ref.actor.policy_loss.q == 0.5
    logged = []
    prepare(config, log=logged.append, environ={})
    assert "preflight passed" in "\n".join(logged)

    out, assets = str(tmp_path / "out"), str(tmp_path / "assets")
    assert qs.parse_options(["--out", out, "--assets", assets]).methods == PAPER_METHODS
    assert qs.parse_options(["--out", out, "--assets", assets, "--methods", "justrl,stapo_q05"]).methods == (
        "justrl", "stapo_q05")
    assert quickstart_report.BASELINES == ("grpo", "entropy20", "justrl")
    readme_table = re.findall(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \|$", (REPO / "README.md").read_text(), re.MULTILINE)
    assert sorted(readme_table) == sorted(PAPER_METHODS)
