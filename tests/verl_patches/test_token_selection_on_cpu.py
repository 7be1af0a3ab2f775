"""Token selection as a layer under every verl policy loss, and the config-to-mask path.

References are computed another way: verl's own ``ppo_loss`` on a batch whose response mask
already excludes the silenced tokens (with its token and sequence counts recounted by hand), and
``stapo_core.s2t_mask`` / ``entropy_topk_mask`` called directly with the values the config carries.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

import importlib

import verl_patches.activate  # noqa: F401  (installs the patches)
from recipe.stapo.driver import compose
from stapo_core import s2t_mask, entropy_topk_mask
from tests.helpers.verl_batch import actor_config, flat_model_output, micro_batch, right_padded_mask
from tests.helpers.verl_validation import validate
from verl.utils import tensordict_utils as tu
from verl.workers import engine_workers
from verl.workers.utils import losses as verl_losses
from verl_patches.policy_loss_config import LOCAL_NORMALISING_LOSS_MODES
from verl_patches.losses import ppo_loss_with_token_selection
from verl_patches.token_selection import fold_into_mini_batch

B, R = 6, 12
PL = "actor_rollout_ref.actor.policy_loss"
#: every policy loss verl 0.9.1 registers that runs on this batch layout
LOSS_MODES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo", "dppo_tv"]
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def batch(seed: int = 0):
    """Rare tokens (p < 0.002) in positive-advantage rows, one row made entirely of candidates (so
    ``strategy=full`` silences the whole sequence), varied entropies."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, R + 1, (B,), generator=g)
    mask = right_padded_mask(lengths, R)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 1.5])[:, None].expand(B, R).clone()
    old = -torch.rand(B, R, generator=g) * 2.0
    rare = (torch.rand(B, R, generator=g) < 0.4) & (adv > 0)
    old[rare] = -7.0 - torch.rand(int(rare.sum()), generator=g)
    old[5] = -8.0  # row 5: every token a candidate
    log_prob = old + 0.05 * torch.randn(B, R, generator=g)
    entropy = torch.rand(B, R, generator=g) * 3.0
    return mask, old, log_prob, entropy, adv


def verl_loss(config, mask, valid, old, log_prob, adv, *, batch_num_tokens, global_batch_size, entropy=None,
              fn=None):
    """One micro-batch through ``fn`` (default verl's own ``ppo_loss``); returns loss and d/d log_prob."""
    torch.manual_seed(0)  # clip_cov / kl_cov draw random tokens
    data = micro_batch(mask, old, adv, entropy=entropy, valid=valid, batch_num_tokens=batch_num_tokens,
                       global_batch_size=global_batch_size)
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = (fn or verl_losses.ppo_loss)(config=config, model_output={"log_probs": flat_model_output(lp, valid)},
                                           data=data)
    loss.backward()
    return loss.detach(), lp.grad


def reference(config, keep, mask, old, log_prob, adv):
    """verl's loss on the batch with the silenced tokens removed from the mask, counts recounted
    (geo_mean, which averages over the micro-batch's rows: a fully silenced sequence removed too)."""
    kept = mask * keep
    counts = dict(batch_num_tokens=int(kept.sum()), global_batch_size=int((kept.sum(-1) > 0).sum()))
    if config.policy_loss.loss_mode == "geo_mean":
        rows = kept.sum(-1) > 0
        loss, grad = verl_loss(config, kept[rows], mask[rows], old[rows], log_prob[rows], adv[rows], **counts)
        full = torch.zeros_like(log_prob)
        full[rows] = grad
        return loss, full
    return verl_loss(config, kept, mask, old, log_prob, adv, **counts)


CASES = [(scope, mode, agg) for scope in ("mini_batch", "micro_batch") for mode in LOSS_MODES for agg in AGG_MODES
         if not (scope == "micro_batch" and mode in LOCAL_NORMALISING_LOSS_MODES)]


@pytest.mark.parametrize("scope, loss_mode, agg", CASES)
def test_s2t_under_every_loss_mode_equals_that_loss_on_the_remaining_tokens(loss_mode, agg, scope):
    config = actor_config("method=stapo", f"{PL}.loss_mode={loss_mode}", f"{PL}.stats_from=rollout",
                          f"{PL}.scope={scope}", f"{PL}.strategy=full", f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    mask, old, log_prob, entropy, adv = batch()
    keep = s2t_mask(old, entropy, adv, mask, strategy="full").keep
    assert (mask * keep)[5].sum() == 0 and (mask * (1 - keep)).sum() > mask[5].sum()  # a whole row silenced
    if scope == "mini_batch":
        data = micro_batch(mask, old, adv, entropy=entropy)
        fold_into_mini_batch(config.policy_loss, data)
        got = verl_loss(config, data["response_mask"], mask, old, log_prob, adv, entropy=entropy,
                        batch_num_tokens=int(data["loss_mask"].sum()),
                        global_batch_size=tu.get(data, "global_batch_size"), fn=ppo_loss_with_token_selection)
    else:  # one micro-batch per mini-batch: verl's counts are taken before the selection
        got = verl_loss(config, mask, mask, old, log_prob, adv, entropy=entropy, batch_num_tokens=int(mask.sum()),
                        global_batch_size=B, fn=ppo_loss_with_token_selection)
    want = reference(config, keep, mask, old, log_prob, adv)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert torch.all(got[1][(mask * (1 - keep)) == 1] == 0)


@pytest.mark.parametrize("loss_mode", LOCAL_NORMALISING_LOSS_MODES)
def test_micro_batch_scope_refuses_losses_that_normalise_themselves(loss_mode):
    cfg = compose(["method=stapo", f"{PL}.loss_mode={loss_mode}", f"{PL}.scope=micro_batch"])
    with pytest.raises(ValueError, match=f"scope.*loss_mode={loss_mode}"):
        validate(cfg)


def test_fully_silenced_sequence_drops_out_of_seq_mean():
    """seq-mean-token-mean: the mean over the sequences that keep a token of their token means."""
    config = actor_config("method=stapo", f"{PL}.stats_from=rollout", f"{PL}.strategy=full",
                          "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                          "actor_rollout_ref.actor.clip_ratio_c=1000")
    mask, old, _, entropy, adv = batch(seed=1)
    data = micro_batch(mask, old, adv, entropy=entropy)
    fold_into_mini_batch(config.policy_loss, data)
    kept = data["response_mask"].float()
    assert kept[5].sum() == 0 and tu.get(data, "global_batch_size") == int((kept.sum(-1) > 0).sum()) == B - 1
    loss, _ = verl_loss(config, data["response_mask"], mask, old, old, adv, entropy=entropy,
                        batch_num_tokens=int(kept.sum()), global_batch_size=tu.get(data, "global_batch_size"),
                        fn=ppo_loss_with_token_selection)
    per_token = -adv  # ratio 1: the surrogate is -A at every kept token
    seq_means = [(per_token[i] * kept[i]).sum() / kept[i].sum() for i in range(B) if kept[i].sum() > 0]
    torch.testing.assert_close(loss, torch.stack(seq_means).mean())


@pytest.mark.parametrize("loss_mode", LOSS_MODES)
def test_no_selection_is_bitwise_plain_verl(loss_mode):
    config = actor_config("method=stapo", f"{PL}.loss_mode={loss_mode}", f"{PL}.token_selection=none")
    mask, old, log_prob, entropy, adv = batch(seed=2)
    kw = dict(entropy=entropy, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    ours = verl_loss(config, mask, mask, old, log_prob, adv, fn=ppo_loss_with_token_selection, **kw)
    plain = verl_loss(config, mask, mask, old, log_prob, adv, **kw)
    torch.testing.assert_close(ours[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], plain[1], rtol=0, atol=0)


def test_entropy_topk_reference_code_reading_selects_per_micro_batch_from_current_entropy():
    """20-Entropy's reference code: top 20% of each micro-batch by the update's own entropy."""
    config = actor_config("method=entropy20", f"{PL}.stats_from=current", f"{PL}.scope=micro_batch",
                          "actor_rollout_ref.actor.calculate_entropy=true")
    mask, old, log_prob, entropy, adv = batch(seed=3)
    current_entropy = entropy.flip(0)  # differs from the rollout entropy in the batch
    data = micro_batch(mask, old, adv, entropy=entropy)
    lp = log_prob.clone().requires_grad_(True)
    out = {"log_probs": flat_model_output(lp, mask), "entropy": flat_model_output(current_entropy, mask)}
    loss, metrics = ppo_loss_with_token_selection(config=config, model_output=out, data=data)
    loss.backward()
    keep = entropy_topk_mask(current_entropy, mask, ratio=0.2)
    assert metrics["entropy_topk/kept"].aggregate() == keep.sum().item() > 0
    want = reference(config, keep, mask, old, log_prob, adv)
    torch.testing.assert_close(loss.detach(), want[0])
    torch.testing.assert_close(lp.grad, want[1])


# --------------------------------------------------------------------------------------------
# the actor's code path: composed config -> TrainingWorker.train_batch (patched) -> folded mask
# --------------------------------------------------------------------------------------------


class FakeWorker:
    """What the patched ``TrainingWorker.train_batch`` uses of verl's worker: the bound loss function
    (carrying the actor config), the engine's data-parallel group and parameters, and
    ``infer_batch`` (the current policy's forward), which returns given statistics."""

    def __init__(self, config, current=None):
        self.loss_fn = partial(engine_workers.ppo_loss, config=config)
        self.engine = SimpleNamespace(get_data_parallel_group=lambda: None, module=torch.nn.Linear(1, 1))
        self.engine_config = SimpleNamespace(infer_micro_batch_size_per_gpu=4, use_dynamic_bsz=False,
                                             infer_max_token_len_per_gpu=None)
        self.current, self.forwards, self.seen = current, 0, []
        # verl's train_batch replaced by a recorder, under the recipe's wrapper (one per worker, as in verl)
        self.train_batch = importlib.import_module("verl_patches.mini_batch").wrap_train_batch(
            lambda worker, data: worker.seen.append(data["response_mask"].clone()))

    def infer_batch(self, data):
        self.forwards += 1
        assert tu.get(data, "calculate_entropy") and not tu.get(data, "compute_loss")
        assert len(data) % tu.get(data, "micro_batch_size_per_gpu") == 0  # B = 6, infer micro size 4 -> 2
        lp, ent = self.current
        valid = data["attention_mask"][:, -R:]
        return {"log_probs": flat_model_output(lp, valid), "entropy": flat_model_output(ent, valid)}


def train_mini_batches(worker, mini_batches):
    """Run the patched ``train_batch`` over ``mini_batches`` (the last flagged as verl does) and
    return the response mask each update saw."""
    start = len(worker.seen)
    for i, data in enumerate(mini_batches):
        tu.assign_non_tensor(data, update_lr_scheduler=i == len(mini_batches) - 1)
        worker.train_batch(worker, data)
    return worker.seen[start:]


def test_non_default_settings_travel_from_the_config_to_the_mask():
    """tau_p, q, strategy and seed given as overrides reach the mask the update uses: dropping any
    one of them on the way would change it."""
    settings = dict(tau_p=0.01, q=0.4, strategy="random", seed=7)
    config = actor_config("method=stapo", f"{PL}.stats_from=rollout",
                          *(f"{PL}.{k}={v}" for k, v in settings.items()))
    mask, old, _, entropy, adv = batch(seed=4)
    between = (mask == 1) & (adv > 0) & (torch.arange(R) % 3 == 0)
    old[between] = torch.log(torch.tensor(0.005))  # candidates for tau_p = 0.01 only
    (seen,) = train_mini_batches(FakeWorker(config), [micro_batch(mask, old, adv, entropy=entropy)])
    generator = torch.Generator().manual_seed(settings["seed"] * 1_000_003)  # rank 0
    want = s2t_mask(old, entropy, adv, mask, tau_p=settings["tau_p"], q=settings["q"], strategy="random",
                    generator=generator).keep
    torch.testing.assert_close(seen.float(), mask * want, rtol=0, atol=0)
    defaults = s2t_mask(old, entropy, adv, mask).keep
    assert not torch.equal(mask * want, mask * defaults)
    for key, value in settings.items():  # each setting matters on this batch
        changed = {**settings, key: {"tau_p": 0.002, "q": 0.75, "strategy": "low_entropy", "seed": 0}[key]}
        gen = torch.Generator().manual_seed(changed["seed"] * 1_000_003)
        other = s2t_mask(old, entropy, adv, mask, tau_p=changed["tau_p"], q=changed["q"],
                         strategy=changed["strategy"], generator=gen).keep
        assert not torch.equal(mask * other, mask * want), f"{key} does not change the mask on this batch"


def test_current_statistics_forward_every_mini_batch_but_the_first():
    """stats_from=current (Algorithm 1): the first mini-batch of a step uses the rollout statistics
    (the policy has not moved), each later one the current policy's, from one forward each (every
    sequence: current_forward=full; the positive-advantage forward is test_current_stats_on_cpu.py's)."""
    config = actor_config("method=stapo", f"{PL}.stats_from=current", f"{PL}.current_forward=full")
    mask, old, log_prob, entropy, adv = batch(seed=5)
    moved_lp, moved_entropy = log_prob - 0.5 * torch.rand(B, R), entropy.flip(1)
    worker = FakeWorker(config, current=(moved_lp, moved_entropy))
    mini_batches = [micro_batch(mask, old, adv, entropy=entropy) for _ in range(3)]
    seen = train_mini_batches(worker, mini_batches)
    assert worker.forwards == 2
    torch.testing.assert_close(seen[0].float(), mask * s2t_mask(old, entropy, adv, mask).keep, rtol=0, atol=0)
    moved = mask * s2t_mask(moved_lp, moved_entropy, adv, mask).keep
    assert not torch.equal(moved, seen[0].float())
    for folded in seen[1:]:
        torch.testing.assert_close(folded.float(), moved, rtol=0, atol=0)
    # a new step: its first mini-batch again needs no forward
    train_mini_batches(worker, [micro_batch(mask, old, adv, entropy=entropy)])
    assert worker.forwards == 2
