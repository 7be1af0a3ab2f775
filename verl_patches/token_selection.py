"""Which response tokens carry policy gradient: S2T (STAPO) and 20-Entropy, on verl's tensors.

The selection is independent of the policy loss: it only shrinks the mask the loss runs over, so
it composes with every loss mode verl registers. Two places call :func:`select_tokens`:

* :func:`fold_into_mini_batch` (``scope=mini_batch``): once per mini-batch, in the actor worker,
  before verl counts the mini-batch's loss tokens. The keep mask is folded into ``response_mask``
  and ``loss_mask``, so verl's own ``batch_num_tokens`` (the token-mean denominator, all-reduced
  over data-parallel ranks) counts only the tokens that remain: the loss is exactly the paper's
  ``sum(M * L) / sum(M)`` over the mini-batch, whatever the micro-batch size or the number of
  ranks. For the seq-mean modes, verl's sequence count is replaced by the count of sequences that
  keep at least one token: a fully silenced sequence drops out instead of contributing 0.
* the loss wrapper (``scope=micro_batch``, :mod:`verl_patches.losses`): once per micro-batch,
  pooled over the data-parallel group's current micro-batches (or, for 20-Entropy's authors' code
  reading, per rank).

With ``stats_from=current`` the fold receives the current policy's statistics as
:class:`CurrentStatistics`: for S2T only the sequences with a positive advantage are forwarded
(:mod:`verl_patches.current_stats`), and the selection runs over their tokens only (no other token
can be a candidate); the other sequences carry no statistic and keep every token.

verl stores per-token fields either padded ``(batch, resp_len)`` (legacy trainer) or as jagged
nested tensors (TransferQueue trainer); both are handled here and written back in their own layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from stapo_core import s2t_mask, entropy_topk_mask

from .config import TokenSelectionLossConfig

#: metric prefixes, after verl adds "actor/": actor/s2t/..., actor/entropy_topk/...
S2T_METRIC_PREFIX = "s2t/"
TOPK_METRIC_PREFIX = "entropy_topk/"

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
class Selection:
    """keep: float32 ``(batch, resp_len)``, 1 where the token carries gradient (0 outside the
    response mask); tokens / kept: global counts over the pooled group; metrics: python floats
    named ``s2t/*`` or ``entropy_topk/*``, undefined (NaN) statistics omitted; candidate: S2T's
    candidate set (bool, like ``keep``), None for ``entropy_topk``."""

    keep: torch.Tensor
    tokens: float
    kept: float
    metrics: dict
    candidate: Optional[torch.Tensor] = None


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
) -> Selection:
    """The tokens ``cfg.token_selection`` keeps: S2T (``s2t``) or the top-entropy rank (``entropy_topk``).

    Args:
        log_prob, entropy, advantages, response_mask: ``(batch, resp_len)`` padded tensors.
        group: data-parallel process group to pool the statistic over (None: this process only).
    """
    if cfg.token_selection == "s2t":
        rank = torch.distributed.get_rank(group) if group is not None else 0
        generator = _generator(cfg.seed * 1_000_003 + rank, log_prob.device) if cfg.strategy == "random" else None
        result = s2t_mask(
            log_prob,
            entropy,
            advantages,
            response_mask,
            tau_p=cfg.tau_p,
            q=cfg.q,
            strategy=cfg.strategy,
            generator=generator,
            group=group,
        )
        metrics = {S2T_METRIC_PREFIX + k: float(v) for k, v in result.stats.items() if not math.isnan(float(v))}
        tokens = float(result.stats["tokens"])
        return Selection(result.keep, tokens, tokens - float(result.stats["silenced"]), metrics, result.candidate)
    if cfg.token_selection == "entropy_topk":
        keep = entropy_topk_mask(entropy, response_mask, ratio=cfg.entropy_top_ratio, group=group,
                                 rounding="authors_code" if cfg.authors_code_reading else "ceil")
        counts = torch.stack([response_mask.float().sum(), keep.sum()])
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        tokens, kept = counts.tolist()
        metrics = {
            TOPK_METRIC_PREFIX + "tokens": tokens,
            TOPK_METRIC_PREFIX + "kept": kept,
            TOPK_METRIC_PREFIX + "kept_frac": kept / max(tokens, 1.0),
        }
        return Selection(keep, tokens, kept, metrics)
    raise ValueError(f"select_tokens: token_selection {cfg.token_selection!r} selects no tokens")


def widen_selection(selection: Selection, response_mask: torch.Tensor, group=None) -> Selection:
    """An S2T selection computed over part of the response tokens (the forwarded sequences), made the
    selection over all of ``response_mask``: every other token is kept, and the token counts
    (``s2t/tokens``, ``s2t/silenced_frac``) cover every response token of the pooled group."""
    mask = response_mask.float()
    silenced = selection.candidate.float() * (1.0 - selection.keep)  # candidates lie inside the part
    count = mask.sum().double()
    if group is not None:
        torch.distributed.all_reduce(count, group=group)
    tokens = float(count.item())
    silenced_count = selection.tokens - selection.kept
    metrics = dict(selection.metrics)
    metrics[S2T_METRIC_PREFIX + "tokens"] = tokens
    metrics[S2T_METRIC_PREFIX + "silenced_frac"] = silenced_count / max(tokens, 1.0)
    return Selection(mask * (1.0 - silenced), tokens, tokens - silenced_count, metrics, selection.candidate)


# --------------------------------------------------------------------------------------------
# padded <-> nested layouts
# --------------------------------------------------------------------------------------------


def check_statistics_fields(data, current, who: str) -> None:
    """Raise a ``KeyError`` naming ``who`` and the fields S2T's selection needs that the mini-batch
    ``data`` lacks: the mask and advantages, and the rollout statistics unless ``current`` ones are given."""
    needed = ["response_mask", "advantages"] + ([] if current is not None else ["old_log_probs", ROLLOUT_ENTROPY_FIELD])
    missing = [k for k in needed if k not in data]
    if missing:
        raise KeyError(
            f"{who} needs the fields {missing} in the actor's mini-batch; the rollout entropy is kept by the "
            "recipe's trainer patches: is VERL_USE_EXTERNAL_MODULES=verl_patches set in the driver?"
        )


def to_padded(t: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
    """``(batch, resp_len)`` view of a padded tensor or a jagged nested tensor (zero padding)."""
    if not t.is_nested:
        return t
    padded = t.to_padded_tensor(0.0)
    if width is not None and padded.shape[1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[1]))
    return padded


def multiply_like(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``mask * keep`` in ``mask``'s layout (padded or jagged nested) and dtype."""
    if not mask.is_nested:
        return (mask.to(keep.dtype) * keep[:, : mask.shape[1]]).to(mask.dtype)
    offsets = mask.offsets()
    lengths = offsets.diff().tolist()
    values = torch.cat([keep[i, :n] for i, n in enumerate(lengths)]) if lengths else keep.new_zeros(0)
    new_values = (mask.values().to(keep.dtype) * values).to(mask.dtype)
    return torch.nested.nested_tensor_from_jagged(new_values, offsets)


def add_per_row(t: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """``t + per_row[i]`` on every entry of row ``i``, in ``t``'s layout (padded or jagged nested) and dtype."""
    if not t.is_nested:
        return (t + per_row.to(t.device, t.dtype)[:, None]).to(t.dtype)
    lengths = t.offsets().diff()
    shift = torch.repeat_interleave(per_row.to(t.values().device, t.dtype), lengths.to(t.values().device))
    return torch.nested.nested_tensor_from_jagged(t.values() + shift, t.offsets())


# --------------------------------------------------------------------------------------------
# mini-batch scope (called by the actor worker, once per mini-batch)
# --------------------------------------------------------------------------------------------


def fold_into_mini_batch(cfg: TokenSelectionLossConfig, data, group=None, device=None, current=None) -> dict[str, float]:
    """Silence tokens of one mini-batch in place, before verl counts its loss tokens.

    ``data`` is the mini-batch TensorDict one data-parallel rank holds; ``group`` the data-parallel
    group (the mini-batch is the union of every rank's part). The statistics are ``current``, the
    policy being updated (:class:`CurrentStatistics`, or a ``(log_prob, entropy)`` pair covering
    every row, padded ``(batch, resp_len)``), when given, else the rollout-time ones:
    ``old_log_probs`` and the ``entropy`` field kept by :mod:`verl_patches.trainers`. With
    ``current`` covering only some rows (S2T: those with a positive advantage), the selection runs
    over their tokens and every other token is kept. Multiplies ``response_mask`` and ``loss_mask``
    by the keep mask, sets verl's ``global_batch_size`` to the sequences that keep a token (seq-mean
    modes), keeps the unselected mask for ``sequence_ratio=all_tokens``, and returns the metrics.
    ``device``: where to compute (the engine's device: collectives over verl's data-parallel group
    may only accept device tensors, as verl's own ``batch_num_tokens`` all-reduce assumes); the
    mini-batch itself stays where it is.
    """
    check_statistics_fields(data, current, "token selection (scope=mini_batch)")
    response_mask = data["response_mask"]
    width = to_padded(response_mask).shape[1]

    def field(name: str) -> torch.Tensor:
        return to_padded(data[name], width).to(device).float()

    mask = field("response_mask")
    current = _as_current(current, mask.shape[0])
    selection_mask = mask
    if current is None:
        log_prob, entropy = field("old_log_probs"), field(ROLLOUT_ENTROPY_FIELD)
    else:
        log_prob, entropy = (to_padded(t, width)[:, :width].to(device).float() for t in (current.log_prob, current.entropy))
        partial = not bool(current.forwarded.all())
        if partial and cfg.token_selection != "s2t":
            raise ValueError(f"token_selection={cfg.token_selection} needs the statistics of every sequence")
        selection_mask = mask * current.forwarded.to(mask.device, torch.float32)[:, None]
    selection = select_tokens(
        cfg, log_prob=log_prob, entropy=entropy, advantages=field("advantages"), response_mask=selection_mask,
        group=group,
    )
    if current is not None and cfg.token_selection == "s2t":
        # the same counts everywhere, whether this rank forwarded every row or not
        selection = widen_selection(selection, mask, group)
    metrics = dict(selection.metrics)
    if current is not None:
        metrics.update(current.metrics)
    if current is not None and "old_log_probs" in data and ROLLOUT_ENTROPY_FIELD in data:
        rollout = select_tokens(cfg, log_prob=field("old_log_probs"), entropy=field(ROLLOUT_ENTROPY_FIELD),
                                advantages=field("advantages"), response_mask=mask, group=group)
        metrics.update(rollout_agreement(cfg, selection.keep, rollout.keep, mask, group))
    if SUM_PI_SQUARED_FIELD in data and cfg.token_selection == "s2t" and current is None:
        metrics.update(
            grad_norm_metrics(
                log_prob=log_prob,
                sum_pi_squared=field(SUM_PI_SQUARED_FIELD),
                response_mask=mask,
                keep=selection.keep,
                candidate=selection.candidate,
                group=group,
            )
        )
    if cfg.sequence_ratio_over_all_tokens:
        data[UNSELECTED_MASK_FIELD] = response_mask.clone()
    keep = selection.keep.to(response_mask.device)
    data["response_mask"] = multiply_like(response_mask, keep)
    if "loss_mask" in data:
        data["loss_mask"] = multiply_like(data["loss_mask"], keep)
    _count_remaining_sequences(data, mask * selection.keep, group)
    return metrics


def _count_remaining_sequences(data, kept: torch.Tensor, group) -> None:
    """Set verl's ``global_batch_size`` (the seq-mean denominator) to the number of sequences of the
    mini-batch, over every rank, that keep at least one token."""
    from verl.utils import tensordict_utils as tu

    if tu.get(data, "global_batch_size", None) is None:
        return
    count = (kept.sum(-1) > 0).sum().double()
    if group is not None:
        torch.distributed.all_reduce(count, group=group)
    tu.assign_non_tensor(data, global_batch_size=max(int(count.item()), 1))


def rollout_agreement(cfg, keep_current: torch.Tensor, keep_rollout: torch.Tensor, response_mask: torch.Tensor,
                      group=None) -> dict[str, float]:
    """How far current-policy statistics drift from rollout ones (diagnostic).

    ``s2t/rollout_agreement`` (``entropy_topk/rollout_agreement``): |A & B| / |A | B| of the tokens
    dropped with current statistics (A) and with rollout statistics (B), pooled over ``group``;
    1.0 when both drop nothing.
    """
    dropped_now, dropped_rollout = response_mask * (1 - keep_current), response_mask * (1 - keep_rollout)
    counts = torch.stack([(dropped_now * dropped_rollout).sum(), torch.maximum(dropped_now, dropped_rollout).sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    both, either = counts.tolist()
    prefix = S2T_METRIC_PREFIX if cfg.token_selection == "s2t" else TOPK_METRIC_PREFIX
    return {prefix + "rollout_agreement": 1.0 if either == 0 else both / either}


def grad_norm_metrics(*, log_prob, sum_pi_squared, response_mask, keep, candidate=None, group=None) -> dict[str, float]:
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
    return {S2T_METRIC_PREFIX + "grad_norm_" + name: total / count
            for name, total, count in zip(sets, values[0::2], values[1::2]) if count > 0}
