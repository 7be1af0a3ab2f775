"""Token selection through verl's own ``ppo_loss`` call path, against stapo_core.

Each test builds an ``FSDPActorConfig`` from the recipe's composed config (so the YAML, the
``TokenSelectionLossConfig`` and verl's dataclass conversion are all exercised) and a micro-batch
TensorDict in the layout verl's actor hands the loss.
"""

from __future__ import annotations

import re

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from recipe.stapo.driver import compose
from stapo_core import s2t_mask, entropy_topk_mask
from tests.helpers.reference_loss import clipped_policy_loss
from tests.helpers.verl_batch import flat_model_output, micro_batch, right_padded_mask
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils import losses as verl_losses
from verl_patches.losses import ppo_loss_with_token_selection
from verl_patches.token_selection import fold_into_mini_batch

B, R = 6, 12
#: the recipe's dual clip for JustRL / STAPO / 20-Entropy (JustRL's script)
CLIP_C = 10.0
ROLLOUT = "actor_rollout_ref.actor.policy_loss.stats_from=rollout"
MICRO = "actor_rollout_ref.actor.policy_loss.scope=micro_batch"


def actor_config(method: str, *overrides: str):
    cfg = compose([f"method={method}", "model=qwen3_1_7b", *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def random_batch(seed: int = 0, n_rare: int = 12):
    """Log-probs with ``n_rare`` rare tokens (p < 0.002) inside positive-advantage responses,
    plus a few rare tokens elsewhere (negative advantage, padding), and varied entropies."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, R + 1, (B,), generator=g)
    mask = right_padded_mask(lengths, R)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, -0.5])[:, None].expand(B, R).clone()
    old = -torch.rand(B, R, generator=g) * 2.0
    positive = ((mask == 1) & (adv > 0)).flatten().nonzero().flatten()
    rare = positive[torch.randperm(len(positive), generator=g)[:n_rare]]
    old.view(-1)[rare] = -7.0 - torch.rand(len(rare), generator=g)  # p ~ 3e-4 .. 9e-4
    old[1, :3] = -8.0  # rare but negative advantage: never a candidate
    log_prob = old + 0.05 * torch.randn(B, R, generator=g)
    entropy = torch.rand(B, R, generator=g) * 3.0
    return mask, old, log_prob, entropy, adv


def run_ppo_loss(config, mask, old, log_prob, adv, *, valid=None, entropy=None, current_entropy=None, **batch_kw):
    """verl's call of the loss for one micro-batch; ``mask`` the response/loss mask, ``valid`` the
    generated tokens (default ``mask``). Returns loss, d loss / d log_prob, metrics, data."""
    valid = mask if valid is None else valid
    data = micro_batch(mask, old, adv, entropy=entropy, valid=valid, **batch_kw)
    lp = log_prob.clone().requires_grad_(True)
    model_output = {"log_probs": flat_model_output(lp, valid)}
    if current_entropy is not None:
        model_output["entropy"] = flat_model_output(current_entropy, valid)
    loss, metrics = ppo_loss_with_token_selection(config=config, model_output=model_output, data=data)
    loss.backward()
    return loss.detach(), lp.grad, metrics, data


def assert_equals_reference(loss, grad, log_prob, old, adv, loss_mask):
    """``loss`` and its gradient w.r.t. log_prob equal stapo_core's clipped loss over ``loss_mask``
    (token-mean, JustRL's clip [0.8, 1.28] and dual clip 10), computed directly."""
    lp = log_prob.clone().requires_grad_(True)
    ref, _ = clipped_policy_loss(lp, old, adv, loss_mask, clip_low=0.2, clip_high=0.28, clip_c=CLIP_C)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, lp.grad)


def test_stapo_mini_batch_scope_equals_stapo_core():
    """scope=mini_batch: fold the S2T mask into the mini-batch, then verl's ppo_loss == stapo_core."""
    config = actor_config("stapo", ROLLOUT)
    mask, old, log_prob, entropy, adv = random_batch()
    data = micro_batch(mask, old, adv, entropy=entropy)
    metrics = fold_into_mini_batch(config.policy_loss, data)
    expected_keep = s2t_mask(old, entropy, adv, mask).keep
    assert metrics["s2t/silenced"] > 0, "the batch must silence something for this test to mean anything"
    torch.testing.assert_close(data["response_mask"].float(), mask * expected_keep)
    torch.testing.assert_close(data["loss_mask"].float(), mask * expected_keep)

    loss, grad, _, _ = run_ppo_loss(
        config, data["response_mask"], old, log_prob, adv, valid=mask, batch_num_tokens=int(data["loss_mask"].sum())
    )
    assert_equals_reference(loss, grad, log_prob, old, adv, mask * expected_keep)
    assert torch.all(grad[expected_keep == 0] == 0)


@pytest.mark.parametrize("stats_from", ["rollout", "current"])
def test_stapo_micro_batch_scope_equals_stapo_core(stats_from):
    """scope=micro_batch: mask computed inside the loss; mean over the remaining tokens."""
    config = actor_config(
        "stapo",
        f"actor_rollout_ref.actor.policy_loss.stats_from={stats_from}",
        "actor_rollout_ref.actor.policy_loss.scope=micro_batch",
        "actor_rollout_ref.actor.calculate_entropy=true",
    )
    mask, old, log_prob, entropy, adv = random_batch(seed=1)
    stats_lp = old if stats_from == "rollout" else log_prob
    loss, grad, metrics, _ = run_ppo_loss(config, mask, old, log_prob, adv, entropy=entropy, current_entropy=entropy)
    keep = s2t_mask(stats_lp, entropy, adv, mask).keep
    assert metrics["s2t/silenced"].aggregate() == keep.numel() - keep.sum().item() - (mask == 0).sum().item()
    assert_equals_reference(loss, grad, log_prob, old, adv, mask * keep)


def test_entropy_topk_equals_stapo_core():
    config = actor_config("entropy20")
    mask, old, log_prob, entropy, adv = random_batch(seed=2)
    data = micro_batch(mask, old, adv, entropy=entropy)
    metrics = fold_into_mini_batch(config.policy_loss, data)
    keep = entropy_topk_mask(entropy, mask, ratio=0.2)
    assert metrics["entropy_topk/kept"] == keep.sum().item() > 0
    loss, grad, _, _ = run_ppo_loss(
        config, data["response_mask"], old, log_prob, adv, valid=mask, batch_num_tokens=int(data["loss_mask"].sum())
    )
    assert_equals_reference(loss, grad, log_prob, old, adv, mask * keep)


def test_rollout_and_current_statistics_agree_when_policy_equals_rollout_policy():
    """First mini-batch of a step: the policy is the rollout policy, so p and H are the same and
    both statistics silence the same tokens and give the same loss."""
    mask, old, _, entropy, adv = random_batch(seed=3)
    rollout = actor_config("stapo", ROLLOUT)
    current = actor_config(
        "stapo", "actor_rollout_ref.actor.policy_loss.stats_from=current", MICRO,
        "actor_rollout_ref.actor.calculate_entropy=true"
    )
    data = micro_batch(mask, old, adv, entropy=entropy)
    fold_metrics = fold_into_mini_batch(rollout.policy_loss, data)
    loss_r, grad_r, _, _ = run_ppo_loss(
        rollout, data["response_mask"], old, old, adv, valid=mask, batch_num_tokens=int(data["loss_mask"].sum())
    )
    loss_c, grad_c, metrics_c, _ = run_ppo_loss(current, mask, old, old, adv, current_entropy=entropy)
    assert fold_metrics["s2t/silenced"] == metrics_c["s2t/silenced"].aggregate() > 0
    assert "s2t/rollout_agreement" not in metrics_c  # no rollout entropy in this batch
    assert fold_metrics["s2t/tau_h"] == metrics_c["s2t/tau_h"].aggregate()
    torch.testing.assert_close(loss_r, loss_c)
    torch.testing.assert_close(grad_r, grad_c)


BUILTIN_MODES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo", "dppo_tv"]


@pytest.mark.parametrize("loss_mode", BUILTIN_MODES)
def test_builtin_losses_unchanged_by_patches(loss_mode):
    """verl's built-in loss modes: the wrapped ppo_loss gives exactly verl's own ppo_loss."""
    import verl.trainer.ppo.core_algos as core_algos

    assert get_policy_loss_fn(loss_mode).__module__ == core_algos.__name__
    config = actor_config("justrl", f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}")
    mask, old, log_prob, entropy, adv = random_batch(seed=4)
    outs = []
    for fn in (verl_losses.ppo_loss, ppo_loss_with_token_selection):
        torch.manual_seed(0)  # clip_cov / kl_cov draw random tokens
        data = micro_batch(mask, old, adv, entropy=entropy)
        lp = log_prob.clone().requires_grad_(True)
        loss, _ = fn(config=config, model_output={"log_probs": flat_model_output(lp, mask)}, data=data)
        loss.backward()
        outs.append((loss.detach(), lp.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)


def test_vanilla_matches_independent_clipped_loss():
    """JustRL's loss (verl vanilla, token-mean, clip [0.8, 1.28]) equals stapo_core's surrogate."""
    config = actor_config("justrl")
    mask, old, log_prob, _, adv = random_batch(seed=5)
    loss, grad, _, _ = run_ppo_loss(config, mask, old, log_prob, adv)
    assert_equals_reference(loss, grad, log_prob, old, adv, mask)


def test_degenerate_batches_give_finite_losses():
    config = actor_config("stapo", ROLLOUT)
    mask, old, log_prob, entropy, _ = random_batch(seed=7)
    for adv in (torch.zeros(B, R), -torch.ones(B, R)):  # zero advantages; no candidates
        data = micro_batch(mask, old, adv, entropy=entropy)
        metrics = fold_into_mini_batch(config.policy_loss, data)
        assert metrics["s2t/silenced"] == 0 and "s2t/tau_h" not in metrics
        loss, grad, _, _ = run_ppo_loss(config, data["response_mask"], old, log_prob, adv, valid=mask)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # everything silenced: every token a positive-advantage rare token, strategy full
    full = actor_config("stapo", ROLLOUT, "actor_rollout_ref.actor.policy_loss.strategy=full")
    rare = torch.full((B, R), -9.0)
    data = micro_batch(mask, rare, torch.ones(B, R), entropy=entropy)
    fold_into_mini_batch(full.policy_loss, data)
    assert data["loss_mask"].sum() == 0
    loss, grad, _, _ = run_ppo_loss(full, data["response_mask"], rare, rare, torch.ones(B, R), valid=mask, batch_num_tokens=0)
    assert torch.isfinite(loss) and loss == 0 and torch.all(grad == 0)


def test_current_statistics_report_agreement_with_rollout_statistics():
    """stats_from=current logs the overlap of its silenced set with the tokens its thresholds (tau_p,
    the selection's tau_h) silence on the rollout statistics: 1.0 when the policy is the rollout
    policy, below 1 once the policy drifted."""
    config = actor_config(
        "stapo", "actor_rollout_ref.actor.policy_loss.stats_from=current", MICRO,
        "actor_rollout_ref.actor.calculate_entropy=true"
    )
    mask, old, log_prob, entropy, adv = random_batch(seed=8)
    _, _, same, _ = run_ppo_loss(config, mask, old, old, adv, entropy=entropy, current_entropy=entropy)
    assert same["s2t/rollout_agreement"].aggregate() == 1.0
    drifted_entropy = entropy.flip(1)  # a different ranking of the candidates' entropies
    _, _, drift, _ = run_ppo_loss(config, mask, old, old, adv, entropy=entropy, current_entropy=drifted_entropy)
    now = s2t_mask(old, drifted_entropy, adv, mask)
    candidate = (mask != 0) & (adv > 0) & (old.exp() < 0.002)
    a, b = mask * (1 - now.keep), (candidate & (entropy < now.stats["tau_h"])).float()
    expected = ((a * b).sum() / torch.maximum(a, b).sum()).item()
    assert drift["s2t/rollout_agreement"].aggregate() == pytest.approx(expected)
    assert expected < 1.0


def test_grad_norm_of_silenced_and_kept_tokens_from_sum_pi_squared():
    """The fold logs the closed-form gradient norm sqrt(1 - 2p + sum pi^2) averaged over silenced
    tokens, kept tokens and kept candidates (A > 0, p < tau_p, entropy above tau_h), from
    distributions built explicitly (so sum pi^2 is known independently)."""
    from stapo_core import logit_grad_norm

    config = actor_config("stapo", ROLLOUT)
    mask, old, _, entropy, adv = random_batch(seed=9)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(B, R, 50, generator=g) * 3
    tokens = torch.randint(0, 50, (B, R), generator=g)
    log_probs = torch.log_softmax(logits, -1)
    old = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
    old[(mask == 1) & (adv > 0) & (torch.rand(B, R, generator=g) < 0.5)] -= 8.0  # make candidates
    sum_pi2 = (log_probs.exp() ** 2).sum(-1)
    data = micro_batch(mask, old, adv, entropy=entropy)
    data["sum_pi_squared"] = sum_pi2
    metrics = fold_into_mini_batch(config.policy_loss, data)
    keep = s2t_mask(old, entropy, adv, mask).keep
    norm = torch.sqrt((1 - 2 * old.exp() + sum_pi2).clamp(min=0))
    silenced, kept = (mask == 1) & (keep == 0), (mask == 1) & (keep == 1)
    assert silenced.any()
    assert metrics["s2t/grad_norm_silenced"] == pytest.approx(norm[silenced].mean().item(), rel=1e-6)
    assert metrics["s2t/grad_norm_kept"] == pytest.approx(norm[kept].mean().item(), rel=1e-6)
    kept_candidates = kept & (adv > 0) & (old.exp() < config.policy_loss.tau_p)
    assert kept_candidates.any() and kept_candidates.sum() < kept.sum()
    assert metrics["s2t/grad_norm_kept_candidates"] == pytest.approx(norm[kept_candidates].mean().item(), rel=1e-6)
    # where old is the true log-prob, the closed form equals stapo_core's from the logits
    untouched = old == log_probs.gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(norm[untouched], logit_grad_norm(logits, tokens)[untouched])


@pytest.mark.parametrize("stats_from, entropy_coeff, no_grad", [("current", 0, True), ("rollout", 0, False),
                                                                ("current", 0.01, False)])
def test_current_statistics_compute_the_update_entropy_without_grad(stats_from, entropy_coeff, no_grad):
    """With stats_from=current and no entropy bonus, the engine's entropy is only S2T's statistic:
    verl's TrainingWorker.set_loss_fn (patched) makes it run without autograd; otherwise untouched."""
    from functools import partial
    from types import SimpleNamespace

    from verl.workers import engine_workers

    config = actor_config("stapo", f"actor_rollout_ref.actor.policy_loss.stats_from={stats_from}", MICRO,
                          f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff}")

    def entropy_fn(logits):
        return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)

    worker = SimpleNamespace(engine=SimpleNamespace(compute_entropy_from_logits=entropy_fn))
    engine_workers.TrainingWorker.set_loss_fn(worker, partial(engine_workers.ppo_loss, config=config))
    logits = torch.randn(3, 7, requires_grad=True)
    entropy = worker.engine.compute_entropy_from_logits(logits)
    assert entropy.requires_grad is not no_grad
    torch.testing.assert_close(entropy.detach(), entropy_fn(logits).detach())
    assert worker.loss_fn.keywords["config"] is config


# --------------------------------------------------------------------------------------------
# 20-Entropy exactly as its authors' code (token_selection=entropy_topk_authors_code), on 2 ranks
# --------------------------------------------------------------------------------------------

AUTHORS_ROWS = 8  # sequences per rank and mini-batch
#: micro-batch sizes per rank: equal ones (fixed micro-batch size) and unequal ones (dynamic batch size)
AUTHORS_CASES = {
    "fixed-micro-batches-0.2": dict(ratio=0.2, splits=([2, 2, 2, 2], [2, 2, 2, 2])),
    "dynamic-micro-batches-0.37": dict(ratio=0.37, splits=([3, 5], [2, 6])),
}
READINGS = {
    "authors_code": ("actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code",),
    "pooled": ("actor_rollout_ref.actor.policy_loss.stats_from=current", MICRO),
}


def authors_batch(rank: int, seed: int = 11):
    """One rank's part of a mini-batch: lengths, advantages of both signs, ratios that clip, distinct
    entropies (no ties: torch.topk's order among equal values is unspecified)."""
    g = torch.Generator().manual_seed(seed + rank)
    mask = right_padded_mask(torch.randint(2, R + 1, (AUTHORS_ROWS,), generator=g), R)
    adv = torch.randn(AUTHORS_ROWS, generator=g)[:, None].expand(AUTHORS_ROWS, R).clone()
    old = -torch.rand(AUTHORS_ROWS, R, generator=g) * 3
    log_prob = old + 0.4 * torch.randn(AUTHORS_ROWS, R, generator=g)
    entropy = torch.rand(AUTHORS_ROWS, R, generator=g) * 5
    return mask, old, log_prob, entropy, adv


def _authors_on_rank(rank, group, payload):
    """Every case and reading on this rank, verl's way: micro-batches through the patched ppo_loss
    with the update's entropy, verl's all-reduced token count, FSDP-style gradient accumulation."""
    import torch.distributed as dist

    out = {}
    mask, old, log_prob, entropy, adv = authors_batch(rank)
    batch_num_tokens = mask.sum()
    dist.all_reduce(batch_num_tokens, group=group)
    for name, case in AUTHORS_CASES.items():
        for reading, overrides in READINGS.items():
            config = actor_config("entropy20", "actor_rollout_ref.actor.calculate_entropy=true",
                                  f"actor_rollout_ref.actor.policy_loss.entropy_top_ratio={case['ratio']}", *overrides)
            lp = log_prob.clone().requires_grad_(True)
            total, kept, start = torch.zeros(()), [], 0
            for size in case["splits"][rank]:
                sl = slice(start, start + size)
                start += size
                data = micro_batch(mask[sl], old[sl], adv[sl], dp_size=2, batch_num_tokens=int(batch_num_tokens),
                                   global_batch_size=2 * AUTHORS_ROWS)
                model_output = {"log_probs": flat_model_output(lp[sl], mask[sl]),
                                "entropy": flat_model_output(entropy[sl], mask[sl])}
                loss, metrics = ppo_loss_with_token_selection(config=config, model_output=model_output, data=data,
                                                              dp_group=group)
                loss.backward()
                total = total + loss.detach()
                kept.append(metrics[config.policy_loss.rule.metric_prefix + "kept"].aggregate())
            out[(name, reading)] = {"loss": total, "grad": lp.grad, "kept": kept}
    return out


@pytest.fixture(scope="module")
def authors_ranks(tmp_path_factory):
    """Every case and reading on 2 gloo ranks, in one spawn."""
    from tests.helpers.dist_utils import run_on_ranks

    return run_on_ranks(_authors_on_rank, None, 2, tmp_path_factory.mktemp("authors"))


def authors_reference(rank: int, case: dict):
    """The authors' code on this rank's part (tests.helpers.authors_entropy_topk)."""
    from tests.helpers.authors_entropy_topk import rank_update

    config = actor_config("entropy20")
    mask, old, log_prob, entropy, adv = authors_batch(rank)
    lp = log_prob.clone().requires_grad_(True)
    micro_batches, start = [], 0
    for size in case["splits"][rank]:
        sl = slice(start, start + size)
        start += size
        micro_batches.append((lp[sl], old[sl], adv[sl], mask[sl], entropy[sl]))
    total, kept = rank_update(micro_batches, AUTHORS_ROWS, case["ratio"], config.clip_ratio_low,
                              config.clip_ratio_high, config.clip_ratio_c)
    return total, lp.grad, kept


@pytest.mark.parametrize("case", list(AUTHORS_CASES))
def test_entropy_topk_authors_code_reading_equals_the_authors_code_on_two_ranks(case, authors_ranks):
    """Per rank and micro-batch: the same tokens kept, and the same loss and gradient (each rank's,
    hence their FSDP average) as the authors' selection and loss; the pooled reading differs."""
    for rank in range(2):
        ours = authors_ranks[rank][(case, "authors_code")]
        want_loss, want_grad, want_kept = authors_reference(rank, AUTHORS_CASES[case])
        assert ours["kept"] == want_kept
        torch.testing.assert_close(ours["loss"], want_loss)
        torch.testing.assert_close(ours["grad"], want_grad)
        assert ours["grad"].abs().sum() > 0
    pooled = [authors_ranks[rank][(case, "pooled")]["grad"] for rank in range(2)]
    assert any(not torch.allclose(pooled[rank], authors_ranks[rank][(case, "authors_code")]["grad"])
               for rank in range(2))


def test_authors_code_rule_is_one_switch_and_refuses_other_settings():
    """token_selection=entropy_topk_authors_code alone selects in the loss, from the update's entropy, per
    rank (its rule's own scope); it refuses a mini-batch scope, a pool of ranks, and (at the loss) a loss
    aggregation other than token-mean; the key of the reading it replaces is refused naming the key."""
    from stapo_core.rules import RANK_MICRO_BATCH
    from verl_patches.policy_loss_config import TokenSelectionLossConfig
    from verl_patches.trainers import needs_rollout_entropy

    policy = actor_config("entropy20", "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code").policy_loss
    assert policy.stats_from == "rollout"  # the method's YAML value, not read by this rule
    assert policy.selects_in_loss and policy.needs_update_entropy and policy.resolved_scope == RANK_MICRO_BATCH
    assert not policy.folds_into_mini_batch and policy.pool_ranks(8) == 1
    # only the S2T monitor (on in every method's YAML) reads the rollout statistics
    assert policy.monitors_s2t and needs_rollout_entropy(compose(["method=entropy20", "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code"]))
    assert not needs_rollout_entropy(compose(["method=entropy20", "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code",
                                              "actor_rollout_ref.actor.policy_loss.s2t_monitor=false"]))
    with pytest.raises(ValueError, match="scope='mini_batch'.*token_selection=entropy_topk_authors_code"):
        TokenSelectionLossConfig(token_selection="entropy_topk_authors_code", scope="mini_batch")
    with pytest.raises(ValueError, match="override refused: Could not override "
                                         r"'actor_rollout_ref\.actor\.policy_loss\.entropy_topk_reading'"):
        compose(["method=entropy20", "actor_rollout_ref.actor.policy_loss.entropy_topk_reading=authors_code"])
    config = actor_config("entropy20", "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    mask, old, log_prob, entropy, adv = random_batch(seed=12)
    with pytest.raises(ValueError, match="authors_code.*loss_agg_mode=seq-mean-token-mean"):
        run_ppo_loss(config, mask, old, log_prob, adv, current_entropy=entropy)


# --------------------------------------------------------------------------------------------
# token selection under every verl loss: token-level and sequence-level ratios (sequence_ratio)
# --------------------------------------------------------------------------------------------

PLK = "actor_rollout_ref.actor.policy_loss"


def test_every_registered_loss_has_a_stated_ratio_level():
    """docs/method.md states, for every loss verl registers, whether its ratio is per token or per
    sequence; the sequence-level ones are those ``sequence_ratio`` switches."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl_patches.policy_loss_config import SEQUENCE_RATIO_LOSS_MODES
    from verl_patches.losses import RATIO_LEVEL

    assert set(RATIO_LEVEL) == set(POLICY_LOSS_REGISTRY)
    assert {m for m, level in RATIO_LEVEL.items() if level == "sequence"} == set(SEQUENCE_RATIO_LOSS_MODES)
    from tests.helpers.paths import REPO

    method = (REPO / "docs" / "method.md").read_text()
    for mode in RATIO_LEVEL:
        assert f"| `{mode}` |" in method, f"docs/method.md does not state what token selection does to {mode}"


def selected_loss(config, mask, old, log_prob, adv, entropy, scope):
    """The loss and d/d log_prob of one mini-batch (one micro-batch) with S2T (strategy=full) at ``scope``."""
    from verl_patches.layout import UNSELECTED_MASK_FIELD

    if scope == "micro_batch":
        loss, grad, _, _ = run_ppo_loss(config, mask, old, log_prob, adv, entropy=entropy,
                                        batch_num_tokens=int(mask.sum()), global_batch_size=B)
        return loss, grad
    data = micro_batch(mask, old, adv, entropy=entropy)
    fold_into_mini_batch(config.policy_loss, data)
    step = micro_batch(data["response_mask"], old, adv, valid=mask, batch_num_tokens=int(data["loss_mask"].sum()),
                       global_batch_size=tu.get(data, "global_batch_size"))
    if UNSELECTED_MASK_FIELD in data.keys():
        step[UNSELECTED_MASK_FIELD] = data[UNSELECTED_MASK_FIELD]
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = ppo_loss_with_token_selection(config=config, model_output={"log_probs": flat_model_output(lp, mask)},
                                            data=step)
    loss.backward()
    return loss.detach(), lp.grad


def unselected_loss(config, mask, old, log_prob, adv):
    """verl's own loss over every response token (no selection)."""
    data = micro_batch(mask, old, adv, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = verl_losses.ppo_loss(config=config, model_output={"log_probs": flat_model_output(lp, mask)}, data=data)
    loss.backward()
    return loss.detach(), lp.grad


def sequence_batch():
    """random_batch with every row's log-probs moved (ratios away from 1, some clipped)."""
    mask, old, log_prob, entropy, adv = random_batch(seed=13)
    log_prob = old + 0.15 * torch.randn(B, R, generator=torch.Generator().manual_seed(14))
    return mask, old, log_prob, entropy, adv


@pytest.mark.parametrize("scope", ["mini_batch", "micro_batch"])
def test_gspo_all_tokens_keeps_the_sequence_ratio_and_silences_gradient_only(scope):
    """GSPO, seq-mean-token-mean: d/d log p_t = -A_i s_i / (|tokens_i| * sequences) unclipped. With
    sequence_ratio=all_tokens, s_i is the unselected sequence's, so each kept token's gradient is the
    unselected one rescaled by |y_i| * B / (|kept_i| * kept sequences); silenced tokens get none.
    With kept_tokens (the default) s_i changes, and so does that relation."""
    over = ("method=stapo", f"{PLK}.loss_mode=gspo", f"{PLK}.stats_from=rollout", f"{PLK}.strategy=full",
            f"{PLK}.scope={scope}", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    all_tokens = omega_conf_to_dataclass(compose([*over, "model=qwen3_1_7b", f"{PLK}.sequence_ratio=all_tokens"]).actor_rollout_ref.actor)
    kept_tokens = omega_conf_to_dataclass(compose([*over, "model=qwen3_1_7b"]).actor_rollout_ref.actor)
    mask, old, log_prob, entropy, adv = sequence_batch()
    keep = mask * s2t_mask(old, entropy, adv, mask, strategy="full").keep
    silenced = (mask - keep) > 0
    assert silenced.any() and (keep.sum(-1) > 0).all()
    _, full_grad = unselected_loss(all_tokens, mask, old, log_prob, adv)
    scale = (mask.sum(-1) * B / (keep.sum(-1) * (keep.sum(-1) > 0).sum()))[:, None]
    _, grad = selected_loss(all_tokens, mask, old, log_prob, adv, entropy, scope)
    assert torch.all(grad[silenced] == 0)
    torch.testing.assert_close(grad[keep > 0], (full_grad * scale)[keep > 0])
    _, grad_kept = selected_loss(kept_tokens, mask, old, log_prob, adv, entropy, scope)
    assert torch.all(grad_kept[silenced] == 0)
    assert not torch.allclose(grad_kept[keep > 0], (full_grad * scale)[keep > 0])


def test_geo_mean_all_tokens_keeps_the_geometric_mean_and_silences_gradient_only():
    """GMPO: with sequence_ratio=all_tokens the loss is the unselected one and every kept token's
    gradient too (the geometric mean and its 1/|y_i| are the whole sequence's); silenced tokens get
    none. With kept_tokens both change."""
    over = ["method=stapo", "model=qwen3_1_7b", f"{PLK}.loss_mode=geo_mean", f"{PLK}.stats_from=rollout",
            f"{PLK}.strategy=full"]
    all_tokens = omega_conf_to_dataclass(compose([*over, f"{PLK}.sequence_ratio=all_tokens"]).actor_rollout_ref.actor)
    kept_tokens = omega_conf_to_dataclass(compose(over).actor_rollout_ref.actor)
    mask, old, log_prob, entropy, adv = sequence_batch()
    keep = mask * s2t_mask(old, entropy, adv, mask, strategy="full").keep
    silenced = (mask - keep) > 0
    full_loss, full_grad = unselected_loss(all_tokens, mask, old, log_prob, adv)
    loss, grad = selected_loss(all_tokens, mask, old, log_prob, adv, entropy, "mini_batch")
    torch.testing.assert_close(loss, full_loss)
    assert torch.all(grad[silenced] == 0)
    torch.testing.assert_close(grad[keep > 0], full_grad[keep > 0])
    loss_kept, grad_kept = selected_loss(kept_tokens, mask, old, log_prob, adv, entropy, "mini_batch")
    assert torch.all(grad_kept[silenced] == 0)
    assert not torch.allclose(grad_kept[keep > 0], full_grad[keep > 0]) and not torch.allclose(loss_kept, full_loss)


@pytest.mark.parametrize("loss_mode", ["vanilla", "dppo_tv", "gpg", "cispo", "sapo"])
def test_token_level_losses_keep_each_kept_tokens_own_loss(loss_mode):
    """A token-level ratio: silencing other tokens changes a kept token's gradient only through the
    mean's denominator (token-mean: tokens / kept)."""
    config = actor_config("stapo", f"{PLK}.loss_mode={loss_mode}", f"{PLK}.stats_from=rollout", f"{PLK}.strategy=full")
    mask, old, log_prob, entropy, adv = sequence_batch()
    keep = mask * s2t_mask(old, entropy, adv, mask, strategy="full").keep
    _, full_grad = unselected_loss(config, mask, old, log_prob, adv)
    _, grad = selected_loss(config, mask, old, log_prob, adv, entropy, "mini_batch")
    if loss_mode == "sapo":  # seq-mean-token-mean whatever the setting: per sequence, tokens / kept
        scale = (mask.sum(-1) * B / (keep.sum(-1) * (keep.sum(-1) > 0).sum()))[:, None].expand(B, R)
    else:
        scale = torch.full((B, R), mask.sum() / keep.sum())
    torch.testing.assert_close(grad[keep > 0], (full_grad * scale)[keep > 0])
    assert torch.all(grad[(mask - keep) > 0] == 0)


def test_sequence_ratio_all_tokens_needs_a_sequence_level_loss():
    from verl_patches.policy_loss_config import TokenSelectionLossConfig

    with pytest.raises(ValueError, match="sequence_ratio='all_tokens'.*loss_mode=vanilla"):
        TokenSelectionLossConfig(token_selection="s2t", sequence_ratio="all_tokens")
    assert TokenSelectionLossConfig(token_selection="s2t", loss_mode="gspo",
                                    sequence_ratio="all_tokens").sequence_ratio_over_all_tokens


def test_geo_mean_leaves_a_fully_silenced_sequence_out_of_the_mean():
    """verl's geo_mean averages over every row of the micro-batch; a sequence whose every token was
    silenced must not count (it would scale the others' loss by kept / rows): the loss and
    gradients equal verl's own geo_mean over the sequences that keep a token."""
    config = actor_config("stapo", f"{PLK}.loss_mode=geo_mean", f"{PLK}.stats_from=rollout", f"{PLK}.strategy=full")
    mask, old, log_prob, _, adv = sequence_batch()
    kept = mask.clone()
    kept[0] = 0  # every token silenced (positive advantage: S2T can do this)
    kept[3, :2] = 0  # partly silenced
    rows = [i for i in range(B) if i != 0]
    step = micro_batch(kept, old, adv, valid=mask, batch_num_tokens=int(kept.sum()), global_batch_size=B)
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = ppo_loss_with_token_selection(config=config, model_output={"log_probs": flat_model_output(lp, mask)}, data=step)
    loss.backward()
    sub = micro_batch(kept[rows], old[rows], adv[rows], valid=mask[rows], batch_num_tokens=int(kept.sum()),
                      global_batch_size=B - 1)
    lp_sub = log_prob[rows].clone().requires_grad_(True)
    ref, _ = verl_losses.ppo_loss(config=config, model_output={"log_probs": flat_model_output(lp_sub, mask[rows])}, data=sub)
    ref.backward()
    assert ref.abs() > 0
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(lp.grad[rows], lp_sub.grad)
    assert torch.all(lp.grad[0] == 0)


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
"""Every ``loss_agg_mode`` verl 0.9.1's actor config accepts (its ``valid_loss_agg_modes``)."""


def agg_scale(mode, mask, keep):
    """What silencing does to a kept token's gradient under ``mode`` for a loss whose per-token
    term is the token's own (token-level ratios, or GSPO with sequence_ratio=all_tokens): the
    unselected gradient times the change of the aggregation's denominator."""
    kept_rows = (keep.sum(-1) > 0).sum()
    if mode == "token-mean":  # one denominator: the mini-batch's tokens
        return torch.full((B, R), float(mask.sum() / keep.sum()))
    if mode == "seq-mean-token-mean":  # each sequence's own tokens, then the sequences that keep one
        return (mask.sum(-1) * B / (keep.sum(-1).clamp(min=1) * kept_rows))[:, None].expand(B, R)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):  # the sequences that keep a token (-norm:
        return torch.full((B, R), float(B / kept_rows))              # the same, over a constant horizon)
    return torch.ones(B, R)  # token-sum: no denominator


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode, extra", [("vanilla", ()), ("cispo", ()), ("gspo", (f"{PLK}.sequence_ratio=all_tokens",))])
def test_each_composed_loss_under_each_aggregation_mode(loss_mode, extra, mode):
    """The table of docs/method.md, per aggregation mode: a kept token's gradient is the unselected
    one times the change of the aggregation's denominator (for GSPO all_tokens: ``s_i`` stays the
    whole sequence's, so under seq-mean-token-mean it is ``|y_i| B / (kept_i kept_sequences)``, under
    token-mean ``tokens / kept``); silenced tokens get none, CISPO's included (silencing overrides
    its keep-every-token's-gradient design)."""
    config = actor_config("stapo", f"{PLK}.loss_mode={loss_mode}", f"{PLK}.stats_from=rollout", f"{PLK}.strategy=full",
                          f"actor_rollout_ref.actor.loss_agg_mode={mode}", *extra)
    mask, old, log_prob, entropy, adv = sequence_batch()
    keep = mask * s2t_mask(old, entropy, adv, mask, strategy="full").keep
    silenced = (mask - keep) > 0
    assert silenced.any()
    _, full_grad = unselected_loss(config, mask, old, log_prob, adv)
    _, grad = selected_loss(config, mask, old, log_prob, adv, entropy, "mini_batch")
    assert torch.all(grad[silenced] == 0)
    torch.testing.assert_close(grad[keep > 0], (full_grad * agg_scale(mode, mask, keep))[keep > 0])


def test_the_per_mode_table_of_the_docs_lists_every_mode_verl_accepts():
    """docs/method.md's table "Per aggregation mode" has a row for every loss_agg_mode verl's actor
    config accepts, and none other; the test above checks each row."""
    import inspect

    from verl.workers.config import actor

    from tests.helpers.paths import REPO

    source = inspect.getsource(actor)
    listed = source[source.index("valid_loss_agg_modes = [") : source.index("]", source.index("valid_loss_agg_modes = ["))]
    assert set(re.findall(r'"([a-z-]+)"', listed)) == set(AGG_MODES)
    method = (REPO / "docs" / "method.md").read_text()
    table = method[method.index("**Per aggregation mode.**") :].split("\n\n")[1]
    rows = {line.split("|")[1].strip().split(" ")[0].strip("`") for line in table.splitlines()[2:]  # below the header
            if not line.startswith("| any")}
    assert rows == set(AGG_MODES)


@pytest.mark.parametrize("sequence_ratio", ["kept_tokens", "all_tokens"])
def test_geo_mean_ignores_the_aggregation_mode(sequence_ratio):
    """verl's geo_mean is a mean over the micro-batch's sequences whatever loss_agg_mode says; with
    token selection too."""
    losses = []
    for mode in AGG_MODES:
        config = actor_config("stapo", f"{PLK}.loss_mode=geo_mean", f"{PLK}.stats_from=rollout", f"{PLK}.strategy=full",
                              f"actor_rollout_ref.actor.loss_agg_mode={mode}", f"{PLK}.sequence_ratio={sequence_ratio}")
        mask, old, log_prob, entropy, adv = sequence_batch()
        losses.append(selected_loss(config, mask, old, log_prob, adv, entropy, "mini_batch"))
    for loss, grad in losses[1:]:
        torch.testing.assert_close(loss, losses[0][0])
        torch.testing.assert_close(grad, losses[0][1])


def test_gspo_all_tokens_logs_ppo_kl_from_the_shifted_old_log_probs():
    """With GSPO and sequence_ratio=all_tokens the old log-probs verl sees are shifted per sequence,
    so its logged actor/ppo_kl is the kept tokens' mean of ``old + shift - log p``, not the
    unshifted one (docs/metrics.md says so)."""
    config = actor_config("stapo", f"{PLK}.loss_mode=gspo", f"{PLK}.stats_from=rollout", f"{PLK}.strategy=full",
                          f"{PLK}.sequence_ratio=all_tokens")
    mask, old, log_prob, entropy, adv = sequence_batch()
    keep = mask * s2t_mask(old, entropy, adv, mask, strategy="full").keep
    data = micro_batch(mask, old, adv, entropy=entropy)
    fold_into_mini_batch(config.policy_loss, data)
    from verl_patches.layout import UNSELECTED_MASK_FIELD

    step = micro_batch(data["response_mask"], old, adv, valid=mask, batch_num_tokens=int(keep.sum()),
                       global_batch_size=tu.get(data, "global_batch_size"))
    step[UNSELECTED_MASK_FIELD] = data[UNSELECTED_MASK_FIELD]
    _, metrics = ppo_loss_with_token_selection(config=config, model_output={"log_probs": flat_model_output(log_prob, mask)},
                                               data=step)
    log_ratio = (log_prob - old).double()
    shift = (log_ratio * keep).sum(-1) / keep.sum(-1).clamp(min=1) - (log_ratio * mask).sum(-1) / mask.sum(-1)
    shifted = ((old + shift[:, None] - log_prob) * keep).sum() / keep.sum()
    unshifted = ((old - log_prob) * keep).sum() / keep.sum()
    logged = metrics["actor/ppo_kl"].aggregate()
    assert logged == pytest.approx(float(shifted), rel=1e-4, abs=1e-6)
    assert abs(float(shifted) - float(unshifted)) > 1e-4
