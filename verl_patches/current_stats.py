"""Statistics under the policy being updated: no-grad forwards of the mini-batch's sequences through
verl's own inference pass.

The paper's Algorithm 1 reads ``p`` and ``H`` of the current policy on every mini-batch
(``stats_from=current``), before verl counts the loss tokens, so each mini-batch of a step after the
first gets one forward (:func:`current_policy_statistics`); for S2T only the positive-advantage
sequences need it, spread over the ranks by tokens (docs/method.md). :func:`infer` is the same pass
on a few sequences (the update's probe).
"""

from __future__ import annotations

import functools
import math
import time

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from stapo_core.balance import ForwardPlan, Item, plan_forward
from stapo_core.distributed import exchange_objects, gather_objects, group_rank, world_size
from stapo_core.rules import S2T

from .layout import UNSELECTED_MASK_FIELD, response_lengths
from .mini_batch_view import CurrentStatistics, MiniBatchView
from .policy_loss_config import TokenSelectionLossConfig

#: attribute marking an engine's entropy function as already running without autograd
NO_GRAD_MARK = "_stapo_no_grad"
#: per-token fields of the mini-batch that the statistics forward never reads (not sent between ranks)
NOT_FORWARDED_FIELDS = ("old_log_probs", "ref_log_prob", "advantages", "returns", "values", "entropy",
                        "sum_pi_squared", "rollout_log_probs", "rollout_is_weights", "token_level_scores",
                        "token_level_rewards", UNSELECTED_MASK_FIELD)


def sequence_tokens(data) -> list[int]:
    """Prompt + response tokens of each sequence."""
    ids = data.get("input_ids", None)
    if ids is not None and ids.is_nested:
        return ids.offsets().diff().tolist()
    return data["attention_mask"].sum(-1).tolist()


def micro_batch_limit(engine_config) -> dict:
    """The inference pass's micro-batch limit: its token budget with dynamic batch size, else its
    micro-batch size (``plan_forward``'s ``max_tokens`` / ``max_rows``)."""
    if engine_config.use_dynamic_bsz:
        return {"max_tokens": int(engine_config.infer_max_token_len_per_gpu)}
    micro = engine_config.infer_micro_batch_size_per_gpu
    return {"max_rows": int(micro)} if micro else {}


def current_policy_statistics(worker, view: MiniBatchView) -> CurrentStatistics:
    """The current policy's statistics of this rank's part of the mini-batch, from no-grad forwards
    through ``TrainingWorker.infer_batch`` on copies of the sequences: every sequence, or only the
    positive-advantage ones (:func:`forward_positive_advantage`).

    Args:
        worker: the ``TrainingWorker``. view: the mini-batch (its settings forward the current policy).

    Returns:
        :class:`~verl_patches.mini_batch_view.CurrentStatistics`: float32 ``(batch, width)`` on the
        view's device, with the forward's metrics (``current_forward_s``: this rank's wall time,
        exchanges included).
    """
    cfg = view.cfg
    prefix = forward_metric_prefix(cfg)
    start = time.perf_counter()
    if cfg.forwards_current_policy and cfg.rule.positive_advantage_only and cfg.current_forward == "positive_advantage":
        current = forward_positive_advantage(worker, view, prefix=prefix)
    else:
        log_prob, entropy = (t[:, : view.mask.shape[1]].to(view.device).float()  # padded like the view's fields
                             for t in infer(worker, view.data, entropy=True))
        current = CurrentStatistics(log_prob, entropy, torch.ones(len(view.data), dtype=torch.bool),
                                    {prefix + "current_forward_tokens_frac": 1.0,
                                     prefix + "current_forward_slowest_rank_frac": 1.0})
    current.metrics[prefix + "current_forward_s"] = time.perf_counter() - start
    return current


def forward_metric_prefix(cfg) -> str:
    """Where the statistics forward's metrics go: the prefix of the rule it serves (the run's own,
    or S2T's when it serves only the S2T monitor)."""
    return cfg.rule.metric_prefix if cfg.forwards_current_policy else S2T.metric_prefix


def infer(worker, data, *, entropy: bool) -> list[torch.Tensor]:
    """One no-grad inference pass (``TrainingWorker.infer_batch``) over a shallow copy of ``data``, with
    the pass's own settings (a micro-batch size that divides the batch).

    Args:
        worker: the ``TrainingWorker``. data: verl's TensorDict of the sequences.
        entropy: also compute the entropy.

    Returns:
        ``[log_prob]`` (and ``entropy``): ``(len(data), max response length)``, padded, the pass's dtype.
    """
    batch = data.copy()
    engine_config = worker.engine_config
    micro = engine_config.infer_micro_batch_size_per_gpu or len(data)
    tu.assign_non_tensor(
        batch, calculate_entropy=entropy, compute_loss=False, use_dynamic_bsz=engine_config.use_dynamic_bsz,
        max_token_len_per_gpu=engine_config.infer_max_token_len_per_gpu,
        micro_batch_size_per_gpu=math.gcd(int(micro), len(data)),
    )
    output = _infer(worker, batch)
    return [no_padding_2_padding(output[key], batch) for key in ("log_probs", "entropy")[: 1 + entropy]]


def _infer(worker, batch):
    output = worker.infer_batch(batch)
    if output is None:
        raise RuntimeError(
            "the recipe's no-grad forwards (stats_from=current, update_effect_responses) need the inference pass's "
            "output on every data-parallel rank, but TrainingWorker.infer_batch returned none here (with Ulysses "
            "sequence parallelism only one rank of each group gets it, which the recipe does not support): use "
            "stats_from=rollout and update_effect_responses=0"
        )
    return output


def forward_positive_advantage(worker, view: MiniBatchView, *, prefix=S2T.metric_prefix) -> CurrentStatistics:
    """The current policy's statistics of the positive-advantage sequences of the mini-batch, spread
    over the ranks by tokens (:func:`stapo_core.balance.plan_forward`) and sent back to the rank that
    holds them; NaN on the other rows (never read). Metrics: ``current_forward_tokens_frac`` (tokens
    forwarded, padding included, over the mini-batch's, all ranks) and
    ``current_forward_slowest_rank_frac`` (the most tokens one rank forwards over the most one holds).
    """
    data, group = view.data, view.group
    batch, width = view.mask.shape
    wanted = ((view.advantages > 0) & (view.mask != 0)).any(-1).cpu()
    tokens = sequence_tokens(data)
    rank, world = group_rank(group), world_size(group)
    gathered = gather_objects(([(i, tokens[i]) for i in wanted.nonzero().flatten().tolist()], sum(tokens)), group)
    items = [Item(owner, index, n) for owner, (rows, _) in enumerate(gathered) for index, n in rows]
    plan = plan_forward(items, world, **micro_batch_limit(worker.engine_config))
    log_prob = torch.full((batch, width), math.nan)
    entropy = torch.full((batch, width), math.nan)
    forwarded = torch.zeros(batch, dtype=torch.bool)
    returned = _forward_plan(worker, data, plan, rank, group, view.device) if plan.num_micro_batches else []
    for index, lp, ent in (row for rows in returned for row in rows):
        log_prob[index, : lp.numel()] = lp
        entropy[index, : ent.numel()] = ent
        forwarded[index] = True
    if not torch.equal(forwarded, wanted):
        raise RuntimeError(f"forward_positive_advantage: rows {wanted.nonzero().flatten().tolist()} needed, "
                           f"{forwarded.nonzero().flatten().tolist()} forwarded")
    rank_tokens = plan.rank_tokens()
    held = [total for _, total in gathered]
    metrics = {prefix + "current_forward_tokens_frac": sum(rank_tokens) / max(sum(held), 1),
               prefix + "current_forward_slowest_rank_frac": max(rank_tokens) / max(max(held), 1)}
    return CurrentStatistics(log_prob.to(view.device), entropy.to(view.device), forwarded, metrics)


def _forward_plan(worker, data, plan: ForwardPlan, rank: int, group, device) -> list:
    """Run this rank's micro-batches of ``plan``; returns, from every rank, the ``(row, log_prob,
    entropy)`` of this rank's rows (1-D response tensors)."""
    world = world_size(group)
    sequences = data.exclude(*(k for k in NOT_FORWARDED_FIELDS if k in data.keys()))
    outgoing = []
    for dest in range(world):
        rows = list(dict.fromkeys(it.index for mb in plan.micro_batches[dest] for it in mb if it.owner == rank))
        outgoing.append((rows, tu.index_select_tensor_dict(sequences, rows) if rows else None))
    pools = {}
    for owner, (rows, td) in enumerate(exchange_objects(outgoing, group, device)):
        for position, index in enumerate(rows):
            pools[(owner, index)] = (td, position)
    returns = [[] for _ in range(world)]
    for items, padding in zip(plan.micro_batches[rank], plan.padding[rank]):
        micro = tu.concat_tensordict([tu.index_select_tensor_dict(pools[(it.owner, it.index)][0],
                                                                  [pools[(it.owner, it.index)][1]]) for it in items])
        tu.assign_non_tensor(micro, calculate_entropy=True, compute_loss=False, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=len(micro), global_token_num=sequence_tokens(micro))
        output = _infer(worker, micro)
        if padding:
            continue
        log_prob = no_padding_2_padding(output["log_probs"], micro).float()
        entropy = no_padding_2_padding(output["entropy"], micro).float()
        for j, (it, n) in enumerate(zip(items, response_lengths(micro))):
            returns[it.owner].append((it.index, log_prob[j, :n].detach().cpu().clone(),
                                      entropy[j, :n].detach().cpu().clone()))
    return exchange_objects(returns, group, device)


def statistic_only_entropy(actor_config) -> bool:
    """True when the update's entropy serves only S2T's current statistics (no entropy bonus)."""
    policy_loss = getattr(actor_config, "policy_loss", None)
    return (
        isinstance(policy_loss, TokenSelectionLossConfig)
        and policy_loss.needs_update_entropy
        and actor_config.entropy_coeff == 0
    )


def wrap_set_loss_fn(set_loss_fn):
    """``TrainingWorker.set_loss_fn`` that, when :func:`statistic_only_entropy` holds, computes the
    update's entropy under ``torch.no_grad`` (benchmarks/README.md: 2.6x -> 1.0x peak memory of the
    loss path)."""

    @functools.wraps(set_loss_fn)  # keeps verl's dispatch attributes
    def wrapped(self, loss_fn, *args, **kwargs):
        result = set_loss_fn(self, loss_fn, *args, **kwargs)
        config = getattr(loss_fn, "keywords", {}).get("config")
        if statistic_only_entropy(config):
            engine = self.engine
            if not getattr(engine.compute_entropy_from_logits, NO_GRAD_MARK, False):
                no_grad_entropy = torch.no_grad()(engine.compute_entropy_from_logits)
                setattr(no_grad_entropy, NO_GRAD_MARK, True)
                engine.compute_entropy_from_logits = no_grad_entropy
        return result

    return wrapped
