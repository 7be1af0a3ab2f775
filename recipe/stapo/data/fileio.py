"""Moved to :mod:`stapo_core.fileio` (one home for the file helpers); this name is kept until its
last importers are updated."""

from stapo_core.fileio import atomic_write, atomic_write_json, atomic_write_text, sha256_file  # noqa: F401
