"""S2T as a monitor (``s2t_monitor=true``): a run that does not apply S2T logs exactly the selection
STAPO would make on the same mini-batch, and its update is untouched, whatever the method, the
verl loss mode or the aggregation.

References: the same mini-batch through the same wrapper with ``method=stapo`` (what STAPO computes
and applies), :func:`stapo_core.s2t_mask` called directly, and the mask / counts of a run with the
monitor off.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from recipe.stapo.driver import compose
from stapo_core import s2t_mask
from tests.helpers.verl_batch import actor_config, candidate_batch, flat_model_output, micro_batch
from verl.utils import tensordict_utils as tu
from verl.workers import engine_workers
from verl_patches.policy_loss_config import TokenSelectionLossConfig
from verl_patches.mini_batch import wrap_train_batch
from verl_patches.trainers import needs_rollout_entropy

B, R = 6, 12
PL = "actor_rollout_ref.actor.policy_loss"


def batch(seed: int = 0):
    return candidate_batch(R, seed)


class Worker:
    """The parts of verl's ``TrainingWorker`` the wrapper uses: the bound loss function (actor
    config), the engine, ``infer_batch`` (the current policy's statistics) and, under the recipe's
    wrapper, a ``train_batch`` that records what verl's update would receive."""

    def __init__(self, config, current=None):
        self.loss_fn = partial(engine_workers.ppo_loss, config=config)
        self.engine = SimpleNamespace(get_data_parallel_group=lambda: None, module=torch.nn.Linear(1, 1))
        self.engine_config = SimpleNamespace(infer_micro_batch_size_per_gpu=B, use_dynamic_bsz=False,
                                             infer_max_token_len_per_gpu=None)
        self.current, self.forwards, self.seen = current, 0, []
        self.train_batch = wrap_train_batch(Worker._record)

    def infer_batch(self, data):
        self.forwards += 1
        lp, ent = self.current
        valid = data["attention_mask"][:, -R:]
        return {"log_probs": flat_model_output(lp, valid), "entropy": flat_model_output(ent, valid)}

    def _record(self, data):
        self.seen.append({"response_mask": data["response_mask"].clone(), "loss_mask": data["loss_mask"].clone(),
                          "global_batch_size": tu.get(data, "global_batch_size"),
                          "batch_num_tokens": tu.get(data, "batch_num_tokens")})
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {}})


def run(config, mini_batches, current=None):
    """The wrapper over ``mini_batches`` (the last flagged as verl does); returns the worker and each
    mini-batch's metrics."""
    worker = Worker(config, current)
    metrics = []
    for i, data in enumerate(mini_batches):
        tu.assign_non_tensor(data, update_lr_scheduler=i == len(mini_batches) - 1)
        out = worker.train_batch(worker, data)
        metrics.append({k: v for k, v in tu.get(out, "metrics").items()})
    return worker, metrics


def same_updates(a: Worker, b: Worker) -> bool:
    """Both workers' updates received the same masks (bit for bit) and counts."""
    return len(a.seen) == len(b.seen) and all(
        all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
        for x, y in zip(a.seen, b.seen))


def s2t_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("s2t/") and k != "s2t/applied"}


@pytest.mark.parametrize("method", ["justrl", "grpo", "entropy20"])
def test_monitor_logs_what_stapo_applies(method):
    """On the same mini-batch, a baseline's monitor logs STAPO's S2T metrics (stats_from=rollout),
    with ``s2t/applied`` 0 against 1; the baseline's update receives its own mask, not S2T's."""
    mask, old, adv, entropy, _ = batch(seed=1)
    stapo, stapo_metrics = run(actor_config("method=stapo", f"{PL}.stats_from=rollout"),
                               [micro_batch(mask, old, adv, entropy=entropy)])
    base, base_metrics = run(actor_config(f"method={method}"), [micro_batch(mask, old, adv, entropy=entropy)])
    off, _ = run(actor_config(f"method={method}", f"{PL}.s2t_monitor=false"),
                 [micro_batch(mask, old, adv, entropy=entropy)])
    want = s2t_mask(old, entropy, adv, mask)
    assert want.stats["silenced"] > 0
    assert s2t_metrics(base_metrics[0]) == s2t_metrics(stapo_metrics[0])
    assert base_metrics[0]["s2t/silenced"] == want.stats["silenced"]
    assert (base_metrics[0]["s2t/applied"], stapo_metrics[0]["s2t/applied"]) == (0.0, 1.0)
    torch.testing.assert_close(stapo.seen[0]["response_mask"].float(), mask * want.keep, rtol=0, atol=0)
    assert same_updates(base, off)  # the monitor changes nothing the update receives
    if method != "entropy20":
        torch.testing.assert_close(base.seen[0]["response_mask"], mask, rtol=0, atol=0)


@pytest.mark.parametrize("loss_mode, agg", [("vanilla", "seq-mean-token-mean"), ("gspo", "seq-mean-token-mean"),
                                            ("cispo", "token-mean"), ("clip_cov", "token-mean"),
                                            ("geo_mean", "seq-mean-token-sum")])
def test_monitor_under_any_loss_mode_leaves_the_update_alone(loss_mode, agg):
    """Any verl loss mode and aggregation: the masks and verl's token and sequence counts the update
    receives are those of the run without the monitor, and the monitor's metrics are S2T's."""
    mask, old, adv, entropy, _ = batch(seed=2)
    overrides = ("method=justrl", f"{PL}.loss_mode={loss_mode}", f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    on, metrics = run(actor_config(*overrides), [micro_batch(mask, old, adv, entropy=entropy)])
    off, off_metrics = run(actor_config(*overrides, f"{PL}.s2t_monitor=false"),
                           [micro_batch(mask, old, adv, entropy=entropy)])
    assert same_updates(on, off) and not s2t_metrics(off_metrics[0]) and "s2t/applied" not in off_metrics[0]
    assert metrics[0]["s2t/candidates"] == s2t_mask(old, entropy, adv, mask).stats["candidates"] > 0


def test_monitor_with_current_statistics_forwards_later_mini_batches():
    """``stats_from=current``: the first mini-batch uses the rollout statistics (no forward), each
    later one one forward of the current policy, as STAPO's Algorithm 1."""
    mask, old, adv, entropy, current = batch(seed=3)
    config = actor_config("method=justrl", f"{PL}.stats_from=current")
    worker, metrics = run(config, [micro_batch(mask, old, adv, entropy=entropy) for _ in range(3)], current=current)
    assert worker.forwards == 2
    rollout, moved = s2t_mask(old, entropy, adv, mask), s2t_mask(*current, adv, mask)
    assert rollout.stats["tau_h"] != moved.stats["tau_h"]
    assert metrics[0]["s2t/tau_h"] == pytest.approx(rollout.stats["tau_h"])
    assert [m["s2t/tau_h"] for m in metrics[1:]] == pytest.approx([moved.stats["tau_h"]] * 2)
    assert all(0.0 <= m["s2t/rollout_agreement"] <= 1.0 for m in metrics[1:])
    assert all(torch.equal(seen["response_mask"], mask) for seen in worker.seen)


def test_settings_say_whether_s2t_is_applied():
    monitor = TokenSelectionLossConfig(s2t_monitor=True)
    assert monitor.monitors_s2t and not monitor.applies_s2t
    stapo = TokenSelectionLossConfig(token_selection="s2t", stats_from="current", s2t_monitor=True)
    assert stapo.applies_s2t and not stapo.monitors_s2t  # nothing to monitor: S2T is applied
    plain = TokenSelectionLossConfig()
    assert not plain.monitors_s2t
    current = TokenSelectionLossConfig(s2t_monitor=True, stats_from="current")
    assert current.monitor_forwards_current_policy and not current.forwards_current_policy
    with pytest.raises(ValueError, match=f"{PL}.s2t_monitor='yes' is invalid: expected true or false"):
        TokenSelectionLossConfig(s2t_monitor="yes")
    # the legacy trainer keeps the rollout entropy for the actor of every monitored baseline, and for no
    # baseline without the monitor
    for method in ("justrl", "grpo"):
        assert needs_rollout_entropy(compose([f"method={method}"]))
        assert not needs_rollout_entropy(compose([f"method={method}", f"{PL}.s2t_monitor=false"]))


def test_missing_rollout_entropy_names_the_fix():
    mask, old, adv, _, _ = batch(seed=4)
    with pytest.raises(KeyError, match="S2T monitor .* needs the fields \\['entropy'\\]"):
        run(actor_config("method=justrl"), [micro_batch(mask, old, adv)])
