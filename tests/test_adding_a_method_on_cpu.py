"""A contributor adds a token-selection rule and a method as docs/method.md says ("Adding a
token-selection rule": a mask function, one ``register_rule`` call in ``stapo_core/rules.py``, a
``config/method/<name>.yaml``), and the rule, method and config tests pass unchanged: they read
the rule table and the method folder, not lists of their own. Run in a copy of the tracked tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import tracked_copy

pytestmark = pytest.mark.slow

#: a contributor's rule: every rare token of a positive-advantage response loses its gradient
RULE = '''

def _select_rare_positive(settings, *, log_prob, entropy, advantages, response_mask, group=None,
                          generator=None) -> RuleResult:
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(log_prob)
    mask = response_mask != 0
    keep = (mask & ~((adv > 0) & (log_prob.exp() < settings.tau_p))).float()
    counts = torch.stack([mask.float().sum(), keep.sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    tokens, kept = counts.tolist()
    return RuleResult(keep, tokens, kept, {"tokens": tokens, "kept": kept})


RARE_POSITIVE = register_rule(SelectionRule(
    name="rare_positive",
    metric_prefix="rare_positive/",
    select=_select_rare_positive,
    reads_log_prob=True,
    positive_advantage_only=True,
    fields={"tau_p": "a probability in (0, 1)"},
    check=lambda settings: [] if _is_fraction(settings.tau_p) else [("tau_p", "a probability in (0, 1)")],
))

'''

#: its method: JustRL's settings with the rule, statistics of the policy being updated
METHOD = """# @package _global_
recipe:
  method: rare_positive
actor_rollout_ref:
  actor:
    policy_loss:
      loss_mode: vanilla
      token_selection: rare_positive
      stats_from: current
      scope: null
"""

TESTS = ("tests/verl_patches/test_rule_table_on_cpu.py", "tests/recipe/test_methods_on_cpu.py",
         "tests/recipe/test_config_on_cpu.py")


def test_a_contributors_rule_and_method_pass_the_rule_method_and_config_tests(tmp_path):
    tree = tracked_copy(tmp_path / "tree")
    rules = tree / "stapo_core" / "rules.py"
    text = rules.read_text()
    assert text.count("\n__all__") == 1
    rules.write_text(text.replace("\n__all__", RULE + "\n__all__"))
    (tree / "recipe" / "stapo" / "config" / "method" / "rare_positive.yaml").write_text(METHOD)
    # the copy's run scripts find this interpreter first on PATH (an activated environment), its modules the copy's
    env = dict(os.environ, PYTHONPATH=str(tree), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q", "-rA", *TESTS],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert " failed" not in out and " passed" in out
    # the contributed method was among the methods the tests composed
    assert "PASSED tests/recipe/test_methods_on_cpu.py::test_a_method_says_the_token_selection_its_composed_config_runs" \
           "[rare_positive]" in out
