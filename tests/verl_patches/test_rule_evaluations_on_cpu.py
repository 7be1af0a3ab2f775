"""Each rule runs once per mini-batch, whatever the setting: the fold, the S2T monitor, the
current-policy statistics and their ``rollout_agreement``, the update effect and the token dump all
read the one selection of the mini-batch's view (inside the loss, ``scope=micro_batch``: once per
micro-batch).

Every rule of the table is wrapped by a counter; a step of three mini-batches goes through the
recipe's ``TrainingWorker.train_batch`` wrapper (the first on the rollout statistics, the later ones
on the current policy's where ``stats_from=current``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from stapo_core import rules
from tests.helpers.verl_batch import actor_config, candidate_batch, flat_model_output, micro_batch
from verl.utils import tensordict_utils as tu
from verl.workers import engine_workers
from verl_patches.losses import ppo_loss_with_token_selection
from verl_patches.mini_batch import wrap_train_batch
from verl_patches.token_dump import hook, settings

B, R = 6, 12
PL = "actor_rollout_ref.actor.policy_loss"
MINI_BATCHES = 3


@pytest.fixture
def evaluations(monkeypatch):
    """Counts each rule's evaluations (its ``select``) by rule name."""
    counts = Counter()
    for name, rule in list(rules.RULES.items()):
        def counted(*args, _select=rule.select, _name=name, **kwargs):
            counts[_name] += 1
            return _select(*args, **kwargs)
        monkeypatch.setitem(rules.RULES, name, dataclasses.replace(rule, select=counted))
    return counts


def batch():
    return candidate_batch(R)


class Worker:
    """The parts of verl's ``TrainingWorker`` the wrapper uses; ``infer_batch`` answers with the
    current statistics (the current-policy forward, the update effect's forwards)."""

    def __init__(self, config, current):
        self.loss_fn = partial(engine_workers.ppo_loss, config=config)
        self.engine = SimpleNamespace(get_data_parallel_group=lambda: None, module=torch.nn.Linear(1, 1))
        self.engine_config = SimpleNamespace(infer_micro_batch_size_per_gpu=B, use_dynamic_bsz=False,
                                             infer_max_token_len_per_gpu=None)
        self.config = SimpleNamespace(model_type="language_model")
        self.current = current
        self.train_batch = wrap_train_batch(lambda worker, data: tu.get_tensordict(
            tensor_dict={}, non_tensor_dict={"metrics": {}}))

    def infer_batch(self, data):
        lp, ent = (t[: len(data)] for t in self.current)
        valid = data["attention_mask"][:, -R:]
        return {"log_probs": flat_model_output(lp, valid), "entropy": flat_model_output(ent, valid)}


def step(config, evaluations) -> tuple[list, list]:
    """One step of :data:`MINI_BATCHES` mini-batches; returns each mini-batch's rule evaluations
    (``{rule: count}``) and metrics."""
    mask, old, adv, entropy, current = batch()
    worker = Worker(config, current)
    counts, metrics = [], []
    for i in range(MINI_BATCHES):
        data = micro_batch(mask, old, adv, entropy=entropy)
        tu.assign_non_tensor(data, update_lr_scheduler=i == MINI_BATCHES - 1)
        before = Counter(evaluations)
        out = worker.train_batch(worker, data)
        counts.append(dict(Counter(evaluations) - before))
        metrics.append(dict(tu.get(out, "metrics")))
    return counts, metrics


SETTINGS = {
    "stapo (stats_from=current, update effect)": (("method=stapo", f"{PL}.stats_from=current",
                                                   f"{PL}.update_effect_responses=2"), {"s2t": 1}),
    "stapo (stats_from=rollout)": (("method=stapo", f"{PL}.stats_from=rollout"), {"s2t": 1}),
    "monitor (stats_from=rollout, update effect)": (("method=justrl", f"{PL}.update_effect_responses=2"), {"s2t": 1}),
    "monitor (stats_from=current)": (("method=justrl", f"{PL}.stats_from=current"), {"s2t": 1}),
    "entropy20 with the monitor": (("method=entropy20",), {"entropy_topk": 1, "s2t": 1}),
    "entropy20 (stats_from=current) with the monitor": (("method=entropy20", f"{PL}.stats_from=current"),
                                                        {"entropy_topk": 1, "s2t": 1}),
}


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("dump", [False, True], ids=["no dump", "token dump"])
def test_each_rule_runs_once_per_mini_batch(name, dump, evaluations, monkeypatch):
    """The token dump reads the selection's S2T sets (its scoring itself is left out here: it needs a
    model; tests/verl_patches/token_dump/ runs it)."""
    overrides, once = SETTINGS[name]
    scored = []
    if dump:
        monkeypatch.setenv(settings.DIR_ENV, "unused")
        monkeypatch.setattr(hook, "score_mini_batch", lambda worker, view: scored.append(view.selection.dump))
    counts, metrics = step(actor_config(*overrides), evaluations)
    assert counts == [once] * MINI_BATCHES
    if dump:
        assert len(scored) == 1 and scored[0] is not None and scored[0].tau_h is not None  # the first mini-batch's
    if "current" in name:  # the drift diagnostic comes from the selection at hand
        prefix = "entropy_topk/" if "entropy20" in name else "s2t/"
        assert "rollout_agreement" not in "".join(metrics[0])
        assert all(0.0 <= m[prefix + "rollout_agreement"] <= 1.0 for m in metrics[1:])


def test_the_dump_alone_asks_for_s2t_on_its_mini_batch(evaluations, monkeypatch):
    """Without the monitor, S2T runs for the token dump on a step's first mini-batch only."""
    monkeypatch.setenv(settings.DIR_ENV, "unused")
    monkeypatch.setattr(hook, "score_mini_batch", lambda worker, view: None)
    counts, metrics = step(actor_config("method=justrl", f"{PL}.s2t_monitor=false"), evaluations)
    assert counts == [{"s2t": 1}, {}, {}]
    assert not any(metrics)  # the dump's S2T logs nothing


@pytest.mark.parametrize("stats_from", ["rollout", "current"])
def test_inside_the_loss_once_per_micro_batch(stats_from, evaluations):
    """``scope=micro_batch``: once per micro-batch, ``rollout_agreement`` included."""
    config = actor_config("method=stapo", f"{PL}.scope=micro_batch", f"{PL}.stats_from={stats_from}",
                          "actor_rollout_ref.actor.calculate_entropy=true")
    mask, old, adv, entropy, (log_prob, current_entropy) = batch()
    for rows in (slice(0, 3), slice(3, B)):
        data = micro_batch(mask[rows], old[rows], adv[rows], entropy=entropy[rows],
                           batch_num_tokens=int(mask.sum()), global_batch_size=B)
        output = {"log_probs": flat_model_output(log_prob[rows], mask[rows]),
                  "entropy": flat_model_output(current_entropy[rows], mask[rows])}
        _, metrics = ppo_loss_with_token_selection(config=config, model_output=output, data=data)
        assert ("s2t/rollout_agreement" in metrics) == (stats_from == "current")
    assert dict(evaluations) == {"s2t": 2}


def test_rollout_agreement_holds_the_selections_threshold():
    """``s2t/rollout_agreement`` of a later mini-batch: the tokens silenced on the current statistics
    (A) against the candidates of the rollout statistics whose rollout entropy is below the current
    selection's ``tau_h`` (B), |A & B| / |A | B|, from S2T's definition."""
    from stapo_core import s2t_mask

    config = actor_config("method=stapo", f"{PL}.stats_from=current", f"{PL}.current_forward=full")
    mask, old, adv, entropy, current = batch()
    _, metrics = step(config, Counter())
    now = s2t_mask(*current, adv, mask)
    candidate = (mask != 0) & (adv > 0) & (old.exp() < config.policy_loss.tau_p)
    a, b = mask * (1 - now.keep), (candidate & (entropy < now.stats["tau_h"])).float()
    expected = float((a * b).sum() / torch.maximum(a, b).sum())
    assert 0.0 < expected < 1.0  # the drift moved some tokens across the threshold, not all
    assert [m["s2t/rollout_agreement"] for m in metrics[1:]] == pytest.approx([expected] * 2)
