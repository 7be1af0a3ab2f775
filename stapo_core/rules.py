"""Token-selection rules as a table: one entry per rule, read by every layer that selects tokens.

A rule decides which response tokens of a batch keep their policy gradient. The verl layer (the
mini-batch fold, the loss wrapper, the current-policy forward, the token dump), the config checks,
the preflight and the memory model ask the table, never a rule's name: adding a rule is a mask
function, one :func:`register_rule` call, a method YAML and its tests.

Shipped: ``s2t`` (STAPO, :func:`stapo_core.s2t_mask`), ``entropy_topk`` (20-Entropy,
:func:`stapo_core.entropy_topk_mask`) and ``entropy_topk_authors_code`` (20-Entropy as its authors'
code computes it: per rank and micro-batch). ``token_selection: none`` selects nothing and is not a rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .checks import is_number
from .entropy_topk import entropy_topk_selection
from .s2t import STRATEGIES, s2t_keep_at, s2t_mask

#: ``token_selection`` value that selects nothing (not a rule)
NO_SELECTION = "none"
#: the scope of a rule evaluated inside the loss on each rank's micro-batch alone, from the update's own
#: statistics, each micro-batch's mean over its kept tokens weighted by its share of the mini-batch's
#: sequences: the loss of 20-Entropy's authors' verl fork (a token-mean without KL loss or entropy bonus)
RANK_MICRO_BATCH = "rank_micro_batch"


@dataclass(frozen=True)
class RuleResult:
    """What a rule returns for one batch (pooled over ``group``).

    keep: float32 ``(batch, resp_len)``, 1 where the token keeps its gradient (0 outside the mask).
    tokens, kept: response tokens and kept tokens, counted over the pooled group.
    stats: the rule's metrics, unprefixed (``candidates``, ``tau_h``, ...); NaN when undefined.
    candidate: bool ``(batch, resp_len)``, the rule's candidate set where it has one (S2T), else None.
    keep_at: ``keep_at(*, log_prob, entropy, advantages, response_mask)`` -> float32 keep mask: this
        selection's pooled thresholds applied to other statistics of the same tokens, on this process
        alone (no collective); None where the rule's selection is not a threshold.
    """

    keep: torch.Tensor
    tokens: float
    kept: float
    stats: dict
    candidate: Optional[torch.Tensor] = None
    keep_at: Optional[Callable[..., torch.Tensor]] = None


@dataclass(frozen=True)
class SelectionRule:
    """One token-selection rule.

    name: the config value (``policy_loss.token_selection``).
    metric_prefix: its metrics are logged as ``actor/<metric_prefix><stat>`` (ends with ``/``).
    select: ``select(settings, *, log_prob, entropy, advantages, response_mask, group, generator)``
        -> :class:`RuleResult`. ``settings`` is the policy-loss config (read by attribute);
        tensors are ``(batch, resp_len)`` float32 (``advantages`` also ``(batch,)``); ``group``: the
        process group to pool over (None: this process); ``generator``: a zero-argument callable
        returning this rank's ``torch.Generator`` (for random rules).
    reads_log_prob: the rule reads ``p`` (S2T) and not only the entropy (20-Entropy).
    positive_advantage_only: only tokens of responses with a positive advantage can lose their
        gradient, and the rule's statistic is computed from those tokens alone: a statistics
        forward of those responses gives the selection of a forward of every response.
    fields: the policy-loss config fields the rule reads, with what each must be (for messages).
    check: ``check(settings) -> [(field, expected), ...]``, the fields whose values are invalid.
    scope: where the rule must be evaluated: None, where ``policy_loss.scope`` says (the PPO
        mini-batch, or each micro-batch pooled over the ranks); :data:`RANK_MICRO_BATCH`, each rank's
        micro-batch alone.
    """

    name: str
    metric_prefix: str
    select: Callable[..., RuleResult]
    reads_log_prob: bool
    positive_advantage_only: bool
    fields: dict
    check: Callable[[object], list]
    scope: Optional[str] = None


RULES: dict[str, SelectionRule] = {}


def register_rule(rule: SelectionRule) -> SelectionRule:
    if rule.name == NO_SELECTION or rule.name in RULES:
        raise ValueError(f"register_rule: token_selection {rule.name!r} is taken")
    if not rule.metric_prefix.endswith("/") or any(r.metric_prefix == rule.metric_prefix for r in RULES.values()):
        raise ValueError(f"register_rule: metric prefix {rule.metric_prefix!r} must end with '/' and be unique")
    RULES[rule.name] = rule
    return rule


def unregister_rule(name: str) -> None:
    """Remove ``name`` from the table (tests that register a rule of their own)."""
    RULES.pop(name, None)


def token_selections() -> tuple[str, ...]:
    """Every valid ``token_selection`` value."""
    return (NO_SELECTION, *RULES)


def get_rule(name: str) -> SelectionRule:
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"token_selection {name!r} is not a registered rule: expected one of {list(RULES)}") from None


def _is_fraction(value, include_one: bool = False) -> bool:
    return is_number(value) and 0.0 < value and (value <= 1.0 if include_one else value < 1.0)


def _invalid(fields: dict, **valid: bool) -> list:
    """A rule's ``check`` result: ``(field, what it must be)`` of each field whose value is not ``valid``."""
    return [(name, fields[name]) for name, ok in valid.items() if not ok]


def _select_s2t(settings, *, log_prob, entropy, advantages, response_mask, group=None, generator=None) -> RuleResult:
    result = s2t_mask(log_prob, entropy, advantages, response_mask, tau_p=settings.tau_p, q=settings.q,
                      strategy=settings.strategy,
                      generator=generator() if generator is not None and settings.strategy == "random" else None,
                      group=group)
    tokens = float(result.stats["tokens"])
    keep_at = None if settings.strategy == "random" else functools.partial(
        s2t_keep_at, tau_p=settings.tau_p, tau_h=result.stats["tau_h"], strategy=settings.strategy)
    return RuleResult(result.keep, tokens, tokens - float(result.stats["silenced"]), dict(result.stats),
                      result.candidate, keep_at)


def _check_s2t(settings) -> list:
    return _invalid(S2T.fields, tau_p=_is_fraction(settings.tau_p), q=_is_fraction(settings.q),
                    strategy=settings.strategy in STRATEGIES)


S2T = register_rule(SelectionRule(
    name="s2t",
    metric_prefix="s2t/",
    select=_select_s2t,
    reads_log_prob=True,
    positive_advantage_only=True,
    fields={"tau_p": "a probability in (0, 1)", "q": "a quantile in (0, 1)",
            "strategy": f"one of {list(STRATEGIES)}"},
    check=_check_s2t,
))


def _select_entropy_topk(settings, *, log_prob, entropy, advantages, response_mask, group=None, generator=None,
                         rounding: str = "ceil") -> RuleResult:
    keep, threshold = entropy_topk_selection(entropy, response_mask, ratio=settings.entropy_top_ratio, group=group,
                                             rounding=rounding)
    counts = torch.stack([response_mask.float().sum(), keep.sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    tokens, kept = counts.tolist()

    def keep_at(*, log_prob, entropy, advantages, response_mask):  # every token at or above the threshold
        return ((response_mask != 0) & (entropy.detach().float() >= threshold)).float()

    return RuleResult(keep, tokens, kept, {"tokens": tokens, "kept": kept, "kept_frac": kept / max(tokens, 1.0)},
                      keep_at=keep_at)


def _check_entropy_topk(settings) -> list:
    return _invalid(ENTROPY_TOPK.fields, entropy_top_ratio=_is_fraction(settings.entropy_top_ratio, include_one=True))


ENTROPY_TOPK = register_rule(SelectionRule(
    name="entropy_topk",
    metric_prefix="entropy_topk/",
    select=_select_entropy_topk,
    reads_log_prob=False,
    positive_advantage_only=False,
    fields={"entropy_top_ratio": "a fraction in (0, 1]"},
    check=_check_entropy_topk,
))

ENTROPY_TOPK_AUTHORS_CODE = register_rule(SelectionRule(
    name="entropy_topk_authors_code",
    metric_prefix="entropy_topk_authors_code/",
    select=functools.partial(_select_entropy_topk, rounding="authors_code"),
    reads_log_prob=False,
    positive_advantage_only=False,
    fields=ENTROPY_TOPK.fields,
    check=_check_entropy_topk,
    scope=RANK_MICRO_BATCH,
))


__all__ = ["ENTROPY_TOPK", "ENTROPY_TOPK_AUTHORS_CODE", "NO_SELECTION", "RANK_MICRO_BATCH", "RULES", "RuleResult",
           "S2T", "SelectionRule", "get_rule", "register_rule", "token_selections", "unregister_rule"]
