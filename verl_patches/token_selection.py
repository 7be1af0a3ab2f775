"""Which response tokens carry policy gradient, on verl's padded tensors: the rule table's entry
(:data:`stapo_core.rules.RULES`) named by ``token_selection``, pooled over the data-parallel group.

The selection is independent of the policy loss: it only shrinks the mask the loss runs over, so it
composes with every loss mode verl registers. Two places select:

* once per PPO mini-batch, before verl counts its loss tokens (``scope=mini_batch``):
  :mod:`verl_patches.mini_batch_selection`;
* once per micro-batch, inside the loss (``scope=micro_batch``): :mod:`verl_patches.losses`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from stapo_core.rules import RuleResult, finite_stats, get_rule

from .policy_loss_config import TokenSelectionLossConfig

#: the batch field that carries the rollout-time (old-policy) entropy to the actor (verl's own name
#: in the TransferQueue trainer; the legacy trainer's copy gets the same name)
ROLLOUT_ENTROPY_FIELD = "entropy"
#: aggregation modes whose denominator counts sequences (verl's ``global_batch_size``)
SEQ_MEAN_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
#: verl's field of sum_n pi_n^2 per token (rollout time, with actor.calculate_sum_pi_squared=true)
SUM_PI_SQUARED_FIELD = "sum_pi_squared"
#: the recipe's field holding the response mask before the fold, for losses whose sequence-level ratio
#: is taken over every response token (``sequence_ratio=all_tokens``)
UNSELECTED_MASK_FIELD = "stapo_unselected_response_mask"

_generators: dict[tuple[int, str], torch.Generator] = {}


def _generator(seed: int, device: torch.device) -> torch.Generator:
    """One generator per seed, device and process, created on first use (``random`` strategy
    only); on the data's device, so the draw needs no host copy."""
    key = (seed, str(device))
    if key not in _generators:
        _generators[key] = torch.Generator(device=device).manual_seed(seed)
    return _generators[key]


@dataclass(frozen=True)
class CurrentStatistics:
    """The current policy's statistics of one mini-batch on this rank.

    log_prob, entropy: float32 ``(batch, resp_len)`` padded as verl's loss sees them; NaN on the rows
    not forwarded. forwarded: bool ``(batch,)``, the rows whose statistics were computed.
    metrics: the forward's own metrics (``*/current_forward_*``)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor
    forwarded: torch.Tensor
    metrics: dict


def _as_current(current, batch: int) -> Optional[CurrentStatistics]:
    """``current`` as :class:`CurrentStatistics` (a ``(log_prob, entropy)`` pair covers every row)."""
    if current is None or isinstance(current, CurrentStatistics):
        return current
    log_prob, entropy = current
    return CurrentStatistics(log_prob, entropy, torch.ones(batch, dtype=torch.bool), {})


def select_tokens(
    cfg: TokenSelectionLossConfig,
    *,
    log_prob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group=None,
) -> RuleResult:
    """The tokens ``cfg.token_selection``'s rule (:data:`stapo_core.rules.RULES`) keeps, its
    ``stats`` named as metrics (``<rule's metric prefix><stat>``, the undefined ones left out).

    Args:
        log_prob, entropy, advantages, response_mask: ``(batch, resp_len)`` padded tensors.
        group: data-parallel process group to pool the statistic over (None: this process only).
    """
    rule = get_rule(cfg.token_selection)

    def generator() -> torch.Generator:  # one per seed and rank: ranks draw differently
        rank = torch.distributed.get_rank(group) if group is not None else 0
        return _generator(cfg.seed * 1_000_003 + rank, log_prob.device)

    result = rule.select(cfg, log_prob=log_prob, entropy=entropy, advantages=advantages, response_mask=response_mask,
                         group=group, generator=generator)
    return dataclasses.replace(result, stats=finite_stats(rule.metric_prefix, result.stats))


def widen_selection(cfg: TokenSelectionLossConfig, selection: RuleResult, part: torch.Tensor,
                    response_mask: torch.Tensor, group=None) -> RuleResult:
    """A selection computed over ``part`` of the response tokens (the forwarded sequences of a rule
    whose ``positive_advantage_only`` holds), made the selection over all of ``response_mask``:
    every other token is kept, and the token counts (``<prefix>tokens``, ``<prefix>silenced_frac``)
    cover every response token of the pooled group."""
    prefix = get_rule(cfg.token_selection).metric_prefix
    mask = response_mask.float()
    silenced = part.float() * (1.0 - selection.keep)
    count = mask.sum().double()
    if group is not None:
        torch.distributed.all_reduce(count, group=group)
    tokens = float(count.item())
    silenced_count = selection.tokens - selection.kept
    metrics = dict(selection.stats)
    metrics[prefix + "tokens"] = tokens
    metrics[prefix + "silenced_frac"] = silenced_count / max(tokens, 1.0)
    return RuleResult(mask * (1.0 - silenced), tokens, tokens - silenced_count, metrics, selection.candidate)


def check_statistics_fields(data, current, who: str) -> None:
    """Raise a ``KeyError`` naming ``who`` and the fields S2T's selection needs that the mini-batch
    ``data`` lacks: the mask and advantages, and the rollout statistics unless ``current`` ones are given."""
    needed = ["response_mask", "advantages"] + ([] if current is not None else ["old_log_probs", ROLLOUT_ENTROPY_FIELD])
    missing = [k for k in needed if k not in data]
    if missing:
        raise KeyError(
            f"{who} needs the fields {missing} in the actor's mini-batch; the rollout entropy is kept by the "
            "recipe's trainer patches: is VERL_USE_EXTERNAL_MODULES=verl_patches.activate set in the driver?"
        )


def rollout_agreement(cfg, keep_current: torch.Tensor, keep_rollout: torch.Tensor, response_mask: torch.Tensor,
                      group=None) -> dict[str, float]:
    """How far current-policy statistics drift from rollout ones (diagnostic).

    ``<rule's prefix>rollout_agreement``: |A & B| / |A | B| of the tokens
    dropped with current statistics (A) and with rollout statistics (B), pooled over ``group``;
    1.0 when both drop nothing.
    """
    dropped_now, dropped_rollout = response_mask * (1 - keep_current), response_mask * (1 - keep_rollout)
    counts = torch.stack([(dropped_now * dropped_rollout).sum(), torch.maximum(dropped_now, dropped_rollout).sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    both, either = counts.tolist()
    return {get_rule(cfg.token_selection).metric_prefix + "rollout_agreement": 1.0 if either == 0 else both / either}


def grad_norm_metrics(*, log_prob, sum_pi_squared, response_mask, keep, candidate=None, group=None,
                      prefix: str = "s2t/") -> dict[str, float]:
    """Mean closed-form gradient norm of silenced, of kept, and of kept candidate response tokens
    (docs/method.md, "Why these tokens").

    ``||d log pi_k / d logits|| = sqrt(1 - 2 pi_k + sum_n pi_n^2)`` per unit weight, from the
    rollout-time ``sum_pi_squared`` (verl computes it with ``actor.calculate_sum_pi_squared=true``).
    Returns ``s2t/grad_norm_silenced``, ``s2t/grad_norm_kept`` (every kept token) and, with
    ``candidate`` (S2T's candidate set, bool), ``s2t/grad_norm_kept_candidates`` (the low-probability
    tokens S2T keeps because their entropy is high); pooled over ``group``, a mean over no token
    omitted. The paper reports silenced tokens about 17% above the rest.
    """
    norm = torch.sqrt((1.0 - 2.0 * log_prob.exp() + sum_pi_squared).clamp(min=0.0))
    inside = response_mask.float()
    sets = {"silenced": inside * (1.0 - keep), "kept": inside * keep}
    if candidate is not None:
        sets["kept_candidates"] = sets["kept"] * candidate.float()
    sums = torch.stack([t for w in sets.values() for t in ((norm * w).sum(), w.sum())])
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    values = sums.tolist()
    return {prefix + "grad_norm_" + name: total / count
            for name, total, count in zip(sets, values[0::2], values[1::2]) if count > 0}
