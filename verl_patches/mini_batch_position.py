"""A PPO mini-batch's position in its update step, counted per worker.

verl's ``TrainingWorker.train_mini_batch`` calls ``train_batch`` once per mini-batch and flags the
step's last one with ``update_lr_scheduler=True``: the only step boundary a worker sees.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.utils import tensordict_utils as tu

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
    """Counted on the worker object itself: a second model worker in the process cannot shift it."""
    counter = getattr(worker, COUNTER_ATTR, None)
    if counter is None:
        counter = MiniBatchCounter()
        setattr(worker, COUNTER_ATTR, counter)
    return counter.observe(bool(tu.get(data, "update_lr_scheduler", True)))
