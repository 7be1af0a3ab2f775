"""Cost of S2T's current-policy statistics (``stats_from=current``) against rollout ones, per step.

::

    python -m benchmarks.bench_current_stats [--out results/bench_current_stats] [--steps 6] [--mini-batches 4]

Trains STAPO twice on CPU with verl's real trainer and the tiny assets, identical settings and seeds,
``stats_from=rollout`` then ``stats_from=current`` (``--mini-batches`` PPO mini-batches per step, as
the paper's 4), and prints, from the two runs' ``timing_s/*`` metrics (same step: same data):

* the per-phase median step time of each and the median of the per-step ratios current / rollout;
  the extra forwards run inside ``update_actor``;
* the expected share on a GPU from FLOPs: the extra work is ``(M - 1) / M`` of one no-grad forward of
  the step's batch (the first mini-batch needs none); a forward is ~1/3 of a forward + backward, so
  against the update (``M`` forward + backward passes of ``1/M`` of the batch) it is
  ``(M - 1) / (3 M)`` without gradient checkpointing and ``(M - 1) / (4 M)`` with it (the recipe's
  setting: the backward recomputes the forward), before rollout generation is counted;
* the same ratio measured here: ``timing_s/old_log_prob`` (verl's own no-grad pass over the whole
  batch) times ``(M - 1) / M``, over ``timing_s/update_actor`` of the rollout run.

Peak memory: the extra forward is verl's own inference pass (``TrainingWorker.infer_batch``, the one
that computes the old log-probs, with the same micro-batch and token-budget settings), run outside
the update's autograd graph, so its peak is that pass's by construction.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.bench_e2e import compare, markdown_table
from recipe.stapo.metrics import read_metrics

STATS = ("rollout", "current")


def expected_share(mini_batches: int, checkpointing: bool = True) -> float:
    """FLOPs of the extra forwards over the update's forward + backward (see the module docstring)."""
    return (mini_batches - 1) / ((4 if checkpointing else 3) * mini_batches)


def measured_share(rollout_steps: dict[int, dict], mini_batches: int, warmup_steps: int = 1) -> float:
    """``(M - 1) / M * old_log_prob / update_actor`` (median over steps) of the rollout run."""
    ratios = [data["timing_s/old_log_prob"] / data["timing_s/update_actor"] * (mini_batches - 1) / mini_batches
              for step, data in sorted(rollout_steps.items())[warmup_steps:]
              if data.get("timing_s/update_actor") and "timing_s/old_log_prob" in data]
    return statistics.median(ratios) if ratios else math.nan


def train(out: Path, steps: int, mini_batches: int, stats_from: str):
    from recipe.stapo.cpu import run_cpu_trainer
    from recipe.stapo.cpu.assets import build_assets

    assets = build_assets(out / "assets").root
    prompts = 2 * mini_batches
    return run_cpu_trainer("stapo", assets, out / stats_from, steps=steps, prompts=prompts, mini_batch_prompts=2,
                           extra=[f"actor_rollout_ref.actor.policy_loss.stats_from={stats_from}",
                                  "actor_rollout_ref.actor.policy_loss.tau_p=0.5"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_current_stats", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/bench_current_stats"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps or args.mini_batches < 1:
        p.error("need --steps > --warmup-steps and --mini-batches >= 1")
    runs = {}
    for stats_from in STATS:
        run = train(args.out, args.steps, args.mini_batches, stats_from)
        if not run.ok:
            print(f"bench_current_stats: the {stats_from} run failed; log tail:\n{run.tail()}", file=sys.stderr)
            return 1
        runs[stats_from] = read_metrics(run.metrics)
    rows = compare(runs["rollout"], runs["current"], warmup_steps=args.warmup_steps)
    print(f"bench_current_stats: STAPO stats_from=current vs rollout, {args.steps} steps x {args.mini_batches} "
          f"mini-batches, median over steps after {args.warmup_steps} warm-up step(s)\n")
    print(markdown_table(rows, baseline="rollout", method="current"))
    agreement = [d["actor/s2t/rollout_agreement"] for d in runs["current"].values() if "actor/s2t/rollout_agreement" in d]
    print(f"expected extra update cost from FLOPs: {expected_share(args.mini_batches):.3f} (gradient checkpointing), "
          f"{expected_share(args.mini_batches, checkpointing=False):.3f} (without)")
    print(f"measured here: (M-1)/M x old_log_prob / update_actor = {measured_share(runs['rollout'], args.mini_batches):.3f}")
    if agreement:
        print(f"actor/s2t/rollout_agreement: mean {statistics.mean(agreement):.3f} over {len(agreement)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
