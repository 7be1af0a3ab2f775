"""`S2TPolicyLossConfig`: the policy-loss settings of STAPO and 20-Entropy.

Named by ``_target_`` in the recipe YAML (``actor_rollout_ref.actor.policy_loss``), so verl turns it
into this dataclass in the driver and again in every worker. Instantiating it imports this module,
and so :mod:`verl_patches`, in that process. Every field is validated at construction: a typo or a
bad value fails in the driver, before any worker starts, with a message naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from verl.workers.config import PolicyLossConfig

#: config path of this block, used in error messages
KEY_PREFIX = "actor_rollout_ref.actor.policy_loss"

#: loss modes this recipe registers with verl (verl_patches.losses)
S2T_LOSS_MODES = ("stapo", "entropy_topk")
STRATEGIES = ("low_entropy", "high_entropy", "random", "full")
STATS_FROM = ("rollout", "current")
SCOPES = ("mini_batch", "micro_batch")


@dataclass
class S2TPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the S2T settings.

    Args:
        loss_mode: ``stapo`` (clipped surrogate with S2T) or ``entropy_topk`` (20-Entropy); the
            built-in verl modes are also accepted, in which case the S2T fields are ignored.
        tau_p: probability threshold: candidates have ``p < tau_p`` (paper: 0.002).
        q: entropy quantile of the candidate set (paper: 0.75).
        strategy: which candidates are silenced: ``low_entropy`` (STAPO), ``high_entropy``,
            ``random`` or ``full`` (the paper's ablations).
        stats_from: where ``p`` and ``H`` come from. ``rollout``: the old-policy log-probs and
            entropies the trainer computes once per step (no extra forward; pooled exactly over the
            mini-batch). ``current``: the policy being updated, inside the loss (Algorithm 1).
        scope: what the q-quantile (or the top-entropy rank) is pooled over. ``mini_batch``: the
            whole mini-batch, all micro-batches and data-parallel ranks (only with
            ``stats_from=rollout``). ``micro_batch``: the current micro-batch of every
            data-parallel rank. ``None`` picks the widest scope ``stats_from`` allows.
        entropy_top_ratio: 20-Entropy: the fraction of highest-entropy response tokens that carry
            the policy gradient.
        seed: seed of the generator of the ``random`` strategy (offset by the step counter).
    """

    loss_mode: str = "stapo"
    tau_p: float = 0.002
    q: float = 0.75
    strategy: str = "low_entropy"
    stats_from: str = "rollout"
    scope: Optional[str] = None
    entropy_top_ratio: float = 0.2
    seed: int = 0

    def __post_init__(self):
        def fail(key, value, expected):
            raise ValueError(f"{KEY_PREFIX}.{key}={value!r} is invalid: expected {expected}")

        if not isinstance(self.loss_mode, str):
            fail("loss_mode", self.loss_mode, "a registered policy loss name")
        if not _is_number(self.tau_p) or not 0.0 < self.tau_p < 1.0:
            fail("tau_p", self.tau_p, "a probability in (0, 1)")
        if not _is_number(self.q) or not 0.0 < self.q < 1.0:
            fail("q", self.q, "a quantile in (0, 1)")
        if self.strategy not in STRATEGIES:
            fail("strategy", self.strategy, f"one of {list(STRATEGIES)}")
        if self.stats_from not in STATS_FROM:
            fail("stats_from", self.stats_from, f"one of {list(STATS_FROM)}")
        if self.scope is not None and self.scope not in SCOPES:
            fail("scope", self.scope, f"one of {list(SCOPES)} or null")
        if self.stats_from == "current" and self.scope == "mini_batch":
            fail(
                "scope",
                self.scope,
                "micro_batch (or null) with stats_from=current: current-policy statistics exist "
                "only for the micro-batch being processed",
            )
        if not _is_number(self.entropy_top_ratio) or not 0.0 < self.entropy_top_ratio <= 1.0:
            fail("entropy_top_ratio", self.entropy_top_ratio, "a fraction in (0, 1]")
        if not isinstance(self.seed, int):
            fail("seed", self.seed, "an integer")

    @property
    def resolved_scope(self) -> str:
        """``scope`` with ``None`` resolved to the widest scope ``stats_from`` allows."""
        if self.scope is not None:
            return self.scope
        return "mini_batch" if self.stats_from == "rollout" else "micro_batch"

    @property
    def selects_tokens(self) -> bool:
        """True when this config's loss mode is one of ours (S2T or 20-Entropy)."""
        return self.loss_mode in S2T_LOSS_MODES


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
