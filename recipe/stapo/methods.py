"""The recipe's methods, read from ``config/method/*.yaml``: a method is its YAML file.

Each file names the method (``recipe.method``, the file's stem), its row in the paper's results
table (``recipe.table_row``: the order in which methods are listed, run and plotted) and, when it
selects tokens, its rule (``actor_rollout_ref.actor.policy_loss.token_selection``). Adding a
method is adding a file; nothing else lists them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

METHOD_DIR = Path(__file__).resolve().parent / "config" / "method"
TOKEN_SELECTION_KEY = "actor_rollout_ref.actor.policy_loss.token_selection"
#: one colour per table row, the same in every panel and figure (matplotlib's first four, then more)
ROW_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
              "tab:olive", "tab:cyan")


@dataclass(frozen=True)
class Method:
    """name: ``method=<name>``; table_row: its row in the results table (1-based); token_selection:
    ``none`` or a rule of :data:`stapo_core.rules.RULES`."""

    name: str
    table_row: int
    token_selection: str

    @property
    def color(self) -> str:
        return ROW_COLORS[(self.table_row - 1) % len(ROW_COLORS)]


@functools.lru_cache(maxsize=None)
def methods() -> dict[str, Method]:
    """Every method, in table order (a file whose ``recipe.method`` is not its stem, or without a
    ``recipe.table_row``, is refused naming the file)."""
    found = []
    for path in sorted(METHOD_DIR.glob("*.yaml")):
        config = OmegaConf.load(path)
        name, row = OmegaConf.select(config, "recipe.method"), OmegaConf.select(config, "recipe.table_row")
        if name != path.stem or not isinstance(row, int) or isinstance(row, bool):
            raise ValueError(f"{path}: expected recipe.method: {path.stem} and an integer recipe.table_row, got "
                             f"recipe.method={name!r}, recipe.table_row={row!r}")
        found.append(Method(name, row, str(OmegaConf.select(config, TOKEN_SELECTION_KEY, default="none"))))
    return {m.name: m for m in sorted(found, key=lambda m: (m.table_row, m.name))}


#: the method names in table order
METHODS = tuple(methods())
