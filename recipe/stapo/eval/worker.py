"""One data-parallel evaluation worker (:mod:`recipe.stapo.eval.parallel` starts it).

``python -m recipe.stapo.eval.worker --plan OUT/workers/rank<r>/plan.json`` generates the samples
its plan lists into its part files ``OUT/workers/rank<r>/generations/<bench>__<decoding>.jsonl``,
with the run's backend settings (the plan holds the run's ``EvalConfig``) on the GPUs its
``CUDA_VISIBLE_DEVICES`` names.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from recipe.stapo.eval.backends import LazyBackend, SamplingConfig
from recipe.stapo.eval.generate import JsonlStore, generate_items
from recipe.stapo.eval.run_eval import DECODINGS, EvalConfig, backend_factory, load_problems


def run_plan(plan_path: str | Path) -> int:
    """A worker: generate the samples of its plan into its part files. Returns the number made."""
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    config = EvalConfig(**{k: tuple(v) if k in ("decodings", "benchmarks") else v for k, v in plan["config"].items()})
    folder = Path(plan_path).parent
    backend = LazyBackend(backend_factory(config))  # built for the first block
    made = 0
    by_block: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for decoding, bench, problem_id, sample in plan["items"]:
        by_block.setdefault((decoding, bench), []).append((problem_id, sample))
    try:
        for (decoding, bench), wanted in by_block.items():
            catalog = {p.problem_id: p for p in load_problems(Path(config.benchmarks_dir) / f"{bench}.parquet")}
            missing = [pid for pid, _ in wanted if pid not in catalog]
            if missing:
                raise ValueError(f"{plan_path}: problem {missing[0]!r} of {bench} is not in {config.benchmarks_dir}")
            temperature, top_p = DECODINGS[decoding]
            made += len(generate_items(
                backend, [(catalog[pid], s) for pid, s in wanted], SamplingConfig(temperature, top_p, config.max_new_tokens),
                JsonlStore(folder / "generations" / f"{bench}__{decoding}.jsonl"), bench, decoding, config.seed,
                config.batch_size,
            ))
    finally:  # a vLLM engine's processes end with the worker's work
        backend.release()
    return made


def _exit_on_sigterm(signum: int, _frame) -> None:
    """SIGTERM (the main process died: the parent-death signal :mod:`recipe.stapo.eval.parallel`
    sets) unwinds the worker like an error, so :func:`run_plan` closes its backend: a vLLM engine's
    processes end with it instead of running on, orphaned. Once: the signal comes again each time the
    worker passes to another of the dying main process's threads, and a second unwind would cut the
    first one's closing of the engine short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.eval.worker", description="one data-parallel evaluation worker")
    parser.add_argument("--plan", required=True, help="the plan.json the main process wrote")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    made = run_plan(args.plan)
    print(f"[eval] worker done: {made} samples", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
