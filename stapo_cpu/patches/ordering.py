"""Timing-independent sample identity and batch order for verl 0.9.1's TransferQueue (v1) trainer:
the wrappers of the CPU wing's patch table (:mod:`stapo_cpu.patches.install` says what each changes and
why). Each checks ``VERL_FULL_DETERMINISM=1`` (what verl's entry point exports to every process under
``actor_rollout_ref.rollout.full_determinism=true``) when it runs, and changes nothing otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import uuid as _uuid
from typing import Any

FULL_DETERMINISM_ENV = "VERL_FULL_DETERMINISM"


def request_seed(seed: int, step: Any, prompt_ids, which: Any) -> int:
    """A sample's own sampling seed, from (the rollout's seed, the step, the prompt's token ids, which
    sample): a sha256 digest, in [0, 2**63). The CPU rollout's per-request seed under full determinism."""
    digest = hashlib.sha256(repr((seed, step, tuple(prompt_ids), which)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def deterministic() -> bool:
    """True when verl's full-determinism mode is on in this process."""
    return os.environ.get(FULL_DETERMINISM_ENV, "0") == "1"


def wrap_run_agent_loop(original):
    """``AgentLoopWorker._run_agent_loop`` giving each sample ``priority = session_id`` (its index in its
    group), so that its request id is ``det-<index>``, under full determinism.

    Patched on verl's ``AgentLoopWorker`` (a plain class), whose ``_run_agent_loop`` the v1 worker
    inherits: ``AgentLoopWorkerTQ`` is a ``@ray.remote`` actor class, on which an assignment would
    only set an attribute of Ray's wrapper.
    """

    @functools.wraps(original)
    async def _run_agent_loop(self, *args: Any, **kwargs: Any):
        if deterministic() and "priority" not in kwargs and isinstance(kwargs.get("session_id"), int):
            kwargs["priority"] = kwargs["session_id"]
        return await original(self, *args, **kwargs)

    return _run_agent_loop


class CountingUUID:
    """Stands in for the ``uuid`` module in verl's v1 trainer: ``uuid4()`` is a counter UUID under
    full determinism (ordered, same sequence every run), a random one otherwise."""

    def __init__(self, module=_uuid) -> None:
        self._module = module
        self._counter = itertools.count(1)

    def uuid4(self) -> _uuid.UUID:
        return _uuid.UUID(int=next(self._counter)) if deterministic() else self._module.uuid4()

    def __getattr__(self, name: str) -> Any:
        if name == "_module":  # not set yet (construction, copying)
            raise AttributeError(name)
        return getattr(self._module, name)


def wrap_uuid_module(original) -> CountingUUID:
    """The v1 trainer's ``uuid`` module replaced by a :class:`CountingUUID` over it."""
    return CountingUUID(original)


def trajectory_sort_key(key: str) -> tuple:
    """Order of a trajectory key ``{uid}_{session_id}_{index}``: (uid, session, index), numerically
    for the last two; a key of another form sorts by itself."""
    parts = key.rsplit("_", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return parts[0], int(parts[1]), int(parts[2])
    return key, -1, -1


def wrap_select_prompt_uids(original):
    """``ReplayBuffer._select_prompt_uids`` over the sampleable keys in sorted order (full determinism)."""

    @functools.wraps(original)
    def _select_prompt_uids(self, partition_id: str, sampleable_keys: set, batch_size: int):
        if deterministic():
            sampleable_keys = sorted(sampleable_keys)  # the original's stable sort by step then keeps uid order
        return original(self, partition_id, sampleable_keys, batch_size)

    return _select_prompt_uids


def wrap_materialize_batch(original):
    """``ReplayBuffer._materialize_batch`` over the snapshot ordered by (uid, sample, output) (full determinism)."""

    @functools.wraps(original)
    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list, partition_snapshot: dict):
        if deterministic():
            partition_snapshot = {k: partition_snapshot[k] for k in sorted(partition_snapshot, key=trajectory_sort_key)}
        return original(self, partition_id, selected_prompt_uids, partition_snapshot)

    return _materialize_batch
