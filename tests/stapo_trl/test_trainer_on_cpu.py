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
from stapo_trl.config import LOSS_TYPES
from stapo_trl.selection import random_strategy_seed
from stapo_trl.trainer import S2T_METRICS, loss_mask
from tests.helpers.trl_tiny import digit_reward, prompts_dataset, tiny_model, tiny_tokenizer, trainer_settings

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_trainer(tmp_path, trainer_cls=STAPOTrainer, config_cls=STAPOConfig, model_seed=0, **overrides):
    from trl import GRPOTrainer  # noqa: F401  (TRL is the trl extra)

    tokenizer = tiny_tokenizer()
    args = config_cls(**trainer_settings(tmp_path / "out", **overrides))
    return trainer_cls(model=tiny_model(tokenizer, seed=model_seed), reward_funcs=digit_reward, args=args,
                       train_dataset=prompts_dataset(), processing_class=tokenizer)


def record_step(trainer, backward=False, edit=None, steps=1):
    """``steps`` optimizer steps' micro-batches through TRL's ``_prepare_inputs`` and the trainer's
    ``compute_loss`` (no optimizer step, so the model stays unchanged): ``(inputs, losses)``.
    ``edit(buffered)`` may change the buffered micro-batches before the first loss."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    batch = next(iter(trainer.get_train_dataloader()))
    inputs, losses = [], []
    for _ in range(steps):
        for _ in range(trainer.args.gradient_accumulation_steps):
            micro = trainer._prepare_inputs(batch)
            if trainer._step == 0 and edit is not None:
                edit(trainer._buffered_inputs)
                micro = trainer._buffered_inputs[0]
            loss = trainer.compute_loss(trainer.model, micro)
            if backward:
                loss.backward()
            inputs.append(micro)
            losses.append(loss)
            trainer._step += 1
        trainer.state.global_step += 1
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


class KeepRecorder(STAPOTrainer):
    """Records every keep mask the trainer makes, in micro-batch order."""

    def _s2t_select(self, model, batches, mode):
        result = super()._s2t_select(model, batches, mode)
        self._recorded_keeps = getattr(self, "_recorded_keeps", []) + [keep for keep, _, _ in result]
        return result


def token_losses(trainer, loss_type, lp, old, adv, keep):
    """TRL's per-token loss of ``loss_type`` written from its formulas (``delta`` and ``beta`` off):
    ``(batch, completion_len)`` (``(batch, 1)`` with sequence-level ratios), from the current and old
    log-probs, the advantages ``(batch, 1)`` and the keep mask (the sequence ratio's and vespo's
    sequence weight's tokens)."""
    args = trainer.args
    log_ratio = lp - old
    if args.importance_sampling_level == "sequence":  # the mean log-ratio over the kept tokens
        log_ratio = ((log_ratio * keep).sum(-1) / keep.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        return -torch.clamp(ratio, max=trainer.epsilon_high) * adv * lp
    if loss_type == "sapo":
        tau = torch.where(adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    if loss_type == "vespo":
        log_w = (torch.clamp(lp - old, -20.0, 20.0) * keep).sum(-1, keepdim=True)
        w = torch.exp(log_w)
        k = torch.where(adv >= 0, args.vespo_k_pos, args.vespo_k_neg)
        lam = torch.where(adv >= 0, args.vespo_lambda_pos, args.vespo_lambda_neg)
        return -torch.exp(lam + k * log_w - lam * w) * adv * lp
    clipped = torch.clamp(ratio, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def expected_micro_loss(trainer, loss_type, loss_mat, keep, entropy, generation_tokens, step_tokens, step_kept):
    """One micro-batch's loss over the kept tokens in TRL's convention (docs/trl.md), one process."""
    ga, spg = trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation
    kept_sum = (loss_mat * keep).sum()
    if loss_type in ("dapo", "cispo", "vespo"):  # the kept tokens of the step, as TRL averages over steps
        loss = kept_sum / (step_kept * (generation_tokens * ga / spg) / step_tokens)
    elif loss_type == "bnpo":
        loss = kept_sum / keep.sum().clamp(min=1) / ga
    elif loss_type in ("grpo", "sapo"):
        loss = ((loss_mat * keep).sum(-1) / keep.sum(-1).clamp(min=1)).mean() / ga
    elif loss_type == "dr_grpo":
        loss = kept_sum / (keep.shape[0] * trainer.args.max_completion_length) / ga
    else:
        assert loss_type == "luspo"
        loss = (loss_mat * keep).sum(-1).mean() / ga
    bonus = (entropy * keep).sum() / keep.sum().clamp(min=1) / ga  # the entropy bonus: mean over the kept tokens
    return loss - trainer.args.entropy_coef * bonus


LOSS_CASES = [pytest.param(loss, {}, id=loss) for loss in LOSS_TYPES] + [
    pytest.param("grpo", {"importance_sampling_level": "sequence"}, id="grpo-sequence-ratio"),
    pytest.param("luspo", {"importance_sampling_level": "sequence"}, id="luspo-sequence-ratio"),
    pytest.param("dapo", {"entropy_coef": 0.01}, id="dapo-entropy-bonus"),
]


@pytest.mark.parametrize("loss_type, overrides", LOSS_CASES)
def test_each_loss_type_averages_over_the_kept_tokens_in_trls_convention(tmp_path, loss_type, overrides):
    """Two optimizer steps from one generation (steps_per_generation=4, gradient_accumulation_steps=2),
    S2T silencing in each, ratios moved off 1: every micro-batch's loss is TRL's per-token loss
    aggregated over the kept tokens as docs/trl.md states for its loss type, the sequence-level ratio,
    vespo's sequence weight, the entropy bonus and the logged entropy over the kept tokens."""
    trainer = make_trainer(tmp_path, KeepRecorder, tau_p=0.2, loss_type=loss_type, epsilon_high=0.28,
                           steps_per_generation=4, **overrides)
    offsets = torch.tensor([-0.4, -0.1, 0.0, 0.15, 0.4])  # log r per position

    def vary_ratios(buffered):
        for micro in buffered:
            lp, _ = reference(trainer, [micro])[0]
            micro["old_per_token_logps"] = lp - offsets[torch.arange(lp.shape[1]) % len(offsets)]

    inputs, losses = record_step(trainer, steps=2, edit=vary_ratios)
    assert all(torch.equal(m["num_items_in_batch"], inputs[0]["num_items_in_batch"]) for m in inputs)
    generation_tokens = sum(int(loss_mask(m).sum()) for m in inputs)
    assert int(inputs[0]["num_items_in_batch"]) == generation_tokens
    per_step = generation_tokens * 2 / 4  # TRL's divisor: the generation's mean tokens per optimizer step
    silenced = trainer._metrics["train"]["s2t/silenced"]
    assert len(silenced) == 2 and all(n >= 1 for n in silenced), "S2T silences tokens in both steps"
    step_tokens = [sum(int(loss_mask(m).sum()) for m in inputs[2 * s: 2 * s + 2]) for s in range(2)]
    assert step_tokens != [per_step, per_step], "the steps differ in size, so the convention matters"
    stats = reference(trainer, inputs)
    over_all_tokens = []  # the loss a sequence weight over every token would give
    for k, (micro, loss) in enumerate(zip(inputs, losses)):
        step = k // 2
        keep = loss_mask(micro).float() * trainer._recorded_keeps[k]
        lp, entropy = stats[k]
        old, adv = micro["old_per_token_logps"], micro["advantages"][:, None]
        loss_mat = token_losses(trainer, loss_type, lp, old, adv, keep)
        expected = expected_micro_loss(trainer, loss_type, loss_mat, keep, entropy, generation_tokens,
                                       step_tokens[step], step_tokens[step] - silenced[step])
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7), (k, loss_type)
        everywhere = token_losses(trainer, loss_type, lp, old, adv, loss_mask(micro).float())
        over_all_tokens.append((loss.item(), expected_micro_loss(
            trainer, loss_type, everywhere, keep, entropy, generation_tokens, step_tokens[step],
            step_tokens[step] - silenced[step]).item()))
        kept_entropy = (entropy * keep).sum() / keep.sum()
        assert trainer._metrics["train"]["entropy"][k] == pytest.approx(kept_entropy.item(), rel=1e-5)
    if overrides.get("importance_sampling_level") == "sequence" or loss_type == "vespo":
        assert any(a != pytest.approx(b, rel=1e-4) for a, b in over_all_tokens)


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
    """Records, per statistics forward: the optimizer step, the completions, the rows forwarded and
    the log-probabilities returned."""

    def _s2t_statistics(self, model, batches, rows, mode):
        log_probs, entropies = super()._s2t_statistics(model, batches, rows, mode)
        self.recorded = getattr(self, "recorded", []) + [
            (self.state.global_step, b["completion_ids"].clone(), r.clone(), lp.clone(), b["advantages"].clone(),
             loss_mask(b).clone()) for b, r, lp in zip(batches, rows, log_probs)]
        return log_probs, entropies


@pytest.mark.slow
def test_several_updates_per_generation_take_statistics_from_the_current_policy(tmp_path):
    """num_iterations=2: the second optimizer step reuses the generation; its statistics are
    recomputed under the policy the first step updated (Algorithm 1), not reused."""
    trainer, logs = train(tmp_path, RecordingTrainer, tau_p=0.05, num_iterations=2, max_steps=2)
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    steps = {}
    for step, ids, rows, lp, _, _ in trainer.recorded:
        steps.setdefault(step, []).append((ids, rows, lp))
    assert sorted(steps) == [0, 1]
    for (ids0, rows0, lp0), (ids1, rows1, lp1) in zip(steps[0], steps[1]):
        assert torch.equal(ids0, ids1) and torch.equal(rows0, rows1)  # the same completions
        assert rows0.any() and not torch.equal(lp0[rows0], lp1[rows1])  # under the updated policy


def comparable(logs) -> list[dict]:
    """Logged records without timings and the statistics forward's own share and time."""
    return [{k: v for k, v in h.items() if "time" not in k and "per_second" not in k and "current_forward" not in k}
            for h in logs]


@pytest.mark.slow
def test_positive_advantage_forward_selects_as_the_full_forward(tmp_path):
    """current_forward=positive_advantage forwards only the completions with A > 0 (no other can
    hold a candidate) and gives the full forward's masks, tau_h, losses and weights exactly."""
    settings = dict(tau_p=0.2, steps_per_generation=4, max_steps=4, num_iterations=2)
    full, full_logs = train(tmp_path / "full", RecordingTrainer, current_forward="full", **settings)
    part, part_logs = train(tmp_path / "positive", RecordingTrainer, **settings)
    assert part.args.current_forward == "positive_advantage"
    assert len(full.recorded) == len(part.recorded) == 8  # 4 optimizer steps x 2 micro-batches
    for (_, ids, rows_full, _, adv, mask), (_, ids_p, rows, _, _, _) in zip(full.recorded, part.recorded):
        assert torch.equal(ids, ids_p) and bool(rows_full.all())
        assert torch.equal(rows, ((adv[:, None] > 0) & (mask != 0)).any(-1))
    assert any(not bool(rows.all()) for _, _, rows, *_ in part.recorded)  # some completions were left out
    assert sum(h["s2t/silenced"] for h in part_logs) >= 4
    assert comparable(full_logs) == comparable(part_logs)  # the same tau_h, silenced counts, losses
    for name, p in full.model.state_dict().items():
        assert torch.equal(part.model.state_dict()[name], p), name
    assert all(h["s2t/current_forward_tokens_frac"] == 1.0 for h in full_logs)
    assert all(0 < h["s2t/current_forward_tokens_frac"] < 1 for h in part_logs)


@pytest.mark.parametrize("delta", [10.0, None])
def test_trls_delta_is_verls_dual_clip(tmp_path, delta):
    """TRL's two-sided clip delta=10 (coef_1 clamped at delta before the PPO min) gives the loss and
    gradient of verl's dual clip clip_ratio_c=10 (the reference surrogate, which tests/verl_patches
    check against verl's vanilla loss), ratios from e^-25 to e^25 under both signs of the advantage
    (verl clamps the log-ratio to [-20, 20], TRL does not: below 2.1e-9 x |A| per token); without
    delta, TRL's loss is the surrogate without dual clip."""
    from trl import GRPOConfig, GRPOTrainer

    trainer = make_trainer(tmp_path, GRPOTrainer, GRPOConfig, delta=delta, epsilon=0.2, epsilon_high=0.28)
    offsets = torch.tensor([-25.0, -3.0, -0.5, -0.1, 0.0, 0.1, 0.5, 3.0, 25.0])  # log r, beyond verl's +-20 clamp
    if delta is None:  # without a dual clip an unclamped e^25 is TRL's loss: compare inside verl's clamp
        offsets = offsets[1:-1]

    def set_ratios(buffered):
        for micro in buffered:
            lp, _ = reference(trainer, [micro])[0]
            rows, cols = torch.arange(lp.shape[0])[:, None], torch.arange(lp.shape[1])[None, :]
            micro["old_per_token_logps"] = lp - offsets[(rows + cols) % len(offsets)]
            micro["advantages"] = torch.tensor([1.0, -1.0]).repeat(lp.shape[0] // 2)

    inputs, losses = record_step(trainer, backward=True, edit=set_ratios)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    lp = torch.cat([lp for lp, _ in reference(trainer, inputs, grad=True)])
    old = torch.cat([m["old_per_token_logps"] for m in inputs])
    adv = torch.cat([m["advantages"] for m in inputs])
    mask = torch.cat([loss_mask(m) for m in inputs]).float()
    ratio = torch.exp(lp.detach() - old)
    assert bool(((ratio > 10) & (adv[:, None] < 0) & (mask > 0)).any())  # the dual clip has tokens to act on
    assert delta is None or bool((((lp.detach() - old).abs() > 20) & (mask > 0)).any())  # beyond verl's clamp
    ref, _ = clipped_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=delta)
    other, _ = clipped_policy_loss(lp.detach(), old, adv, mask, clip_low=0.2, clip_high=0.28,
                                   clip_c=None if delta else 10.0)
    total = torch.stack(losses).sum()
    assert total.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert total.item() != pytest.approx(other.item(), rel=1e-3)
    ref.backward()
    for name, p in trainer.model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_random_strategy_draws_from_this_process_generator(tmp_path):
    """strategy="random": the process's own generator, seeded seed x 1,000,003 + process index (the
    verl recipe's per-rank seed): the same seed draws the same silenced set; process 1's generator
    (the same batch) another."""
    keeps = []
    for run, process in enumerate((0, 0, 1)):
        trainer = make_trainer(tmp_path / str(run), seed=2, tau_p=0.2, strategy="random", q=0.5)
        assert trainer._s2t_generator.initial_seed() == 2 * 1_000_003 == random_strategy_seed(2, 0)
        trainer._s2t_generator.manual_seed(random_strategy_seed(2, process))  # as process `process` seeds it
        record_step(trainer)
        keeps.append(torch.cat([trainer._s2t_keeps[k][0] for k in range(2)]))
        assert trainer._metrics["train"]["s2t/silenced"][0] > 0
    assert torch.equal(keeps[0], keeps[1]) and not torch.equal(keeps[0], keeps[2])


def test_rows_the_statistics_forward_covers(tmp_path):
    """The positive-advantage completions; all of them for a multimodal batch (its image tensors
    are not indexed by completion) or with current_forward="full"; none with tau_p=0."""
    batch = {"completion_mask": torch.tensor([[1, 1], [1, 0], [1, 1]]), "advantages": torch.tensor([0.5, -0.5, 0.0])}
    trainer = make_trainer(tmp_path / "a", tau_p=0.2)
    assert trainer._s2t_rows(batch).tolist() == [True, False, False]
    assert trainer._s2t_rows(dict(batch, token_type_ids=torch.zeros(3, 4))).tolist() == [True, True, True]
    assert make_trainer(tmp_path / "b", tau_p=0.2, current_forward="full")._s2t_rows(batch).tolist() == [True] * 3
    assert make_trainer(tmp_path / "c", tau_p=0.0)._s2t_rows(batch).tolist() == [False] * 3
