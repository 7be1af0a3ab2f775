"""Cost of S2T's current-policy statistics (``stats_from=current``) per step: measured on CPU, and
modelled at the paper's scale.

::

    python -m benchmarks.bench_current_stats [--out results/bench_current_stats] [--steps 6] [--mini-batches 4]
    python -m benchmarks.bench_current_stats --simulate [--ranks 64] [--accuracy 0.2,0.5,0.8]

Training (the default) runs STAPO three times with verl's real trainer and identical seeds (:data:`RUNS`)
and prints each phase's median step time against the rollout run, with the logged statistics forward;
``--simulate`` models the paper's scale (:func:`simulate`). The cost model and the measured numbers:
benchmarks/README.md and docs/method.md.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import common
from benchmarks.common import median, positive
from benchmarks.bench_e2e import compare, markdown_table
from recipe.stapo.metrics import read_metrics

#: the three CPU runs: name -> overrides
RUNS = {
    "rollout": ["actor_rollout_ref.actor.policy_loss.stats_from=rollout"],
    "full": ["actor_rollout_ref.actor.policy_loss.stats_from=current",
             "actor_rollout_ref.actor.policy_loss.current_forward=full"],
    "positive": ["actor_rollout_ref.actor.policy_loss.stats_from=current",
                 "actor_rollout_ref.actor.policy_loss.current_forward=positive_advantage"],
}
FRAC = "actor/s2t/current_forward_tokens_frac"
SECONDS = "actor/s2t/current_forward_s"


def expected_share(mini_batches: int, checkpointing: bool = True, forwarded: float = 1.0) -> float:
    """FLOPs of the extra forwards over the update's forward + backward: ``(M - 1) / M x f`` of one
    old-log-prob pass (the first mini-batch needs none; ``f`` the forwarded share), a forward being
    ~1/3 of a forward + backward, ~1/4 with gradient checkpointing."""
    return (mini_batches - 1) * forwarded / ((4 if checkpointing else 3) * mini_batches)


def measured_share(rollout_steps: dict[int, dict], mini_batches: int, warmup_steps: int = 1,
                   forwarded: float = 1.0) -> float:
    """``(M - 1) / M x f x old_log_prob / update_actor`` (median over steps) of the rollout run."""
    ratios = [data["timing_s/old_log_prob"] / data["timing_s/update_actor"] * (mini_batches - 1) / mini_batches
              * forwarded for step, data in sorted(rollout_steps.items())[warmup_steps:]
              if data.get("timing_s/update_actor") and "timing_s/old_log_prob" in data]
    return median(ratios)


def logged_median(steps: dict[int, dict], key: str, warmup_steps: int = 1) -> float:
    """Median over the steps after ``warmup_steps`` of a logged metric (NaN when never logged)."""
    values = [data[key] for _, data in sorted(steps.items())[warmup_steps:] if key in data]
    return median(values)


def train(out: Path, steps: int, mini_batches: int, name: str):
    from stapo_cpu.trainer import run_cpu_trainer
    from stapo_cpu.assets import build_assets

    assets = build_assets(out / "assets").root
    prompts = 2 * mini_batches
    return run_cpu_trainer("stapo", assets, out / name, steps=steps, prompts=prompts, mini_batch_prompts=2,
                           extra=[*RUNS[name], "actor_rollout_ref.actor.policy_loss.tau_p=0.5"])


def simulate(accuracy: float, *, ranks: int = 64, prompts: int = 256, n: int = 8, mini_batches: int = 4,
             steps: int = 4, budget: int = 49152, prompt_len: int = 200, median_response: int = 4000,
             sigma: float = 0.7, max_response: int = 15360, seed: int = 0) -> dict[str, float]:
    """Medians over the model's mini-batches: ``f`` (positive-advantage share of the tokens), the full
    forward's busiest rank over its mean rank (verl balances a step's batch, not each mini-batch) and,
    for the ``own`` (each rank its own positive-advantage sequences) and ``balanced``
    (:func:`stapo_core.balance.plan_forward`) forwards, the busiest rank's tokens and the micro-batch
    count relative to the full forward's."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    from stapo_core.balance import Item, plan_forward, split_micro_batches

    rng = random.Random(seed)
    rows = {"f": [], "full_imbalance": [], "own_tokens": [], "balanced_tokens": [], "own_micro": [],
            "balanced_micro": []}
    concentration = 2.0  # prompt accuracies ~ Beta(mean * c, (1 - mean) * c): some easy, some hard
    for _ in range(steps):
        lengths, positive = [], []
        for _ in range(prompts):
            p = rng.betavariate(accuracy * concentration, (1 - accuracy) * concentration)
            rewards = [1.0 if rng.random() < p else 0.0 for _ in range(n)]
            mean = sum(rewards) / n
            for r in rewards:
                lengths.append(prompt_len + min(max_response, int(rng.lognormvariate(math.log(median_response), sigma))))
                positive.append(r > mean)  # GRPO: A > 0 iff better than the group mean (uniform groups: A = 0)
        workload = calculate_workload(torch.tensor(lengths)).tolist()
        partitions = get_seqlen_balanced_partitions(workload, k_partitions=ranks, equal_size=True)
        per_mini = len(partitions[0]) // mini_batches
        for k in range(mini_batches):
            held = [part[k * per_mini:(k + 1) * per_mini] for part in partitions]
            full = [sum(lengths[i] for i in rows_r) for rows_r in held]
            items = [Item(r, i, lengths[i]) for r, rows_r in enumerate(held) for i in rows_r if positive[i]]
            if not items:
                continue
            own = [sum(it.tokens for it in items if it.owner == r) for r in range(ranks)]
            plan = plan_forward(items, ranks, max_tokens=budget)

            def micro(shares):
                return max(len(split_micro_batches(sorted(s, key=lambda it: -it.tokens), max_tokens=budget))
                           for s in shares)

            full_micro = micro([[Item(r, i, lengths[i]) for i in rows_r] for r, rows_r in enumerate(held)])
            own_micro = max(1, micro([[it for it in items if it.owner == r] for r in range(ranks)]))
            rows["f"].append(sum(it.tokens for it in items) / sum(full))
            rows["full_imbalance"].append(max(full) / (sum(full) / ranks))
            rows["own_tokens"].append(max(own) / max(full))
            rows["balanced_tokens"].append(max(plan.rank_tokens()) / max(full))
            rows["own_micro"].append(own_micro / full_micro)
            rows["balanced_micro"].append(plan.num_micro_batches / full_micro)
    return {key: statistics.median(values) for key, values in rows.items()}


def simulation_table(accuracies: Sequence[float], **kwargs) -> str:
    header = ("mean accuracy", "f: positive-advantage share of tokens", "full: busiest / mean rank",
              "busiest rank, own sequences / full", "busiest rank, balanced / full", "micro-batches, own / full",
              "micro-batches, balanced / full")
    keys = ("f", "full_imbalance", "own_tokens", "balanced_tokens", "own_micro", "balanced_micro")
    rows = []
    for accuracy in accuracies:
        r = simulate(accuracy, **kwargs)
        rows.append([f"{accuracy:.1f}", *(f"{r[key]:.2f}" for key in keys)])
    return common.markdown_table(header, rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_current_stats", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/bench_current_stats"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mini-batches", type=positive(int), default=4)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--simulate", action="store_true", help="model the paper's scale instead of training on CPU")
    p.add_argument("--ranks", type=positive(int), default=64)
    p.add_argument("--accuracy", default="0.2,0.5,0.8", help="mean accuracies to model (comma-separated)")
    p.add_argument("--sim-steps", type=int, default=4)
    args = p.parse_args(argv)
    if args.simulate:
        try:
            accuracies = [float(a) for a in args.accuracy.split(",")]
        except ValueError:
            accuracies = []
        if not accuracies or not all(0.0 < a < 1.0 for a in accuracies):
            p.error(f"--accuracy={args.accuracy!r}: expected comma-separated numbers in (0, 1)")
        print(f"bench_current_stats --simulate: {args.ranks} ranks, 256 prompts x 8, {args.mini_batches} mini-batches, "
              f"{args.sim_steps} steps, medians over mini-batches\n")
        print(simulation_table(accuracies, ranks=args.ranks, mini_batches=args.mini_batches, steps=args.sim_steps),
              end="")
        return 0
    if args.steps <= args.warmup_steps:
        p.error("need --steps > --warmup-steps")
    runs = {}
    for name in RUNS:
        run = train(args.out, args.steps, args.mini_batches, name)
        if not run.ok:
            print(f"bench_current_stats: the {name} run failed; log tail:\n{run.tail()}", file=sys.stderr)
            return 1
        runs[name] = read_metrics(run.metrics)
    print(f"bench_current_stats: STAPO on CPU, {args.steps} steps x {args.mini_batches} mini-batches, median over "
          f"steps after {args.warmup_steps} warm-up step(s)\n")
    for method, baseline in (("full", "rollout"), ("positive", "rollout"), ("positive", "full")):
        print(f"### {method} / {baseline}\n")
        print(markdown_table(compare(runs[baseline], runs[method], warmup_steps=args.warmup_steps),
                             baseline=baseline, method=method))
        print()
    f = logged_median(runs["positive"], FRAC, args.warmup_steps)
    print(f"{FRAC}: median {f:.3f} (positive run); {logged_median(runs['full'], FRAC, args.warmup_steps):.3f} (full run)")
    full_s, positive_s = (logged_median(runs[name], SECONDS, args.warmup_steps) for name in ("full", "positive"))
    print(f"{SECONDS} (the statistics forward, mean over a step's later mini-batches): median {full_s:.3f} s (full), "
          f"{positive_s:.3f} s (positive): ratio {positive_s / full_s:.3f}")
    print(f"expected extra update cost from FLOPs: full {expected_share(args.mini_batches):.3f}, positive "
          f"{expected_share(args.mini_batches, forwarded=f):.3f} (gradient checkpointing); full "
          f"{expected_share(args.mini_batches, checkpointing=False):.3f}, positive "
          f"{expected_share(args.mini_batches, checkpointing=False, forwarded=f):.3f} (without)")
    print(f"measured here: (M-1)/M x f x old_log_prob / update_actor = full "
          f"{measured_share(runs['rollout'], args.mini_batches):.3f}, positive "
          f"{measured_share(runs['rollout'], args.mini_batches, forwarded=f):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
