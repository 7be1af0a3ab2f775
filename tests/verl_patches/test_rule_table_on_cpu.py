"""The token-selection rule table: a rule registered by a test runs end to end through the config,
the mini-batch fold and the loss, its metrics under its own prefix, nothing else changed.

The toy rule silences every token of a positive-advantage response whose probability is below
``tau_p`` (S2T's candidates, all of them, with no entropy quantile): its reference is computed
another way, as verl's own loss on the batch whose mask excludes those tokens.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from stapo_core.rules import RULES, RuleResult, SelectionRule, get_rule, register_rule, token_selections, unregister_rule
from tests.helpers.verl_batch import micro_batch
from tests.verl_patches.test_token_selection_on_cpu import actor_config, batch, reference, verl_loss
from verl.utils import tensordict_utils as tu
from verl_patches.policy_loss_config import TokenSelectionLossConfig
from verl_patches.current_stats import forward_metric_prefix
from verl_patches.losses import ppo_loss_with_token_selection
from verl_patches.token_selection import fold_into_mini_batch

PL = "actor_rollout_ref.actor.policy_loss"


def _select_rare(settings, *, log_prob, entropy, advantages, response_mask, group=None, generator=None):
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(log_prob)
    mask = response_mask != 0
    silenced = mask & (adv > 0) & (log_prob.exp() < settings.tau_p)
    keep = (mask & ~silenced).float()
    counts = torch.stack([mask.float().sum(), keep.sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    tokens, kept = counts.tolist()
    return RuleResult(keep, tokens, kept, {"silenced": tokens - kept, "nothing_here": float("nan")})


TOY = SelectionRule(name="toy_rare", metric_prefix="toy_rare/", select=_select_rare, reads_log_prob=True,
                    positive_advantage_only=False, fields={"tau_p": "a probability in (0, 1)"},
                    check=lambda s: [] if 0 < s.tau_p < 1 else [("tau_p", "a probability in (0, 1)")])


#: the valid ``token_selection`` values before the test registers its rule (read from the table)
SHIPPED = token_selections()


@pytest.fixture
def toy_rule():
    register_rule(TOY)
    yield TOY
    unregister_rule(TOY.name)


def test_an_unregistered_rule_is_refused_naming_the_valid_ones():
    assert SHIPPED[0] == "none" and set(SHIPPED[1:]) == set(RULES) and "toy_rare" not in SHIPPED
    with pytest.raises(ValueError, match=re.escape(f"token_selection='toy_rare' is invalid: expected one of {list(SHIPPED)}")):
        TokenSelectionLossConfig(token_selection="toy_rare")
    with pytest.raises(KeyError, match="not a registered rule"):
        get_rule("toy_rare")


def test_the_table_refuses_a_taken_name_or_prefix(toy_rule):
    with pytest.raises(ValueError, match="taken"):
        register_rule(toy_rule)
    with pytest.raises(ValueError, match="taken"):
        register_rule(dataclasses.replace(toy_rule, name="none"))
    with pytest.raises(ValueError, match="prefix"):
        register_rule(dataclasses.replace(toy_rule, name="other", metric_prefix="s2t/"))


def test_a_registered_rule_runs_through_config_fold_and_loss(toy_rule):
    assert token_selections() == (*SHIPPED, "toy_rare")
    config = actor_config("method=justrl", f"{PL}.token_selection=toy_rare", f"{PL}.tau_p=0.01",
                          f"{PL}.stats_from=rollout")
    cfg = config.policy_loss
    assert cfg.folds_into_mini_batch and not cfg.applies_s2t
    mask, old, log_prob, entropy, adv = batch()
    data = micro_batch(mask, old, adv, entropy=entropy)
    metrics = fold_into_mini_batch(cfg, data)
    keep = _select_rare(cfg, log_prob=old, entropy=entropy, advantages=adv, response_mask=mask).keep
    silenced = int((mask * (1 - keep)).sum())
    assert silenced > 0
    # its metrics under its own prefix, the undefined one left out; beside them only JustRL's S2T monitor
    assert {k: v for k, v in metrics.items() if not k.startswith("s2t/")} == {"toy_rare/silenced": float(silenced)}
    assert metrics["s2t/applied"] == 0.0
    got = verl_loss(config, data["response_mask"], mask, old, log_prob, adv, entropy=entropy,
                    batch_num_tokens=int(data["loss_mask"].sum()), global_batch_size=tu.get(data, "global_batch_size"),
                    fn=ppo_loss_with_token_selection)
    want = reference(config, keep, mask, old, log_prob, adv)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert torch.all(got[1][(mask * (1 - keep)) == 1] == 0)


def test_a_registered_rule_inside_the_loss_logs_under_its_prefix(toy_rule):
    config = actor_config("method=justrl", f"{PL}.token_selection=toy_rare", f"{PL}.tau_p=0.01",
                          f"{PL}.stats_from=rollout", f"{PL}.scope=micro_batch")
    mask, old, log_prob, entropy, adv = batch()
    data = micro_batch(mask, old, adv, entropy=entropy)
    lp = log_prob.clone().requires_grad_(True)
    from tests.helpers.verl_batch import flat_model_output

    _, metrics = ppo_loss_with_token_selection(config=config, model_output={"log_probs": flat_model_output(lp, mask)},
                                               data=data)
    assert "toy_rare/silenced" in metrics and not any(k.startswith(("s2t/", "entropy_topk/")) for k in metrics)


def test_the_table_decides_the_current_forward(toy_rule):
    """A rule that is not decided by the positive-advantage sequences alone gets a full forward, and its
    forward's metrics go under its prefix; the monitor's forward goes under S2T's."""
    toy = TokenSelectionLossConfig(token_selection="toy_rare", stats_from="current")
    s2t = TokenSelectionLossConfig(token_selection="s2t", stats_from="current")
    monitor = TokenSelectionLossConfig(token_selection="none", stats_from="current", s2t_monitor=True)
    assert toy.forwards_current_policy and not toy.rule.positive_advantage_only
    assert s2t.forwards_current_policy and s2t.rule.positive_advantage_only and s2t.current_forward == "positive_advantage"
    assert [forward_metric_prefix(c) for c in (toy, s2t, monitor)] == ["toy_rare/", "s2t/", "s2t/"]


def test_every_rule_checks_its_own_fields():
    for rule in RULES.values():
        for key, expected in rule.fields.items():
            with pytest.raises(ValueError, match=f"policy_loss.{key}=.* is invalid: expected"):
                TokenSelectionLossConfig(**{key: -1.0 if key != "strategy" else "bogus"})
