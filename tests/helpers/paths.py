"""Where the repository is, for tests that run its scripts or read its files."""

from pathlib import Path

#: the repository root (the folder holding README.md)
REPO = Path(__file__).resolve().parents[2]
