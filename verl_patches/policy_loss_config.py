"""`TokenSelectionLossConfig`: verl's policy-loss settings plus which tokens carry gradient.

verl builds it from ``actor_rollout_ref.actor.policy_loss`` in the driver and in every worker, so a
bad value fails in the driver naming the key, and every layer asks its properties where a selection
runs and what it reads. ``token_selection`` picks the tokens, ``loss_mode`` (any verl policy loss)
computes the loss over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stapo_core import DEFAULT_Q, DEFAULT_TAU_P
from stapo_core.rules import NO_SELECTION, RANK_MICRO_BATCH, RULES, S2T, SelectionRule, get_rule, token_selections
from verl.workers.config import PolicyLossConfig

#: config path of this block, used in error messages
KEY_PREFIX = "actor_rollout_ref.actor.policy_loss"

#: where p and H come from: the old (rollout) policy, or the policy being updated
STATS_FROM = ("rollout", "current")
#: what the statistic is pooled over: the whole PPO mini-batch, or one micro-batch of every rank (a rule
#: may have a scope of its own: :attr:`stapo_core.rules.SelectionRule.scope`)
SCOPES = ("mini_batch", "micro_batch")
#: the current-policy forward of S2T (stats_from=current, mini-batch scope): the sequences with a
#: positive advantage (the only ones that can hold a candidate), or every sequence
CURRENT_FORWARDS = ("positive_advantage", "full")
#: what a sequence-level ratio (gspo, geo_mean) is taken over once tokens are selected: the kept tokens
#: (the folded mask), or every response token, the silenced ones carrying no gradient
SEQUENCE_RATIOS = ("kept_tokens", "all_tokens")
#: verl losses whose ratio is one number per sequence, computed over the response mask
SEQUENCE_RATIO_LOSS_MODES = ("gspo", "geo_mean")
#: verl losses that normalise by their own per-micro-batch counts (not verl's mini-batch counts), so
#: the micro-batch scope's re-weighting does not give the mean over the remaining tokens
LOCAL_NORMALISING_LOSS_MODES = ("geo_mean", "sapo")


def policy_loss_of(worker):
    """The policy-loss settings of a ``TrainingWorker``, read from the loss function verl bound to it
    (None for a worker without one, e.g. a critic)."""
    loss_fn = getattr(worker, "loss_fn", None)
    config = getattr(loss_fn, "keywords", {}).get("config") if loss_fn is not None else None
    return getattr(config, "policy_loss", None)


@dataclass
class TokenSelectionLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the token selection of STAPO (S2T) and 20-Entropy. Each key,
    its default and meaning: docs/method.md, "The recipe's keys"; besides those:

    Args:
        loss_mode: any policy loss registered with verl (``vanilla`` for JustRL/STAPO/20-Entropy).
        entropy_top_ratio: 20-Entropy: the fraction of highest-entropy response tokens kept.
        seed: seed of S2T's ``random`` strategy.
    """

    loss_mode: str = "vanilla"
    token_selection: str = "none"
    tau_p: float = DEFAULT_TAU_P
    q: float = DEFAULT_Q
    strategy: str = "low_entropy"
    entropy_top_ratio: float = 0.2
    stats_from: str = "rollout"
    scope: Optional[str] = None
    current_forward: str = "positive_advantage"
    ranks_per_pool: Optional[int] = None
    sequence_ratio: str = "kept_tokens"
    seed: int = 0
    s2t_monitor: bool = False
    update_effect_responses: int = 0

    def __post_init__(self):
        def fail(key, value, expected):
            raise ValueError(f"{KEY_PREFIX}.{key}={value!r} is invalid: expected {expected}")

        if not isinstance(self.loss_mode, str):
            fail("loss_mode", self.loss_mode, "a registered policy loss name")
        if self.token_selection not in token_selections():
            fail("token_selection", self.token_selection, f"one of {list(token_selections())}")
        for rule in RULES.values():  # every rule's fields, whichever selects (the S2T monitor reads S2T's)
            for key, expected in rule.check(self):
                fail(key, getattr(self, key), expected)
        for key, allowed in (("stats_from", STATS_FROM), ("current_forward", CURRENT_FORWARDS),
                             ("sequence_ratio", SEQUENCE_RATIOS)):
            if getattr(self, key) not in allowed:
                fail(key, getattr(self, key), f"one of {list(allowed)}")
        if self.scope is not None and self.scope not in SCOPES:
            fail("scope", self.scope, f"one of {list(SCOPES)} or null")
        own_scope = self.resolved_scope == RANK_MICRO_BATCH
        if own_scope and self.scope == "mini_batch":
            fail("scope", self.scope, f"null or micro_batch with token_selection={self.token_selection} (its rule "
                 "selects on each rank's micro-batch)")
        k = self.ranks_per_pool
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                fail("ranks_per_pool", k, "null (every data-parallel rank) or a whole number >= 1 of contiguous "
                     "data-parallel ranks per pool")
            if not self.selects_tokens:
                fail("ranks_per_pool", k, "null with token_selection=none (there is no selection to pool)")
            if self.applies_s2t:
                fail("ranks_per_pool", k, "null with token_selection=s2t: S2T's tau_h is pooled over the whole "
                     "mini-batch, the paper's statistic (ranks_per_pool reproduces 20-Entropy's authors' pool)")
            if own_scope:
                fail("ranks_per_pool", k, f"null with token_selection={self.token_selection} (it selects per rank "
                     "and micro-batch already; ranks_per_pool applies to the pooled rules)")
        if self.sequence_ratio == "all_tokens" and self.loss_mode not in SEQUENCE_RATIO_LOSS_MODES:
            fail("sequence_ratio", self.sequence_ratio, f"kept_tokens with loss_mode={self.loss_mode} (its ratio is "
                 f"per token; all_tokens applies to {list(SEQUENCE_RATIO_LOSS_MODES)})")
        if self.selects_in_loss and self.loss_mode in LOCAL_NORMALISING_LOSS_MODES:
            key, value = ("token_selection", self.token_selection) if own_scope else ("scope", self.scope)
            fail(key, value, f"a mini-batch reading with loss_mode={self.loss_mode}: it normalises per "
                 "micro-batch itself, so only the mini-batch fold gives the mean over the remaining tokens")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            fail("seed", self.seed, "an integer")
        if not isinstance(self.s2t_monitor, bool):
            fail("s2t_monitor", self.s2t_monitor, "true or false")
        if (not isinstance(self.update_effect_responses, int) or isinstance(self.update_effect_responses, bool)
                or self.update_effect_responses < 0):
            fail("update_effect_responses", self.update_effect_responses, "an integer >= 0 (0: off)")
        if self.measures_update_effect and not ((self.applies_s2t and self.folds_into_mini_batch) or self.monitors_s2t):
            if self.token_selection == S2T.name:
                fail("update_effect_responses", self.update_effect_responses,
                     "0 with scope=micro_batch: S2T then silences tokens inside the loss, per micro-batch, so the "
                     "silenced set is not known before the update (use scope=null to measure the update effect)")
            fail("update_effect_responses", self.update_effect_responses,
                 f"0 without S2T's selection: set {KEY_PREFIX}.s2t_monitor=true (or token_selection=s2t) to measure "
                 "how the update moves the tokens S2T singles out")

    def pool_ranks(self, dp_size: int) -> int:
        """The data-parallel ranks one selection pool spans, out of the run's ``dp_size`` (GPUs /
        ``ulysses_sequence_parallel_size``): 1 for a rule evaluated on each rank's micro-batch,
        ``ranks_per_pool`` when set, else every rank.

        Raises:
            ValueError: naming the key, when ``ranks_per_pool`` does not divide ``dp_size`` (the pools
                would not cover the ranks evenly).
        """
        k = self.ranks_per_pool
        if k is None:
            return 1 if self.resolved_scope == RANK_MICRO_BATCH else dp_size
        if dp_size % k:
            divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
            raise ValueError(
                f"{KEY_PREFIX}.ranks_per_pool={k!r} is invalid: expected a divisor of the run's {dp_size} "
                f"data-parallel ranks (GPUs / ulysses_sequence_parallel_size): one of {divisors}, or null (every rank)")
        return k

    # -- the decisions, each asked in one place --------------------------------------------------

    @property
    def selects_tokens(self) -> bool:
        """Some response tokens may lose their gradient."""
        return self.token_selection != NO_SELECTION

    @property
    def rule(self) -> Optional[SelectionRule]:
        """The rule ``token_selection`` names (None for ``none``)."""
        return get_rule(self.token_selection) if self.selects_tokens else None

    @property
    def resolved_scope(self) -> str:
        """Where the selection runs: its rule's own scope (:attr:`~stapo_core.rules.SelectionRule.scope`),
        else ``scope`` (default ``mini_batch``)."""
        own = self.rule.scope if self.selects_tokens else None
        return own or self.scope or "mini_batch"

    @property
    def statistics_source(self) -> str:
        """Where ``p`` and ``H`` come from (a rule evaluated per rank: the update's own forward)."""
        return "current" if self.resolved_scope == RANK_MICRO_BATCH else self.stats_from

    @property
    def folds_into_mini_batch(self) -> bool:
        """The actor folds the keep mask into each mini-batch before verl counts its tokens."""
        return self.selects_tokens and self.resolved_scope == "mini_batch"

    @property
    def selects_in_loss(self) -> bool:
        """The keep mask is computed per micro-batch, inside the loss wrapper."""
        return self.selects_tokens and self.resolved_scope != "mini_batch"

    @property
    def forwards_current_policy(self) -> bool:
        """Each mini-batch after the first gets one extra no-grad forward of the current policy."""
        return self.folds_into_mini_batch and self.stats_from == "current"

    @property
    def needs_update_entropy(self) -> bool:
        """The update's forward must compute the entropy (``actor.calculate_entropy=true``)."""
        return self.selects_in_loss and self.statistics_source == "current"

    @property
    def sequence_ratio_over_all_tokens(self) -> bool:
        return (self.selects_tokens and self.sequence_ratio == "all_tokens"
                and self.loss_mode in SEQUENCE_RATIO_LOSS_MODES)

    @property
    def applies_s2t(self) -> bool:
        return self.token_selection == S2T.name

    @property
    def monitors_s2t(self) -> bool:
        """S2T's selection is computed and logged but not applied (``s2t_monitor`` in a run whose
        token selection is not S2T)."""
        return self.s2t_monitor and not self.applies_s2t

    @property
    def monitor_forwards_current_policy(self) -> bool:
        """The monitor needs the current policy's statistics on each mini-batch after the first."""
        return self.monitors_s2t and self.stats_from == "current"

    @property
    def measures_update_effect(self) -> bool:
        return self.update_effect_responses > 0
