"""A shorter replay-buffer poll for the CPU path (the patch ``cpu_replay_poll`` of
:mod:`stapo_cpu.patches.install` says why); the buffer selects the same samples in the same order
(they are all finished when it selects them).
"""

from __future__ import annotations

import functools
from typing import Any

#: seconds between the replay buffer's checks for finished rollouts on the CPU path (verl: 2.0)
CPU_POLL_INTERVAL_S = 0.2


def wrap_replay_buffer_init(original):
    """``ReplayBuffer.__init__`` that then lowers ``self.poll_interval`` to :data:`CPU_POLL_INTERVAL_S`
    (a larger interval given explicitly is lowered too; a smaller one is kept)."""

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.poll_interval = min(float(self.poll_interval), CPU_POLL_INTERVAL_S)

    return __init__
