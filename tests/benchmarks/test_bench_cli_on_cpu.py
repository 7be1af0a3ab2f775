"""``benchmarks.bench_cli``: finds every command-line tool, and no tool loads verl (which composing
the recipe's Hydra config does), vLLM, Ray or transformers to answer ``--help`` (what would make it
slow; the timing itself is the benchmark's to print, not a test's)."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import bench_cli
from tests.helpers.paths import REPO

#: run each tool's --help in one process, in turn, and report the heavy packages loaded after each
PROBE = """
import contextlib, io, json, runpy, sys
heavy = ("verl", "vllm", "ray", "transformers")
seen = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
    seen[name] = sorted(h for h in heavy if h in sys.modules)
print(json.dumps(seen))
"""


def test_tools_are_found_not_listed():
    found = bench_cli.tools()
    for expected in ("recipe.stapo.main_stapo", "stapo_cpu.quickstart", "stapo_cpu.assets", "recipe.stapo.eval.run_eval",
                     "recipe.stapo.data.prepare", "benchmarks.bench_loss", "benchmarks.bench_cli",
                     "stapo_memory.verdicts", "stapo_memory.calibration", "stapo_memory.bench_layer_memory"):
        assert expected in found
    assert "recipe.stapo.methods" not in found and "stapo_core.s2t" not in found


def test_no_tool_loads_verl_vllm_ray_or_transformers_for_help():
    names = bench_cli.tools()
    out = subprocess.run([sys.executable, "-c", PROBE, *names], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    loaded = {name: heavy for name, heavy in seen.items() if heavy}
    assert not loaded, f"--help loads heavy packages (first tool listed is the culprit): {loaded}"


def test_main_stapo_help_is_a_short_usage():
    out = subprocess.run([sys.executable, "-m", "recipe.stapo.main_stapo", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("usage: python -m recipe.stapo.main_stapo method=") and len(lines) < 40
    assert "grpo, entropy20, justrl, stapo" in out.stdout and "qwen3_8b" in out.stdout
    assert "docs/method.md" in out.stdout


def test_bench_cli_prints_a_ratio_per_tool(capsys):
    rows = bench_cli.measure(["stapo_memory.calibration"], rounds=1, progress=lambda _: None)
    assert [r["tool"] for r in rows] == ["import torch", "stapo_memory.calibration"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0 and rows[1]["exit"] == 0 and rows[1]["lines"] > 1
    text = bench_cli.table(rows)
    assert text.count("\n") == 4 and "| stapo_memory.calibration |" in text


def test_the_preflight_row_runs_the_paper_runs_check_and_names_what_it_found():
    rows = bench_cli.measure([], rounds=1, progress=lambda _: None, preflight=True)
    assert [r["tool"] for r in rows] == ["import torch", bench_cli.PREFLIGHT[0]]
    # no paper data here: the check runs to its end and refuses the missing files (exit 1), never a crash
    assert rows[1]["exit"] in (0, 1) and rows[1]["lines"] > 0 and rows[1]["median_s"] > 0
