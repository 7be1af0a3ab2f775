"""The process group the run's token selection pools over (``policy_loss.ranks_per_pool``).

By default a rule's statistic (20-Entropy's top-k threshold) is pooled over every data-parallel rank:
the whole PPO mini-batch, or each micro-batch of every rank (``scope=micro_batch``). With
``ranks_per_pool=k`` the data-parallel ranks form groups of ``k`` contiguous ranks
(:func:`stapo_core.distributed.contiguous_subgroups`), and each group computes its own threshold over
its own tokens: the pool of 20-Entropy's authors, one sequence-parallel group of 8 GPUs, at any number
of nodes (docs/method.md).

The groups are made once per worker process, on every rank in the same order, when the actor is built
(:func:`wrap_init_model`, installed by :mod:`verl_patches.install`); :func:`pool_group` then finds them
(the mini-batch fold and the loss ask it). Only the run's own selection pools per group: verl's token and
sequence counts, the S2T monitor (the paper's mini-batch pool) and every other collective of the recipe
stay over the whole data-parallel group.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from stapo_core.distributed import contiguous_subgroups, split_contiguous

from .policy_loss_config import TokenSelectionLossConfig, policy_loss_of

#: ``(global ranks of a data-parallel group, ranks_per_pool)`` -> this process's pool group
_POOLS: dict[tuple[tuple[int, ...], int], object] = {}


def pool_group(cfg, dp_group):
    """The group the selection of ``cfg`` pools over on this rank: ``dp_group`` (every data-parallel rank)
    unless ``cfg.ranks_per_pool`` is set, then this rank's group of that many contiguous ranks of
    ``dp_group`` (None: this rank alone, for 1).

    The first call for a ``(dp_group, ranks_per_pool)`` creates the groups and is collective over every rank
    of the world (:func:`stapo_core.distributed.contiguous_subgroups`); in a run it is the worker's
    :func:`wrap_init_model`, so no rank creates a group during training. ``ValueError`` naming the key
    when ``ranks_per_pool`` does not divide the data-parallel size
    (:meth:`~verl_patches.policy_loss_config.TokenSelectionLossConfig.pool_ranks`).
    """
    if getattr(cfg, "ranks_per_pool", None) is None or dp_group is None:
        return dp_group
    members = tuple(dist.get_process_group_ranks(dp_group))
    k = cfg.pool_ranks(len(members))
    key = (members, k)
    if key not in _POOLS:
        _POOLS[key] = contiguous_subgroups(dp_group, k)
    return _POOLS[key]


def wrap_init_model(init_model):
    """``ActorRolloutRefWorker.init_model`` that, once the actor is built, makes its selection's pool groups
    (``ranks_per_pool`` set): every rank of the actor's worker group runs ``init_model`` together, so
    every rank creates every group in one order."""

    @functools.wraps(init_model)  # keeps verl's dispatch attributes
    def wrapped(self, *args, **kwargs):
        result = init_model(self, *args, **kwargs)
        cfg = policy_loss_of(getattr(self, "actor", None))  # the ActorRolloutRefWorker's actor
        if isinstance(cfg, TokenSelectionLossConfig) and cfg.ranks_per_pool is not None and dist.is_initialized():
            dp_group = self.actor.engine.get_data_parallel_group()
            pool_group(cfg, dp_group)
            if dist.get_rank() == 0:
                pools = split_contiguous(dist.get_process_group_ranks(dp_group), cfg.ranks_per_pool)
                print(f"[stapo] token selection pools over {len(pools)} group(s) of {cfg.ranks_per_pool} data-parallel "
                      f"rank(s), a threshold each (ranks_per_pool={cfg.ranks_per_pool}): {pools}", flush=True)
        return result

    return wrapped
