"""STAPOTrainer on TRL's real GRPOTrainer, on CPU, with a tiny model built in the test.

Recorded batches: one optimizer step driven through the trainer's own ``_prepare_inputs`` (TRL's
generation, scoring and buffering) and ``compute_loss``, the model unchanged meanwhile, so the
mask and the loss can be recomputed from ``stapo_core``. Trainer runs (``train()``) are slow.
"""

from __future__ import annotations

import math

import pytest
import torch

from stapo_core import s2t_mask
from tests.helpers.reference_loss import clipped_policy_loss
from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.trainer import S2T_METRICS, loss_mask
from tests.helpers.trl_tiny import digit_reward, prompts_dataset, tiny_model, tiny_tokenizer, trainer_settings

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_trainer(tmp_path, trainer_cls=STAPOTrainer, config_cls=STAPOConfig, seed=0, **overrides):
    from trl import GRPOTrainer  # noqa: F401  (TRL is the trl extra)

    tokenizer = tiny_tokenizer()
    args = config_cls(**trainer_settings(tmp_path / "out", **overrides))
    return trainer_cls(model=tiny_model(tokenizer, seed=seed), reward_funcs=digit_reward, args=args,
                       train_dataset=prompts_dataset(), processing_class=tokenizer)


def record_step(trainer, backward=False, edit=None):
    """One optimizer step's micro-batches through TRL's ``_prepare_inputs`` and the trainer's
    ``compute_loss`` (no optimizer step): ``(inputs, losses)``. ``edit(buffered)`` may change the
    buffered micro-batches before the first loss."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    batch = next(iter(trainer.get_train_dataloader()))
    inputs, losses = [], []
    for k in range(trainer.args.gradient_accumulation_steps):
        micro = trainer._prepare_inputs(batch)
        if k == 0 and edit is not None:
            edit(trainer._buffered_inputs)
            micro = trainer._buffered_inputs[0]
        loss = trainer.compute_loss(trainer.model, micro)
        if backward:
            loss.backward()
        inputs.append(micro)
        losses.append(loss)
        trainer._step += 1
    return inputs, losses


def reference(trainer, inputs, grad=False):
    """``(log_prob, entropy)`` per micro-batch from TRL's fused forward of the unchanged model."""
    out = []
    for micro in inputs:
        with torch.set_grad_enabled(grad):
            lp, ent, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([micro["prompt_ids"], micro["completion_ids"]], 1),
                torch.cat([micro["prompt_mask"], micro["completion_mask"]], 1), micro["completion_ids"].size(1),
                compute_entropy=True)
        out.append((lp, ent))
    return out


def test_mask_and_loss_equal_stapo_core_on_recorded_batches(tmp_path):
    """The keep mask is stapo_core's s2t_mask over the step's joined micro-batches; the step's loss
    (TRL's default dapo aggregation) and its gradient are stapo_core's clipped loss averaged over
    the kept tokens."""
    trainer = make_trainer(tmp_path, tau_p=0.05)
    assert trainer.args.loss_type == "dapo"
    inputs, losses = record_step(trainer, backward=True)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()

    stats_ref = reference(trainer, inputs)
    joined = lambda seq: torch.cat(list(seq))  # noqa: E731
    expected = s2t_mask(joined(lp for lp, _ in stats_ref), joined(ent for _, ent in stats_ref),
                        joined(m["advantages"] for m in inputs), joined(loss_mask(m) for m in inputs),
                        tau_p=0.05, q=0.75)
    keeps = [trainer._s2t_keeps[k][0] for k in range(len(inputs))]
    assert torch.equal(joined(keeps), expected.keep)
    assert expected.stats["candidates"] >= 2 and expected.stats["silenced"] >= 1  # S2T acted
    assert trainer._metrics["train"]["s2t/silenced"] == [expected.stats["silenced"]]
    assert trainer._metrics["train"]["s2t/tau_h"] == [pytest.approx(expected.stats["tau_h"], abs=0)]

    lp = joined(lp for lp, _ in reference(trainer, inputs, grad=True))
    ref_loss, _ = clipped_policy_loss(lp, lp.detach(), joined(m["advantages"] for m in inputs), expected.keep,
                                      clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high,
                                      agg="token-mean")
    assert torch.stack(losses).sum().item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    ref_loss.backward()
    for name, p in trainer.model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_grpo_aggregation_averages_each_completion_over_its_kept_tokens(tmp_path):
    trainer = make_trainer(tmp_path, tau_p=0.05, loss_type="grpo")
    inputs, losses = record_step(trainer)
    keep = torch.cat([trainer._s2t_keeps[k][0] for k in range(len(inputs))])
    assert bool((keep.sum(-1) > 0).all()), "every completion keeps a token (the two means agree only then)"
    assert int((keep == 0).logical_and(torch.cat([loss_mask(m) for m in inputs]) != 0).sum()) >= 1
    lp = torch.cat([lp for lp, _ in reference(trainer, inputs)])
    ref_loss, _ = clipped_policy_loss(lp, lp, torch.cat([m["advantages"] for m in inputs]), keep,
                                      clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high,
                                      agg="seq-mean-token-mean")
    assert torch.stack(losses).sum().item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_zero_candidates_and_all_silenced_give_finite_losses(tmp_path, loss_type):
    # no candidate: tau_p far below any sampled probability
    trainer = make_trainer(tmp_path / "none", tau_p=1e-12, loss_type=loss_type)
    _, losses = record_step(trainer, backward=True)
    assert all(math.isfinite(loss.item()) for loss in losses)
    assert trainer._metrics["train"]["s2t/candidates"] == [0] and "s2t/tau_h" not in trainer._metrics["train"]
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)

    # every token silenced: every advantage positive, every token a candidate, strategy full
    def all_positive(buffered):
        for micro in buffered:
            micro["advantages"] = micro["advantages"].abs() + 0.5

    trainer = make_trainer(tmp_path / "all", tau_p=0.999999, strategy="full", loss_type=loss_type)
    _, losses = record_step(trainer, backward=True, edit=all_positive)
    metrics = trainer._metrics["train"]
    assert metrics["s2t/silenced"] == metrics["s2t/tokens"] and metrics["s2t/tokens"][0] > 0
    assert all(loss.item() == 0.0 for loss in losses)
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


def test_trainer_refuses_a_grpo_config(tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="args must be a STAPOConfig, got GRPOConfig"):
        make_trainer(tmp_path, config_cls=GRPOConfig)


# ------------------------------------------------------------------------------------------------
# trainer runs
# ------------------------------------------------------------------------------------------------


def train(tmp_path, trainer_cls=STAPOTrainer, config_cls=STAPOConfig, **overrides):
    trainer = make_trainer(tmp_path, trainer_cls, config_cls, **overrides)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    from trl import GRPOConfig, GRPOTrainer

    return train(tmp_path_factory.mktemp("grpo"), GRPOTrainer, GRPOConfig, max_steps=3)


@pytest.mark.slow
def test_a_few_steps_of_grpo_and_stapo(tmp_path, grpo_run):
    grpo, grpo_logs = grpo_run
    stapo, stapo_logs = train(tmp_path, tau_p=0.05, max_steps=3)
    assert len(grpo_logs) == len(stapo_logs) == 3
    for logs in (grpo_logs, stapo_logs):
        assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    assert not any(k.startswith("s2t/") for h in grpo_logs for k in h)
    assert all(f"s2t/{name}" in h for h in stapo_logs for name in ("tokens", "candidates", "silenced"))
    assert sum(h["s2t/silenced"] for h in stapo_logs) >= 1
    assert set(k[4:] for h in stapo_logs for k in h if k.startswith("s2t/")) <= set(S2T_METRICS)
    initial = tiny_model(tiny_tokenizer(), seed=0).state_dict()
    assert any(not torch.equal(p, initial[n]) for n, p in stapo.model.state_dict().items())
    # the same data and seeds: S2T (which silenced tokens) makes the update differ from GRPO's
    assert any(not torch.equal(p, grpo.model.state_dict()[n]) for n, p in stapo.model.state_dict().items())


@pytest.mark.slow
def test_tau_p_zero_equals_trl_grpo_bit_for_bit(tmp_path, grpo_run):
    grpo, grpo_logs = grpo_run
    stapo, stapo_logs = train(tmp_path, tau_p=0.0, max_steps=3)
    assert [h["loss"] for h in stapo_logs] == [h["loss"] for h in grpo_logs]
    assert [h["grad_norm"] for h in stapo_logs] == [h["grad_norm"] for h in grpo_logs]
    for name, p in grpo.model.state_dict().items():
        assert torch.equal(stapo.model.state_dict()[name], p), name
    assert all(h["s2t/candidates"] == 0 and h["s2t/tokens"] > 0 for h in stapo_logs)


class RecordingTrainer(STAPOTrainer):
    """Records the completions and log-probabilities behind each step's S2T statistics."""

    def _s2t_statistics(self, model, inputs):
        log_probs, entropies = super()._s2t_statistics(model, inputs)
        self.recorded = getattr(self, "recorded", []) + [(self.state.global_step, inputs["completion_ids"].clone(),
                                                          log_probs.clone())]
        return log_probs, entropies


@pytest.mark.slow
def test_several_updates_per_generation_take_statistics_from_the_current_policy(tmp_path):
    """num_iterations=2: the second optimizer step reuses the generation; its statistics are
    recomputed under the policy the first step updated (Algorithm 1), not reused."""
    trainer, logs = train(tmp_path, RecordingTrainer, tau_p=0.05, num_iterations=2, max_steps=2)
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    steps = {}
    for step, ids, lp in trainer.recorded:
        steps.setdefault(step, []).append((ids, lp))
    assert sorted(steps) == [0, 1]
    for (ids0, lp0), (ids1, lp1) in zip(steps[0], steps[1]):
        assert torch.equal(ids0, ids1)  # the same completions
        assert not torch.equal(lp0, lp1)  # under the updated policy
