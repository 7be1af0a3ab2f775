"""Functions a test runs inside a guard helper process (picklable by name; this module imports only
the standard library, so loading it tells nothing about what the helper imported)."""

import sys


def imported(names):
    """Which of ``names`` the calling process has imported, sorted."""
    return sorted(name for name in names if name in sys.modules)
