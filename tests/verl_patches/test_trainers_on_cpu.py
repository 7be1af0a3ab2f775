"""What the recipe adds to verl's trainers on the driver side (verl_patches/trainers.py): the per-step
count of responses the reward could not check (``reward/ungraded``), through verl's own functions as
the patch table wraps them, on built batches. The same count in real runs of both trainers:
tests/e2e/test_ungraded_e2e_on_cpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

import verl_patches.activate  # noqa: F401  (the patch table, as in every verl process of a run)
from verl import DataProto
from verl.trainer.ppo import ray_trainer
from verl.trainer.ppo.v1 import trainer_base
from verl.utils import tensordict_utils as tu
from verl_patches import trainers
from verl_patches.registry import MARKER, original_of
from verl_patches.trainers import UNGRADED_METRIC, extra_info_values, ungraded_metrics

N, P, R = 8, 3, 5


def legacy_batch(**non_tensor) -> DataProto:
    """A step's batch as the legacy trainer hands it to ``compute_data_metrics``, the reward's extra info
    in its non-tensor fields."""
    g = torch.Generator().manual_seed(0)
    response_mask = (torch.arange(R)[None, :] < torch.randint(1, R + 1, (N,), generator=g)[:, None]).long()
    scores = torch.zeros(N, R)
    scores[:, 0] = torch.where(torch.rand(N, generator=g) > 0.5, 1.0, -1.0)
    tensors = {"token_level_scores": scores, "token_level_rewards": scores, "advantages": torch.randn(N, R, generator=g),
               "returns": torch.randn(N, R, generator=g), "prompts": torch.ones(N, P, dtype=torch.long),
               "responses": torch.ones(N, R, dtype=torch.long), "response_mask": response_mask,
               "attention_mask": torch.cat([torch.ones(N, P, dtype=torch.long), response_mask], dim=1)}
    return DataProto(batch=TensorDict(tensors, batch_size=[N]),
                     non_tensor_batch={k: np.array(v, dtype=object) for k, v in non_tensor.items()})


def test_the_legacy_trainers_data_metrics_count_the_ungraded_responses():
    assert getattr(ray_trainer.compute_data_metrics, MARKER) == "legacy_ungraded_count"
    ungraded = [i % 2 == 1 for i in range(N)]  # every other response
    metrics = ray_trainer.compute_data_metrics(batch=legacy_batch(ungraded=ungraded, acc=[False] * N), use_critic=False)
    assert metrics[UNGRADED_METRIC] == 4 and isinstance(metrics[UNGRADED_METRIC], int)
    verl_own = original_of(ray_trainer.compute_data_metrics)(batch=legacy_batch(), use_critic=False)
    assert {k: v for k, v in metrics.items() if k != UNGRADED_METRIC} == pytest.approx(verl_own)
    none = ray_trainer.compute_data_metrics(batch=legacy_batch(ungraded=[False] * N), use_critic=False)
    assert none[UNGRADED_METRIC] == 0  # the reward reports the key: 0 is a count
    assert UNGRADED_METRIC not in ray_trainer.compute_data_metrics(batch=legacy_batch(acc=[True] * N), use_critic=False)


def test_the_count_reads_only_responses_that_report_the_key():
    assert ungraded_metrics([True, False, np.bool_(True), None]) == {UNGRADED_METRIC: 2}
    assert ungraded_metrics([None, None]) == {} and ungraded_metrics([]) == {}
    fields = [{"reward_extra_info": {"ungraded": True, "acc": False}}, {"reward_extra_info": {"acc": True}}, {},
              None, {"reward_extra_info": None}, {"reward_extra_info": {"ungraded": False}}]
    assert extra_info_values(fields, "ungraded") == [True, None, None, None, None, False]


class FakeQueue:
    """TransferQueue's ``kv_batch_get`` over a dict of stored responses, returning fields as the queue
    does (a TensorDict whose ``extra_fields`` is a non-tensor stack of dicts); records each request."""

    def __init__(self, stored: dict):
        self.stored, self.requests = stored, []

    def kv_batch_get(self, *, keys, partition_id, select_fields):
        self.requests.append((list(keys), partition_id, list(select_fields)))
        return tu.get_tensordict({"extra_fields": np.array([self.stored[k] for k in keys], dtype=object)})


def test_the_transferqueue_trainers_step_metrics_count_the_ungraded_responses(monkeypatch):
    assert getattr(trainer_base.PPOTrainer._compute_metrics, MARKER) == "v1_ungraded_count"
    stored = {f"uid{i}_{i % 4}_0": {"reward_extra_info": {"ungraded": i % 2 == 1, "score": -1.0}} for i in range(N)}
    stored["pad"] = {"reward_extra_info": {"ungraded": True}}  # a padding copy: not one of the step's responses
    queue = FakeQueue(stored)
    monkeypatch.setattr(trainers, "tq", queue)
    seen = []
    compute = trainers.wrap_v1_compute_metrics(lambda self, batch, metrics, *a, **k: seen.append(dict(metrics)))
    keys = list(stored)
    batch = KVBatchMeta(partition_id="train", keys=keys, tags=[{"is_padding": k == "pad"} for k in keys])
    metrics = {"critic/score/mean": 0.0}
    compute(object(), batch, metrics, {}, global_steps=3, epoch=0)
    assert seen == [{"critic/score/mean": 0.0}]  # verl's own metrics first
    assert metrics[UNGRADED_METRIC] == 4
    assert queue.requests == [(keys[:-1], "train", ["extra_fields"])]
    # a reward without the key adds nothing
    queue.stored = {k: {"reward_extra_info": {"acc": True}} for k in keys}
    metrics = {}
    compute(object(), batch, metrics, {}, global_steps=4, epoch=0)
    assert UNGRADED_METRIC not in metrics
