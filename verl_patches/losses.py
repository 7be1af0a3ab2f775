"""The one wrapper of verl's ``ppo_loss``: token selection inside the loss, and what a selection
needs of verl's losses.

verl's ``ppo_loss`` hands the policy loss only a few tensors and the actor config, so
:func:`wrap_ppo_loss` does around it what a selection needs of the micro-batch: a selection inside
the loss, a sequence-level ratio over every response token, ``geo_mean``'s mean over the sequences
that keep a token, and a count of 1 for a mini-batch whose every token was silenced (0, not NaN).
Every loss mode without token selection runs through it bit for bit (tested).
"""

from __future__ import annotations

import functools

import torch

from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils import losses as verl_losses
from verl.workers.utils.padding import no_padding_2_padding

from stapo_core.rules import RANK_MICRO_BATCH

from .layout import ROLLOUT_ENTROPY_FIELD, UNSELECTED_MASK_FIELD, add_per_row, multiply_like, padded_float, to_padded
from .policy_loss_config import KEY_PREFIX, TokenSelectionLossConfig
from .selection_pool import pool_group
from .token_selection import rollout_agreement, select_tokens

#: aggregation modes whose denominator counts sequences (verl's ``global_batch_size``)
SEQ_MEAN_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def wrap_ppo_loss(ppo_loss):
    """verl's ``ppo_loss`` with the recipe's token selection (see the module docstring)."""

    @functools.wraps(ppo_loss)
    def ppo_loss_with_token_selection(config, model_output, data, dp_group=None):
        for key in ("batch_num_tokens", "global_batch_size"):
            if tu.get_non_tensor_data(data=data, key=key, default=None) == 0:
                tu.assign_non_tensor(data, **{key: 1})
        cfg = getattr(config, "policy_loss", None)
        if not (isinstance(cfg, TokenSelectionLossConfig) and cfg.selects_tokens):
            return ppo_loss(config, model_output, data, dp_group=dp_group)
        scale, metrics = None, {}
        unselected = data.get(UNSELECTED_MASK_FIELD, None)  # kept by the mini-batch fold when needed
        if cfg.selects_in_loss:
            unselected = data["response_mask"]
            scale, metrics = _select_in_micro_batch(cfg, config, model_output, data, dp_group)
        if cfg.sequence_ratio_over_all_tokens:
            model_output = _sequence_ratio_over_all_tokens(cfg.loss_mode, model_output, data, unselected)
        elif cfg.loss_mode == "geo_mean":
            _geo_mean_over_kept_sequences(data)
        loss, verl_metrics = ppo_loss(config, model_output, data, dp_group=dp_group)
        if metrics:
            verl_metrics.update(Metric.from_dict(metrics, aggregation=AggregationType.MEAN))
        return (loss if scale is None else loss * scale), verl_metrics

    return ppo_loss_with_token_selection


#: every policy loss verl 0.9.1 registers: whether its ratio is one number per token or per sequence, and
#: what token selection does to each: docs/method.md, "Token selection under every verl loss"
RATIO_LEVEL = {
    "vanilla": "token",
    "dppo_tv": "token",
    "dppo_kl": "token",
    "gpg": "token",
    "dro": "token",
    "cispo": "token",
    "sapo": "token",
    "clip_cov": "token",
    "kl_cov": "token",
    "bypass_mode": "token",
    "gspo": "sequence",
    "geo_mean": "sequence",
}

#: the wrap of verl's own ``ppo_loss`` (what the patched actor calls)
ppo_loss_with_token_selection = wrap_ppo_loss(verl_losses.ppo_loss)


def _select_in_micro_batch(cfg: TokenSelectionLossConfig, config, model_output, data, group):
    """Fold this micro-batch's keep mask into ``data["response_mask"]``, from the update's own
    statistics in ``model_output`` (``stats_from=current``) or the rollout ones in ``data``.

    With ``scope=micro_batch`` the selection pools the current micro-batch of every rank of ``group``
    (or of this rank's group of ``ranks_per_pool``, :mod:`verl_patches.selection_pool`); verl normalises by
    the mini-batch's token (sequence) count taken before the selection, so the loss is re-weighted by
    ``tokens / kept`` (``sequences / kept sequences`` for seq-mean modes) of the pool: each micro-batch
    contributes the mean over its remaining tokens times its share of the mini-batch (the mini-batch mean
    with one micro-batch per mini-batch). A rule of scope :data:`~stapo_core.rules.RANK_MICRO_BATCH`
    selects on this rank's micro-batch alone and re-weights each micro-batch's mean over its kept tokens
    by its share of the mini-batch's sequences, as its authors' code (docs/method.md).

    Returns:
        ``(scale, metrics)``: the factor verl's loss is multiplied by, and the selection's metrics.
    """
    loss_agg_mode = config.loss_agg_mode
    per_rank = cfg.resolved_scope == RANK_MICRO_BATCH
    if not per_rank:  # every rank's micro-batch, or its group of ranks_per_pool ranks
        group = pool_group(cfg, group)
    else:  # this rank's micro-batch alone, weighted as the authors' verl fork did
        group = None
        if loss_agg_mode != "token-mean" or config.use_kl_loss or config.entropy_coeff:
            raise ValueError(
                f"{KEY_PREFIX}.token_selection={cfg.token_selection} selects on each rank's micro-batch with the "
                f"weights of its authors' token-mean loss without KL loss or entropy bonus; got loss_agg_mode="
                f"{loss_agg_mode}, use_kl_loss={config.use_kl_loss}, entropy_coeff={config.entropy_coeff}: use a "
                "rule pooled over the ranks for other settings"
            )
    response_mask = data["response_mask"]
    width = to_padded(response_mask).shape[1]
    mask, advantages, old_log_prob = (padded_float(data[k], width) for k in ("response_mask", "advantages", "old_log_probs"))
    rollout_entropy = padded_float(data[ROLLOUT_ENTROPY_FIELD], width) if ROLLOUT_ENTROPY_FIELD in data.keys() else None
    if cfg.statistics_source == "current":
        entropy = model_output.get("entropy", None)
        if entropy is None:
            raise RuntimeError(
                f"token selection from the update's own statistics ({KEY_PREFIX}.token_selection="
                f"{cfg.token_selection}, scope {cfg.resolved_scope}) needs the update's entropy: set "
                "actor_rollout_ref.actor.calculate_entropy=true (the recipe's driver does)"
            )
        log_prob = no_padding_2_padding(model_output["log_probs"], data).detach().float()[:, :width]
        entropy = no_padding_2_padding(entropy, data).detach().float()[:, :width]
    else:
        if rollout_entropy is None:
            raise RuntimeError(f"stats_from=rollout needs the rollout entropy field {ROLLOUT_ENTROPY_FIELD!r} in the batch")
        log_prob, entropy = old_log_prob, rollout_entropy
    selection = select_tokens(cfg, log_prob=log_prob, entropy=entropy, advantages=advantages,
                              response_mask=mask, group=group)
    metrics = dict(selection.stats)
    if cfg.statistics_source == "current" and rollout_entropy is not None:
        metrics.update(rollout_agreement(cfg, selection, log_prob=old_log_prob, entropy=rollout_entropy,
                                         advantages=advantages, response_mask=mask, group=group))
    data["response_mask"] = multiply_like(response_mask, selection.keep.to(mask.device))
    if per_rank:
        # verl's token-mean is sum / batch_num_tokens * dp_size and FSDP averages over the dp_size ranks; the
        # authors' code weights each micro-batch's mean over its selected tokens by its share of the sequences
        batch_num_tokens = tu.get_non_tensor_data(data=data, key="batch_num_tokens", default=None)
        sequences = tu.get_non_tensor_data(data=data, key="global_batch_size", default=None)
        return batch_num_tokens * mask.shape[0] / (sequences * max(selection.kept, 1.0)), metrics
    if loss_agg_mode in SEQ_MEAN_MODES:
        counts = torch.stack([(mask.sum(-1) > 0).sum(), ((mask * selection.keep).sum(-1) > 0).sum()]).double()
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        total, kept = counts.tolist()
    elif loss_agg_mode == "token-mean":
        total, kept = selection.tokens, selection.kept
    else:  # token-sum: no denominator to correct
        total, kept = 1.0, 1.0
    return total / max(kept, 1.0), metrics


def _geo_mean_over_kept_sequences(data) -> None:
    """verl's ``geo_mean`` averages its per-sequence losses over every row of the micro-batch
    (``torch.mean``, whatever ``loss_agg_mode``), so a sequence whose every token was silenced (ratio
    1, advantage 0, loss 0) would still count in the mean and shrink the others' weight. Scaling the
    micro-batch's advantages by ``rows / rows that keep a token`` makes the loss the mean over the
    sequences that keep a token: geo_mean uses the advantages only linearly and through their sign."""
    mask = padded_float(data["response_mask"], to_padded(data["response_mask"]).shape[1])
    rows, kept = mask.shape[0], int((mask.sum(-1) > 0).sum())
    if 0 < kept < rows:
        data["advantages"] = multiply_like(data["advantages"], torch.full_like(mask, rows / kept))


def _sequence_ratio_over_all_tokens(loss_mode: str, model_output, data, unselected):
    """``sequence_ratio=all_tokens``: make verl's sequence-level ratio cover every response token
    (``unselected``: the response mask before the selection) while the silenced tokens carry no
    gradient. Returns the model output to hand verl's loss (``data`` is changed in place).

    * ``gspo``: its ratio ``exp(mean log r)`` enters the loss only as a per-sequence constant (its
      gradient flows through each token's own log-prob), so the old log-probs of each sequence are
      shifted by ``mean_kept(log r) - mean_all(log r)``: verl's mean over the kept tokens then equals
      the mean over all of them, and aggregation and gradient stay over the kept tokens.
    * ``geo_mean``: the geometric mean of the clipped token ratios is differentiated through every
      token it covers, so verl runs over the unselected mask with the silenced tokens' log-probs
      detached.
    """
    if unselected is None:
        raise RuntimeError(f"sequence_ratio=all_tokens needs the unselected mask {UNSELECTED_MASK_FIELD!r} in the batch")
    width = to_padded(unselected).shape[1]
    full, kept = padded_float(unselected, width), padded_float(data["response_mask"], width)
    if loss_mode == "gspo":
        log_ratio = (no_padding_2_padding(model_output["log_probs"], data).detach()[:, :width]
                     - to_padded(data["old_log_probs"], width)[:, :width]).double()
        mean_kept = (log_ratio * kept).sum(-1) / kept.sum(-1).clamp(min=1)
        mean_all = (log_ratio * full).sum(-1) / full.sum(-1).clamp(min=1)
        data["old_log_probs"] = add_per_row(data["old_log_probs"], mean_kept - mean_all)
        return model_output
    silenced = (full - kept) > 0
    log_probs = model_output["log_probs"]
    values = log_probs.values() if log_probs.is_nested else log_probs
    flat = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    for i, (start, length) in enumerate(_response_positions(data)):
        flat[start:start + length] = silenced[i, :length].to(values.device)
    values = torch.where(flat, values.detach(), values)
    if log_probs.is_nested:
        values = torch.nested.nested_tensor_from_jagged(values, log_probs.offsets())
    data["response_mask"] = unselected
    return {**dict(model_output.items()), "log_probs": values}


def _response_positions(data) -> list[tuple[int, int]]:
    """``(start, length)`` of each sequence's response log-probs in a flat model output over every
    sequence's prompt and response (the slice verl's ``no_padding_2_padding`` takes)."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
    else:
        attention_mask = data["attention_mask"]
        prompt_lens = attention_mask[:, : prompts.shape[1]].sum(dim=1)
        response_lens = attention_mask[:, prompts.shape[1]:].sum(dim=1)
    ends = (prompt_lens + response_lens).cumsum(0).tolist()
    return [(end - n - 1, n) for end, n in zip(ends, response_lens.tolist())]
