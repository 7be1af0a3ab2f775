"""verl_patches.mini_batch_view and verl_patches.mini_batch: each mini-batch's position in its step, counted once per worker, and
handed to the S2T statistics (current-policy forward or not) and the token dump."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from recipe.stapo.driver import compose
from stapo_core import s2t_mask
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers import engine_workers
from tests.helpers.verl_batch import flat_model_output, micro_batch, right_padded_mask
from verl_patches import mini_batch
from verl_patches.mini_batch_view import COUNTER_ATTR, MiniBatchCounter, MiniBatchPosition

B, R = 6, 10


def test_counter_positions_follow_verls_last_flag():
    counter = MiniBatchCounter()
    # 2 steps of 3 mini-batches, then 1 step of 1, then 2 PPO epochs x 2 mini-batches (flag on the very last)
    flags = [False, False, True, False, False, True, True, False, False, False, True]
    positions = list(map(counter.observe, flags))
    got = [(p.step, p.index, p.first) for p in positions]
    assert got == [(1, 0, True), (1, 1, False), (1, 2, False), (2, 0, True), (2, 1, False), (2, 2, False),
                   (3, 0, True), (4, 0, True), (4, 1, False), (4, 2, False), (4, 3, False)]
    assert [p.last for p in positions] == flags


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(torch.randint(5, R + 1, (B,), generator=g), R)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 1.5])[:, None].expand(B, R).clone()
    old = -torch.rand(B, R, generator=g) * 2.0
    rare = (torch.rand(B, R, generator=g) < 0.5) & (adv > 0)
    old[rare] = -7.0 - torch.rand(int(rare.sum()), generator=g)
    entropy = torch.rand(B, R, generator=g) * 3.0
    moved = (old - 0.5 * torch.rand(B, R, generator=g), entropy.flip(1))
    return mask, old, adv, entropy, moved


class Worker:
    """Two instances of one class whose ``train_batch`` is patched at the class level, as verl's
    ``TrainingWorker`` is: the parts of verl's worker the wrapper uses (bound loss function, engine,
    ``infer_batch`` returning the current policy's statistics)."""

    def __init__(self, config, current):
        self.loss_fn = partial(engine_workers.ppo_loss, config=config)
        self.engine = SimpleNamespace(get_data_parallel_group=lambda: None, module=torch.nn.Linear(1, 1))
        self.engine_config = SimpleNamespace(infer_micro_batch_size_per_gpu=B, use_dynamic_bsz=False,
                                             infer_max_token_len_per_gpu=None)
        self.current, self.forwards, self.seen = current, [], []

    def infer_batch(self, data):
        self.forwards.append(len(self.seen))
        lp, ent = self.current
        valid = data["attention_mask"][:, -R:]
        return {"log_probs": flat_model_output(lp, valid), "entropy": flat_model_output(ent, valid)}

    @mini_batch.wrap_train_batch
    def train_batch(self, data):
        self.seen.append(data["response_mask"].clone())


def _config(stats_from="current"):
    cfg = compose(["method=stapo", "model=qwen3_1_7b", f"actor_rollout_ref.actor.policy_loss.stats_from={stats_from}",
                   "actor_rollout_ref.actor.policy_loss.current_forward=full"])  # Worker answers for every row
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_two_workers_in_one_process_keep_their_own_first_mini_batch():
    """An actor (3 mini-batches per step) and a second model worker (2 per step) interleaved in one
    process: the second worker's last-mini-batch flag must not make the actor's third mini-batch look
    like a step's first. The actor forwards the current policy on mini-batches 2 and 3 of every step
    and folds their mask from those statistics; the first uses the rollout statistics."""
    config = _config()
    mask, old, adv, entropy, moved = _batch(seed=3)
    actor, other = Worker(config, moved), Worker(config, moved)
    order = [(actor, False), (other, False), (actor, False), (other, True), (actor, True)] * 2
    for worker, last in order:
        data = micro_batch(mask, old, adv, entropy=entropy)
        tu.assign_non_tensor(data, update_lr_scheduler=last)
        worker.train_batch(data)
    assert actor.forwards == [1, 2, 4, 5]  # mini-batches 2 and 3 of each of the two steps
    assert other.forwards == [1, 3]
    rollout_keep = mask * s2t_mask(old, entropy, adv, mask).keep
    current_keep = mask * s2t_mask(*moved, adv, mask).keep
    assert not torch.equal(rollout_keep, current_keep)
    for i, seen in enumerate(actor.seen):
        want = rollout_keep if i % 3 == 0 else current_keep
        torch.testing.assert_close(seen.float(), want, rtol=0, atol=0)
    assert getattr(actor, COUNTER_ATTR) is not getattr(other, COUNTER_ATTR)


def test_the_token_dump_gets_the_same_position(monkeypatch):
    """What the S2T statistics are given, the token dump is given too: one position per mini-batch."""
    from verl_patches.token_dump import hook, settings

    got = []
    monkeypatch.setattr(hook, "dumps", lambda worker, position: got.append((worker, position)) and False)
    monkeypatch.setenv(settings.DIR_ENV, "unused")
    config = _config("rollout")
    mask, old, adv, entropy, moved = _batch(seed=4)
    a, b = Worker(config, moved), Worker(config, moved)
    for worker, last in [(a, False), (b, True), (a, True), (b, True)]:
        data = micro_batch(mask, old, adv, entropy=entropy)
        tu.assign_non_tensor(data, update_lr_scheduler=last)
        worker.train_batch(data)
    assert got == [(a, MiniBatchPosition(1, 0, last=False)), (b, MiniBatchPosition(1, 0, last=True)),
                   (a, MiniBatchPosition(1, 1, last=True)), (b, MiniBatchPosition(2, 0, last=True))]
