"""How the suite is spread over pytest-xdist workers: units of work, sent longest first.

A unit goes whole to one worker: a test module, or every reader of the shared trainer runs
(tests/helpers/shared_runs.py) together. Units are sent in order of their seconds in a measured
run (:data:`UNIT_SECONDS_FILE`), longest first, then every other unit in collection order: a unit
of a few trainer runs sent last would leave one worker alone with it for minutes.

The table is regenerated from the durations pytest prints::

    bash run_scripts/test.sh --durations=0 | tee suite.log
    python -m tests.helpers.scheduling suite.log
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

UNIT_SECONDS_FILE = Path(__file__).with_name("unit_seconds.json")
#: a unit whose tests took fewer seconds than this is left out of the table (sent in collection order)
TABLE_FLOOR_S = 20.0
_DURATION = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+)")


def unit_of_work(nodeid: str) -> str:
    """The xdist unit a test belongs to: ``shared_runs`` or its module's path."""
    from tests.helpers.shared_runs import reads_shared_runs

    return "shared_runs" if reads_shared_runs(nodeid) else nodeid.split("::", 1)[0]


def unit_seconds_from_durations(lines: Iterable[str]) -> dict[str, float]:
    """Seconds per unit summed over the ``--durations`` lines of a pytest report (setup, call and
    teardown), the units above :data:`TABLE_FLOOR_S`, longest first."""
    seconds: dict[str, float] = {}
    for line in lines:
        match = _DURATION.match(line)
        if match:
            unit = unit_of_work(match.group(3))
            seconds[unit] = seconds.get(unit, 0.0) + float(match.group(1))
    kept = {unit: round(s, 1) for unit, s in seconds.items() if s >= TABLE_FLOOR_S}
    return dict(sorted(kept.items(), key=lambda item: -item[1]))


def load_unit_seconds(path: Path = UNIT_SECONDS_FILE) -> dict[str, float]:
    """The measured table ({} when the file is absent)."""
    return json.loads(path.read_text()) if path.exists() else {}


def longest_first(nodeids: Sequence[str], unit_seconds: dict[str, float]) -> list[int]:
    """The order (indices into ``nodeids``) that puts each unit's tests together, the units of the
    table longest first, then the others in the order their first test was collected; inside a unit
    the collection order is kept."""
    first_seen: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        first_seen.setdefault(unit_of_work(nodeid), i)

    def key(i: int) -> tuple[float, int, int]:
        unit = unit_of_work(nodeids[i])
        return (-unit_seconds.get(unit, 0.0), first_seen[unit], i)

    return sorted(range(len(nodeids)), key=key)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m tests.helpers.scheduling SUITE_LOG  (a log of the suite run with --durations=0)",
              file=sys.stderr)
        return 2
    table = unit_seconds_from_durations(Path(args[0]).read_text().splitlines())
    if not table:
        print(f"error: no --durations lines of {TABLE_FLOOR_S:.0f} s or more in {args[0]}", file=sys.stderr)
        return 1
    UNIT_SECONDS_FILE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{UNIT_SECONDS_FILE}: {len(table)} units, {sum(table.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
