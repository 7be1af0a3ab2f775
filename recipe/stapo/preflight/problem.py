"""What the preflight reports (:class:`Problem`, :class:`PreflightError`, :class:`Report`), and helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

ACTOR, ROLLOUT, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"

_NO_VALUE = object()


@dataclass(frozen=True)
class Problem:
    """One refusal: what (``key``: a config key, or a path; ``value``: its value, when it is the
    problem), what is wrong, and how to fix it."""

    key: str
    problem: str
    fix: str
    value: object = _NO_VALUE

    def __str__(self) -> str:
        head = self.key if self.value is _NO_VALUE else f"{self.key}={self.value!r}"
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


def shown(value):
    """A config value as a refusal shows it (a section or list as plain data)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
