"""The spurious-token dump: its records, its files and the four-quadrant counts.

The actor hook (``verl_patches.token_dump.hook``) writes, during training, what S2T saw; the
inspector (``python -m recipe.stapo.inspect``) and the quickstart read it. All of them use this
package, so the format and the numbers come from one place. Plain Python + numpy, at the bottom of
the import graph, so that reading a dump never imports verl.

* :mod:`.schema`: the records. :class:`TokenRecord` (``kind = "token"``), one per candidate token of
  a sampled response: ``prob`` and ``entropy`` of the policy at that position, the response's
  ``advantage``, S2T's ``candidate`` / ``silenced`` flags, ``grad_norm`` = the closed-form
  logit-gradient norm per unit weight ``sqrt(1 - 2 p_k + sum_n p_n^2)``
  (:func:`stapo_core.logit_grad_norm`), the policy's ``top5`` alternatives and ``dlogp``, the change
  of the token's log-probability across the update that followed.
  :class:`ResponseRecord` (``kind = "response"``), one per sampled response: its ``advantage``,
  ``n_tokens``, the thresholds ``tau_p`` / ``tau_h`` of its step and the four quadrants of its
  tokens (count, gradient-norm sum, ``dlogp`` sum). :func:`validate_record` checks either kind.
* :mod:`.files`: one JSON Lines file per training step, ``RUN_DIR/s2t_tokens/step_{step:06d}.jsonl``
  (:func:`step_file`), written by :func:`write_step` and read by :func:`read_dump`.
* :mod:`.quadrants`: :func:`quadrant_counts` (low/high probability x low/high entropy) and
  :func:`response_record`, which builds a response's record from its per-token arrays.
"""

from .files import STEP_FILE_PATTERN, TOKEN_DUMP_DIR, Dump, dump_files, read_dump, step_file, write_step
from .quadrants import entropy_split, quadrant_counts, response_record
from .schema import (
    QUADRANTS,
    Record,
    RecordError,
    ResponseRecord,
    TokenRecord,
    validate_record,
    validate_response_record,
    validate_token_record,
)

__all__ = [
    "QUADRANTS",
    "STEP_FILE_PATTERN",
    "TOKEN_DUMP_DIR",
    "Dump",
    "Record",
    "RecordError",
    "ResponseRecord",
    "TokenRecord",
    "dump_files",
    "entropy_split",
    "quadrant_counts",
    "read_dump",
    "response_record",
    "step_file",
    "validate_record",
    "validate_response_record",
    "validate_token_record",
    "write_step",
]
