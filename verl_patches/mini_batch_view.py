"""One PPO mini-batch as the recipe reads it: its place in the step, its fields read once, and what is
computed on it before the update.

verl holds a mini-batch in either of two layouts (:mod:`verl_patches.layout`); :func:`read_view`
reads it once into a :class:`MiniBatchView` that the current-policy forward, the selections, the
update's probe and the token dump extend or read. verl flags only a step's last mini-batch, so the
worker counts the position itself (:func:`position_of`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from verl.utils import tensordict_utils as tu

from .layout import ROLLOUT_ENTROPY_FIELD, SUM_PI_SQUARED_FIELD, padded_float, response_lengths, to_padded
from .policy_loss_config import TokenSelectionLossConfig

#: attribute of a worker object holding its :class:`MiniBatchCounter`
COUNTER_ATTR = "_stapo_mini_batches"


@dataclass(frozen=True)
class MiniBatchPosition:
    """A mini-batch's place in training, as its worker counts it.

    step: 1-based count of the update steps this worker has started (a resumed run counts from 1).
    index: 0-based index of the mini-batch within its step (all PPO epochs together).
    last: verl flagged it as the step's last mini-batch (the step's per-step sums are complete after it).
    """

    step: int
    index: int
    last: bool = False

    @property
    def first(self) -> bool:
        """True for a step's first mini-batch: its policy is still the rollout policy."""
        return self.index == 0


class MiniBatchCounter:
    """Counts the mini-batches of one worker: a step starts at the worker's first mini-batch and
    after each mini-batch verl flagged as last (any number of mini-batches and PPO epochs)."""

    def __init__(self) -> None:
        self._step, self._next_index = 0, 0

    def observe(self, is_last: bool) -> MiniBatchPosition:
        if self._next_index == 0:
            self._step += 1
        position = MiniBatchPosition(self._step, self._next_index, bool(is_last))
        self._next_index = 0 if is_last else self._next_index + 1
        return position


def position_of(worker, data) -> MiniBatchPosition:
    """Counted on the worker object itself: a second model worker in the process (e.g. a critic)
    cannot shift the actor's count."""
    counter = getattr(worker, COUNTER_ATTR, None)
    if counter is None:
        counter = MiniBatchCounter()
        setattr(worker, COUNTER_ATTR, counter)
    return counter.observe(bool(tu.get(data, "update_lr_scheduler", True)))


@dataclass(frozen=True)
class CurrentStatistics:
    """The current policy's statistics of one rank's mini-batch, like the view's fields: float32
    ``(batch, width)`` on its device, NaN on the rows not forwarded. forwarded: bool ``(batch,)``, the
    rows whose statistics were computed. metrics: the forward's own (``*/current_forward_*``)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor
    forwarded: torch.Tensor
    metrics: dict


@dataclass(frozen=True)
class S2TSets:
    """S2T's token sets of one rank's mini-batch: bool ``(batch, width)`` on the view's device.

    mask: the response tokens (before any token was silenced); silenced: the tokens S2T silenced
    (or, monitoring, would silence); candidate: its candidate set (``A > 0``, ``p < tau_p``).
    ``silenced`` lies inside ``candidate``, which lies inside ``mask``. tau_h: S2T's entropy
    threshold of the mini-batch (None when undefined: no candidate, or a strategy without one).
    """

    mask: torch.Tensor
    silenced: torch.Tensor
    candidate: torch.Tensor
    tau_h: Optional[float] = None

    @property
    def kept_candidates(self) -> torch.Tensor:
        """The candidates S2T keeps (their entropy is high: exploration)."""
        return self.candidate & ~self.silenced


@dataclass
class MiniBatchSelection:
    """Everything selected in one rank's mini-batch before its update.

    keep: the run's float32 keep mask ``(batch, width)``, folded into the mini-batch; None when the run
    selects nothing here. s2t: S2T's sets, applied or monitored (None when neither). dump: S2T's sets
    with the token dump's settings, where it scores the mini-batch (the same object as ``s2t`` when
    those are its settings; None without rollout statistics). metrics: every selection metric.
    """

    keep: Optional[torch.Tensor] = None
    s2t: Optional[S2TSets] = None
    dump: Optional[S2TSets] = None
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HostFields:
    """The view on the host, for the token dump: float32 ``(batch, width)`` on the CPU.

    lengths: each row's response length. mask: the response mask as the mini-batch came; folded: the
    mask the update trains on (after the fold). old_log_prob: None when absent.
    """

    lengths: list
    mask: torch.Tensor
    folded: torch.Tensor
    advantages: torch.Tensor
    old_log_prob: Optional[torch.Tensor]


@dataclass
class MiniBatchView:
    """One rank's PPO mini-batch as the recipe reads it (:func:`read_view`).

    data: verl's TensorDict (the fold writes the keep mask into it; the forwards take its sequences).
    position: its place in the step. cfg: the worker's policy-loss settings (None for a worker without
    a policy loss; the recipe's resolve their rule, ``cfg.rule``).
    group: the data-parallel group (verl's counts, the S2T monitor, the forwards' exchanges);
    pool_group: the group the run's own selection pools over (``group``, or this rank's group of
    ``ranks_per_pool`` ranks: :mod:`verl_patches.selection_pool`); device: the engine's (where its
    collectives run).
    mask, advantages: float32 ``(batch, width)`` on ``device``; the mask is the response mask as the
    mini-batch came, before any token is silenced. old_log_prob, rollout_entropy, sum_pi_squared: the
    rollout-time fields, likewise (None when the mini-batch has none).
    current: the current policy's statistics, when forwarded. dump_s2t: the S2T settings of the token
    dump, where it scores this mini-batch (else None). selection: what was selected.
    """

    data: object
    position: MiniBatchPosition
    cfg: object
    group: object
    pool_group: object
    device: torch.device
    mask: torch.Tensor
    advantages: Optional[torch.Tensor]
    old_log_prob: Optional[torch.Tensor]
    rollout_entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]
    current: Optional[CurrentStatistics] = None
    dump_s2t: Optional[TokenSelectionLossConfig] = None
    selection: MiniBatchSelection = field(default_factory=MiniBatchSelection)

    @property
    def selects(self) -> bool:
        return selects(self.cfg)

    @property
    def forwards_current_policy(self) -> bool:
        """The selection needs the current policy's statistics: for the fold (STAPO's Algorithm 1) or
        for the monitor with ``stats_from=current``, on every mini-batch of a step but the first."""
        cfg = self.cfg
        return (self.selects and not self.position.first
                and (cfg.forwards_current_policy or cfg.monitor_forwards_current_policy))

    @functools.cached_property
    def host(self) -> HostFields:
        """The host copy, made on first use (after the selection: it holds the folded mask)."""
        keep = self.selection.keep
        return HostFields(
            lengths=response_lengths(self.data), mask=self.mask.cpu(),
            folded=(self.mask if keep is None else self.mask * keep).cpu(), advantages=self.advantages.cpu(),
            old_log_prob=None if self.old_log_prob is None else self.old_log_prob.cpu())


def selects(cfg) -> bool:
    """The recipe selects on every mini-batch of a worker with the policy-loss settings ``cfg``: the
    run's fold, or the S2T monitor."""
    return isinstance(cfg, TokenSelectionLossConfig) and (cfg.folds_into_mini_batch or cfg.monitors_s2t)


def read_view(data, position: MiniBatchPosition, cfg, *, group=None, pool_group=..., device=None) -> MiniBatchView:
    """Read one mini-batch once, and check that it carries what its selections read.

    Args:
        data: verl's TensorDict of the mini-batch, padded or jagged (:mod:`verl_patches.layout`).
        position: its place in the step. cfg: the worker's policy-loss settings.
        group: the data-parallel group. pool_group: the run's selection pool (default ``group``).
        device: where the fields go (the engine's).

    Returns:
        The :class:`MiniBatchView`: every per-token field float32 ``(batch, width)`` on ``device``.

    Raises:
        KeyError: naming the fields and who reads them, when the mini-batch lacks the advantages or,
            for a selection on the rollout statistics (``stats_from=rollout``, or a step's first
            mini-batch), ``old_log_probs`` or the rollout entropy: the only check of them.
    """
    width = to_padded(data["response_mask"]).shape[1]
    mask, advantages, old_log_prob, rollout_entropy, sum_pi_squared = (
        padded_float(data[name], width, device) if name in data else None
        for name in ("response_mask", "advantages", "old_log_probs", ROLLOUT_ENTROPY_FIELD, SUM_PI_SQUARED_FIELD))
    pool_group = group if pool_group is ... else pool_group
    view = MiniBatchView(data, position, cfg, group, pool_group, device, mask, advantages, old_log_prob,
                         rollout_entropy, sum_pi_squared)
    if view.selects:
        needed = {"advantages": advantages}
        if not view.forwards_current_policy:
            needed.update({"old_log_probs": old_log_prob, ROLLOUT_ENTROPY_FIELD: rollout_entropy})
        missing = [name for name, t in needed.items() if t is None]
        if missing:
            who = "the S2T monitor (s2t_monitor=true)" if cfg.monitors_s2t else "token selection (scope=mini_batch)"
            raise KeyError(f"{who} needs the fields {missing} in the actor's mini-batch; the rollout entropy is kept "
                           "by the recipe's trainer patches: is VERL_USE_EXTERNAL_MODULES=verl_patches.activate set "
                           "in the driver?")
    return view
