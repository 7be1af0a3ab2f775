"""Settings of the training-time token dump, read from the environment of every Ray worker.

The recipe passes ``recipe.token_dump.*`` (and ``recipe.method``) to every Ray worker as the
environment variables below; ``recipe.token_dump.dir=<run folder>`` turns it on for any method.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

#: ``recipe.token_dump.dir``: the run folder; empty or unset: the dump is off
DIR_ENV = "STAPO_TOKEN_DUMP_DIR"
#: ``recipe.token_dump.responses``: responses sampled per data-parallel rank and step (>= 1)
RESPONSES_ENV = "STAPO_TOKEN_DUMP_RESPONSES"
#: ``recipe.token_dump.context``: tokens of context each side of a token (>= 0)
CONTEXT_ENV = "STAPO_TOKEN_DUMP_CONTEXT"
#: ``recipe.token_dump.ids``: ``true``: response records also carry ``prompt_ids`` / ``response_ids``
#: (for exact offline re-scoring; larger files)
IDS_ENV = "STAPO_TOKEN_DUMP_IDS"
#: ``recipe.method``: the records' ``method`` (default: the policy loss mode)
METHOD_ENV = "STAPO_TOKEN_DUMP_METHOD"
DEFAULT_RESPONSES = 4
DEFAULT_CONTEXT = 16
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def enabled() -> bool:
    return bool(os.environ.get(DIR_ENV, ""))


@dataclass(frozen=True)
class DumpSettings:
    """run_dir: the run folder; responses: K per rank; context: tokens each side; ids: store the
    sequences' token ids in the response records; method: the records' ``method`` (None: loss mode)."""

    run_dir: Path
    responses: int = DEFAULT_RESPONSES
    context: int = DEFAULT_CONTEXT
    ids: bool = False
    method: Optional[str] = None


def _int_setting(env: Mapping[str, str], name: str, key: str, default: int, minimum: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"token dump: {key}={raw!r} (env {name}) must be an integer >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"token dump: {key}={value} (env {name}) must be an integer >= {minimum}")
    return value


def settings_from_env(env: Optional[Mapping[str, str]] = None) -> DumpSettings:
    """ValueError when the dump is off, or for a malformed value (naming the config key and the variable)."""
    env = os.environ if env is None else env
    run_dir = env.get(DIR_ENV, "")
    if not run_dir:
        raise ValueError(f"token dump is off: set recipe.token_dump.dir (env {DIR_ENV}) to a run folder")
    ids = env.get(IDS_ENV, "").strip().lower()
    if ids not in _TRUE + _FALSE:
        raise ValueError(f"token dump: recipe.token_dump.ids={env.get(IDS_ENV)!r} (env {IDS_ENV}) must be true or false "
                         "(or 1/0, yes/no, on/off)")
    return DumpSettings(
        run_dir=Path(run_dir),
        responses=_int_setting(env, RESPONSES_ENV, "recipe.token_dump.responses", DEFAULT_RESPONSES, 1),
        context=_int_setting(env, CONTEXT_ENV, "recipe.token_dump.context", DEFAULT_CONTEXT, 0),
        ids=ids in _TRUE,
        method=env.get(METHOD_ENV) or None,
    )
