"""verl beside TRL 1.x in one environment (the ``trl`` extra of the recipe's TRL adapter).

verl 0.9.1's ``apply_monkey_patch`` imports TRL's ``AutoModelForCausalLMWithValueHead`` (to patch
its ``state_dict``) whenever TRL is installed; TRL 1.x no longer has that class, so every model
build failed with an ``ImportError``. The recipe trains no value head, so verl is told TRL is not
there when the class is missing.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def has_value_head_model() -> bool:
    """The installed TRL has ``AutoModelForCausalLMWithValueHead`` where verl looks for it."""
    try:
        if importlib.util.find_spec("trl.experimental.ppo") is not None:
            return True
    except ImportError:
        return False
    import trl  # optional dependency (the trl extra); found above, imported only here

    return hasattr(trl, "AutoModelForCausalLMWithValueHead")


def wrap_is_trl_available(is_trl_available):
    """verl's ``is_trl_available``, false when TRL lacks the value-head class."""

    @functools.wraps(is_trl_available)
    def wrapped() -> bool:
        return bool(is_trl_available()) and has_value_head_model()

    return wrapped
