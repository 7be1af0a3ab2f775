"""Training-time dump of candidate tokens (issue 6): placeholder until the helper delivers it."""

import os

DIR_ENV = "STAPO_TOKEN_DUMP_DIR"


def enabled() -> bool:
    return bool(os.environ.get(DIR_ENV, ""))


def dump_mini_batch(worker, data, response_mask, cfg) -> dict:
    raise NotImplementedError("token dump not implemented yet")
