"""The spurious-token dump: its records, its files and the four-quadrant counts.

Written by the actor hook (``verl_patches.token_dump.hook``) and read by the inspector and the
quickstart, so the format and the numbers come from one place. Plain Python + numpy: reading a dump
never imports verl.

* :mod:`.schema`: ``kind = "token"`` records (one per candidate token of a sampled response) and
  ``kind = "response"`` records (one per sampled response), their fields and validation;
* :mod:`.files`: one JSON Lines file per step, ``RUN_DIR/s2t_tokens/step_{step:06d}.jsonl``;
* :mod:`.quadrants`: the low/high probability x low/high entropy counts of a response's tokens.
"""

from .files import STEP_FILE_PATTERN, TOKEN_DUMP_DIR, Dump, dump_files, read_dump, step_file, write_step
from .quadrants import entropy_split, quadrant_counts, response_record
from .schema import QUADRANTS, RecordError, validate_record, validate_response_record, validate_token_record

__all__ = [
    "QUADRANTS",
    "STEP_FILE_PATTERN",
    "TOKEN_DUMP_DIR",
    "Dump",
    "RecordError",
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
