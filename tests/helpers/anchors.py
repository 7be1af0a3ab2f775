"""What a patch table's entry must say about what it relies on, for ``python -m <table> check``."""

from __future__ import annotations

import inspect
from typing import Optional

from verl_patches.registry import Patch, _owner_and_attr, original_of


def anchor_problem(patch: Patch) -> Optional[str]:
    """None when ``patch`` has anchors and, wrapping a function, its first anchor is that function's own
    ``def`` line (or its beginning: as much as the wrapper relies on), read from the installed source;
    else what is wrong. Imports the target's module."""
    if not patch.anchors:
        return f"{patch.name}: no anchors"
    owner, attr = _owner_and_attr(patch.target)
    original = inspect.unwrap(original_of(getattr(owner, attr)))
    if patch.kind == "register" or not inspect.isfunction(original):
        return None
    header = patch.anchors[0].rpartition(".py: ")[2]
    source = " ".join(inspect.getsource(original).split())
    if not header.removeprefix("async ").startswith(f"def {attr}(") or header not in source:
        return f"{patch.name}: first anchor {header!r} is not the def line of {patch.target}"
    return None
