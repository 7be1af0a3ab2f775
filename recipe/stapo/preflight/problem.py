"""What the preflight reports (:class:`Problem`, :class:`PreflightError`, :class:`Report`), and helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

ACTOR, ROLLOUT, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"

#: no value: a :class:`Problem` without one, a key a config does not have
NO_VALUE = object()


@dataclass(frozen=True)
class Problem:
    """One refusal: a config key or a path (and ``value``, when it is the problem), what is wrong, the fix."""

    key: str
    problem: str
    fix: str
    value: object = NO_VALUE

    def __str__(self) -> str:
        head = self.key if self.value is NO_VALUE else f"{self.key}={self.value!r}"
        return f"{head}: {self.problem}. Fix: {self.fix}"


class PreflightError(ValueError):
    """Every problem the preflight found (``problems``), in one message."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"preflight refused the config ({n} problem{'s' if n != 1 else ''}; nothing was "
                         f"started):\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Report:
    """What a passing preflight has to say: notes (things not checked here, and why) and the memory table."""

    notes: list[str] = field(default_factory=list)
    memory_table: Optional[str] = None

    def text(self) -> str:
        lines = ["[stapo] preflight passed"]
        lines += [f"[stapo] note: {n}" for n in self.notes]
        if self.memory_table:
            lines.append("[stapo] " + self.memory_table)
        return "\n".join(lines)


def pick(config: DictConfig, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def world_size(config: DictConfig) -> Optional[int]:
    """``trainer.nnodes`` x ``trainer.n_gpus_per_node``; None unless both are whole numbers >= 1."""
    nnodes, gpus = pick(config, "trainer.nnodes"), pick(config, "trainer.n_gpus_per_node")
    return nnodes * gpus if is_int(nnodes) and is_int(gpus) and nnodes > 0 and gpus > 0 else None


def shown(value):
    """A config value as a refusal shows it (a section or list as plain data)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
