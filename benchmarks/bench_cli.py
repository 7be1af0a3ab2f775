"""How fast every command-line tool of the project answers ``--help``, as a ratio to starting Python
and importing torch (the floor: every tool imports torch through ``stapo_core``).

    python -m benchmarks.bench_cli             # every tool, 3 rounds
    python -m benchmarks.bench_cli --quick     # every tool, 1 round

A last row times the preflight of a paper run (``STAPO_DRY_RUN=check``). The tools are found, not
listed (:func:`tools`); each round runs the reference (``python -c "import torch"``) and every tool
once, in a rotated order, and a tool's ratio is the median over rounds of its time over the same
round's reference. What the numbers show: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.common import markdown_table, positive, rotated

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("import torch", [sys.executable, "-c", "import torch"])
#: the preflight of a paper run (no data here: it refuses the missing files, after every check ran);
#: most of its time is ``import verl`` with the recipe's patches, which every run pays anyway
PREFLIGHT = ("preflight: STAPO_DRY_RUN=check bash run_scripts/qwen3_8b_stapo.sh",
             ["env", "STAPO_DRY_RUN=check", f"PYTHON={sys.executable}", "bash", "run_scripts/qwen3_8b_stapo.sh"])
#: tools that parse their own command line without argparse
EXTRA_TOOLS = ("recipe.stapo.main_stapo", "recipe.stapo.driver")


def tools(root: Path = REPO_ROOT) -> list[str]:
    """Every ``python -m`` tool of the project: :data:`EXTRA_TOOLS` and each module of ``recipe/``,
    ``stapo_cpu/``, ``stapo_memory/`` and ``benchmarks/`` that has a ``__main__`` block and uses argparse."""
    found = set(EXTRA_TOOLS)
    for folder in ("recipe", "stapo_cpu", "stapo_memory", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            if "__name__ == \"__main__\"" in text and "argparse" in text:
                found.add(".".join(path.relative_to(root).with_suffix("").parts))
    return sorted(found)


def run_once(command: list[str]) -> tuple[float, int, int]:
    """Wall seconds, exit status and number of output lines of one ``command``."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode, len((done.stdout + done.stderr).splitlines())


def measure(names: Sequence[str], rounds: int, progress=print, preflight: bool = False) -> list[dict]:
    """One row per tool: median seconds, median ratio to the reference, exit status, help lines
    (``preflight``: a row for :data:`PREFLIGHT` too)."""
    commands = [REFERENCE] + [(name, [sys.executable, "-m", name, "--help"]) for name in names]
    commands += [PREFLIGHT] if preflight else []
    times: dict[str, list[float]] = {label: [] for label, _ in commands}
    status: dict[str, tuple[int, int]] = {}
    for r in range(rounds):
        order = rotated(commands, r)
        for i, (label, command) in enumerate(order):
            seconds, code, lines = run_once(command)
            times[label].append(seconds)
            status[label] = (code, lines)
            progress(f"[bench_cli] round {r + 1}/{rounds}, {i + 1}/{len(order)}: {label} {seconds:.2f} s")
    reference = times[REFERENCE[0]]
    return [{"tool": label, "median_s": statistics.median(times[label]),
             "ratio": statistics.median(t / ref for t, ref in zip(times[label], reference)),
             "exit": status[label][0], "lines": status[label][1]} for label, _ in commands]


def table(rows: Sequence[dict]) -> str:
    header = ("tool", "`--help` median s", "ratio to `import torch`", "exit", "lines")
    return markdown_table(header, ((r["tool"], f"{r['median_s']:.2f}", f"{r['ratio']:.2f}", r["exit"], r["lines"])
                                   for r in rows))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cli", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=positive(int), default=3, help="timed rounds (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="one round (the smoke test)")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    rows = measure(tools(), rounds, progress=lambda line: print(line, file=sys.stderr), preflight=True)
    print(f"bench_cli: {rounds} round(s), {sys.executable}\n")
    print(table(rows), end="")
    failed = [r["tool"] for r in rows if r["exit"] != 0 and r["tool"] != PREFLIGHT[0]]
    if failed:
        print(f"\n--help failed for: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
