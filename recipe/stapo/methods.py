"""The recipe's methods: a method is its ``config/method/<name>.yaml`` (``recipe.method: <name>``; its
rule, if it selects tokens, at ``actor_rollout_ref.actor.policy_loss.token_selection``), run by
``method=<name>``. The paper's comparison is :data:`PAPER_METHODS`, its one list: what the quickstart
runs by default and judges the baselines of, and the order methods are listed and plotted in. A new
file joins a comparison only where it is named (the quickstart's ``--methods``, gpu_smoke.sh's ``METHODS``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

METHOD_DIR = Path(__file__).resolve().parent / "config" / "method"
TOKEN_SELECTION_KEY = "actor_rollout_ref.actor.policy_loss.token_selection"
#: the paper's methods, in the order of its results table (Table 2)
PAPER_METHODS = ("grpo", "entropy20", "justrl", "stapo")
#: one colour per method in :func:`methods`' order, the same in every panel and figure
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
          "tab:cyan")


@dataclass(frozen=True)
class Method:
    """name: ``method=<name>``; token_selection: ``none`` or a rule of :data:`stapo_core.rules.RULES`;
    color: its colour in figures."""

    name: str
    token_selection: str
    color: str


@functools.lru_cache(maxsize=None)
def methods() -> dict[str, Method]:
    """Every method: the paper's (:data:`PAPER_METHODS`) in its order, then the others by name. A file
    whose ``recipe.method`` is not its stem is refused naming the file, and so is a missing paper method."""
    found = {}
    for path in sorted(METHOD_DIR.glob("*.yaml")):
        config = OmegaConf.load(path)
        name = OmegaConf.select(config, "recipe.method")
        if name != path.stem:
            raise ValueError(f"{path}: expected recipe.method: {path.stem} (the file's name), got "
                             f"recipe.method={name!r}")
        found[name] = str(OmegaConf.select(config, TOKEN_SELECTION_KEY, default="none"))
    missing = [m for m in PAPER_METHODS if m not in found]
    if missing:
        raise ValueError(f"{METHOD_DIR}: no {', '.join(f'{m}.yaml' for m in missing)}: the paper's methods "
                         f"{', '.join(PAPER_METHODS)} each need their file")
    order = [*PAPER_METHODS, *sorted(set(found) - set(PAPER_METHODS))]
    return {name: Method(name, found[name], COLORS[i % len(COLORS)]) for i, name in enumerate(order)}


#: every method name, paper's first (read when this module is imported)
METHODS = tuple(methods())
