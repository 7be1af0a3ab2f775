"""The process group the run's token selection pools over (``policy_loss.ranks_per_pool``).

20-Entropy's authors took their threshold within one sequence-parallel group of 8 GPUs; with
``ranks_per_pool=k`` the data-parallel ranks form groups of ``k`` contiguous ranks
(:func:`stapo_core.distributed.contiguous_subgroups`), each computing its own threshold over its own
tokens, which is their pool at any node count (docs/method.md). Making a group is collective over the
world, so every rank makes every group once, in one order, when the actor is built
(:func:`wrap_init_model`); :func:`pool_group` then finds them. Only the run's own selection pools per
group: verl's counts, the S2T monitor and every other collective stay over the data-parallel group.
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
