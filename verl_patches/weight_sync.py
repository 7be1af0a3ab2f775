"""A bounded wait in verl's weight sync to a vLLM rollout server.

verl sends each step's weights to the vLLM workers bucket by bucket over a ZeroMQ REQ socket and
blocks on each acknowledgement (``BucketedWeightSender``). When the receiving side fails (an error
while loading the weights, a dead worker) no acknowledgement comes and the trainer waits forever.
With these wraps every send and receive on that socket gives up after
``$STAPO_WEIGHT_SYNC_TIMEOUT_S`` seconds (:data:`DEFAULT_TIMEOUT_S` by default) and the sync raises
:class:`WeightSyncTimeout`, which ends the run with the reason.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import zmq

#: environment variable: seconds the trainer waits for each answer of the rollout server's receiver
TIMEOUT_ENV = "STAPO_WEIGHT_SYNC_TIMEOUT_S"
#: default wait: far above one bucket's load time (seconds at 2 GB), far below a silent hang
DEFAULT_TIMEOUT_S = 600.0
#: the shortest wait: a bucket of weights takes seconds to load, so a shorter one fails every sync (and
#: below 1 ms ZeroMQ's millisecond count is 0: a socket that never waits)
MIN_TIMEOUT_S = 1.0
#: the longest wait ZeroMQ takes: its socket timeouts are a signed 32-bit count of milliseconds (24.8 days)
MAX_TIMEOUT_S = (2**31 - 1) // 1000


class WeightSyncTimeout(RuntimeError):
    """The rollout server's weight receiver did not answer in time."""


def parse_timeout(raw: str) -> float:
    """The wait in seconds a value of ``$STAPO_WEIGHT_SYNC_TIMEOUT_S`` holds (empty: the default).

    Raises:
        ValueError: naming the variable, its value and the range [:data:`MIN_TIMEOUT_S`,
            :data:`MAX_TIMEOUT_S`], for a value that is not a number in it (``inf``, ``1e10``,
            ``0.0001``, ``soon``).
    """
    text = raw.strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        why = ("ZeroMQ's socket wait is a 32-bit count of milliseconds" if value > MAX_TIMEOUT_S else
               "a bucket of weights takes seconds to load: a shorter wait fails every sync" if value > 0 else
               "a wait is a positive number of seconds")
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S}] ({why}); "
                         f"set e.g. {TIMEOUT_ENV}={DEFAULT_TIMEOUT_S:g} (the default), or unset it")
    return value


def timeout_s() -> float:
    """The wait in seconds (``$STAPO_WEIGHT_SYNC_TIMEOUT_S``: :func:`parse_timeout`)."""
    return parse_timeout(os.environ.get(TIMEOUT_ENV, ""))


def wrap_init_socket(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``BucketedWeightSender._init_socket`` whose socket gives up on a send or receive after
    :func:`timeout_s` and is closed without waiting for unsent messages."""

    @functools.wraps(original)
    def _init_socket(self) -> None:
        original(self)
        ms = int(timeout_s() * 1000)
        self.socket.setsockopt(zmq.RCVTIMEO, ms)
        self.socket.setsockopt(zmq.SNDTIMEO, ms)
        self.socket.setsockopt(zmq.LINGER, 0)

    return _init_socket


def wrap_async_send_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    """``BucketedWeightSender.async_send_weights`` raising :class:`WeightSyncTimeout` (naming the
    socket, the wait and where the receiver's own error is) instead of ZeroMQ's ``Again``."""

    @functools.wraps(original)
    async def async_send_weights(self, weights) -> None:
        try:
            return await original(self, weights)
        except zmq.Again as exc:
            raise WeightSyncTimeout(
                f"weight sync to the rollout server: no answer on {self.zmq_handle} within {timeout_s():g} s "
                f"({TIMEOUT_ENV}); the receiving vLLM worker failed or died: its error is in the vLLM "
                f"server's log (the lines of vLLMHttpServer / Worker before this one)") from exc

    return async_send_weights
