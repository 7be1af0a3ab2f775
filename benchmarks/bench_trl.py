"""STAPOTrainer's step time over TRL's GRPOTrainer's, measured in one run on the tiny model.

::

    python -m benchmarks.bench_trl [--steps 6] [--rounds 3] [--threads 1] [--json rows.json]
    python -m benchmarks.bench_trl --quick          # seconds: what tests/benchmarks runs
    # options: --model DIR --data FILE.parquet --batch N --max-completion-length N

Trains TRL's ``GRPOTrainer`` (``grpo``, the reference) and ``STAPOTrainer`` three ways (:data:`TRAINERS`:
the paper's settings with the statistics forward over the positive-advantage completions, over every
completion, and ``tau_p=0`` with no forward) with the same seed, data and settings, the order rotated by
one per round; ``update`` = TRL's ``step_time`` - the generation's time, where everything S2T adds lies.
What is timed, how the ratios are taken and the measured numbers: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from benchmarks.common import markdown_table, positive, rotated
from stapo_core.fileio import atomic_write

#: trainer name -> (STAPO's settings, or None for GRPOTrainer)
TRAINERS = {
    "grpo": None,
    "stapo": {},
    "stapo-full": {"current_forward": "full"},
    "stapo-tau0": {"tau_p": 0.0},
}


@dataclass
class Row:
    """One trainer over every round: medians in seconds, ratios to ``grpo`` (median over rounds)."""

    trainer: str
    step_s: float
    step_ratio: float
    update_s: float
    update_ratio: float
    forward_s: float
    forwarded_tokens_frac: float
    silenced: float
    steps: int


def reward_boxed(completions, reward_model, **kwargs) -> list[float]:
    """1 when the completion boxes the right sum (``\\boxed{63}``), else 0."""
    return [float(f"\\boxed{{{truth['ground_truth']}}}" in completion[0]["content"])
            for completion, truth in zip(completions, reward_model)]


def timed(trainer_cls):
    """``trainer_cls`` recording the wall time of each generation (``bench_generation_s``)."""

    class Timed(trainer_cls):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.bench_generation_s = getattr(self, "bench_generation_s", []) + [time.perf_counter() - start]
            return out

    return Timed


def train_one(name: str, model: str, dataset, out: str, steps: int, batch: int, max_completion_length: int) -> dict:
    """One run of trainer ``name``: per step (first skipped), ``step``, ``update``, ``forward``,
    ``frac``, ``silenced`` lists."""
    # TRL (the trl extra) and the trainers built on it, imported when a run starts (a fast --help)
    from trl import GRPOConfig, GRPOTrainer
    from stapo_trl import STAPOConfig, STAPOTrainer
    from transformers import PrinterCallback

    stapo = TRAINERS[name]
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if stapo is None else (STAPOConfig, STAPOTrainer)
    args = config_cls(output_dir=out, bf16=False, use_cpu=True, seed=0, max_steps=steps, learning_rate=1e-4,
                      epsilon_high=0.28, delta=10.0, num_generations=batch, per_device_train_batch_size=batch,
                      max_completion_length=max_completion_length, logging_steps=1, save_strategy="no",
                      report_to="none", disable_tqdm=True, **(stapo or {}))
    trainer = timed(trainer_cls)(model=model, reward_funcs=reward_boxed, args=args, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # the table is the output, not every step's log line
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    generation = trainer.bench_generation_s
    if len(logs) != steps or len(generation) != steps:
        raise RuntimeError(f"bench_trl: {name} logged {len(logs)} steps and {len(generation)} generations, "
                           f"expected {steps} of each")
    kept = list(zip(logs, generation))[1:]
    return {
        "step": [h["step_time"] for h, _ in kept],
        "update": [h["step_time"] - g for h, g in kept],
        "forward": [h.get("s2t/current_forward_s", 0.0) for h, _ in kept],
        "frac": [h.get("s2t/current_forward_tokens_frac", 0.0) for h, _ in kept],
        "silenced": [h.get("s2t/silenced", 0.0) for h, _ in kept],
    }


def summarize(rounds: list[dict]) -> list[Row]:
    """``rounds``: per round, trainer name -> :func:`train_one`'s lists. Rows in TRAINERS' order."""
    rows = []
    for name in TRAINERS:
        per_round = [r[name] for r in rounds]

        def ratio(key):
            return statistics.median(statistics.median(r[name][key]) / statistics.median(r["grpo"][key])
                                     for r in rounds)

        def pooled(key):
            return statistics.median(v for run in per_round for v in run[key])

        rows.append(Row(name, pooled("step"), ratio("step"), pooled("update"), ratio("update"), pooled("forward"),
                        pooled("frac"), sum(v for run in per_round for v in run["silenced"]) / len(per_round),
                        sum(len(run["step"]) for run in per_round)))
    return rows


def table(rows: Sequence[Row]) -> str:
    header = ("trainer", "step s", "ratio step", "update s", "ratio update", "statistics forward s",
              "forwarded tokens frac", "silenced per run", "steps timed")
    return markdown_table(header, ((r.trainer, f"{r.step_s:.3f}", f"{r.step_ratio:.3f}", f"{r.update_s:.3f}",
                                    f"{r.update_ratio:.3f}", f"{r.forward_s:.4f}", f"{r.forwarded_tokens_frac:.3f}",
                                    f"{r.silenced:g}", r.steps) for r in rows))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive(int), default=6, help="optimizer steps per run (the first is skipped)")
    p.add_argument("--rounds", type=positive(int), default=3, help="runs of every trainer, order rotated")
    p.add_argument("--batch", type=positive(int), default=8, help="completions per step (one prompt's group)")
    p.add_argument("--max-completion-length", type=positive(int), default=128)
    p.add_argument("--threads", type=positive(int), default=1, help="torch threads")
    p.add_argument("--model", default=None, help="model folder (default: the shipped tiny Qwen3)")
    p.add_argument("--data", default=None, help="training parquet in verl's format (default: the shipped task)")
    p.add_argument("--out", default="results/bench_trl", help="the runs' output folders")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--quick", action="store_true", help="2 steps, 1 round, 4 completions of <= 96 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.batch, args.max_completion_length = 2, 1, 4, 96
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first step is skipped as warm-up), got {args.steps}")

    # the measured stack and the shipped assets, imported once the arguments are known (a fast --help)
    import torch
    from datasets import load_dataset
    from stapo_cpu.assets import SHIPPED_DIR

    torch.set_num_threads(args.threads)
    model = args.model or str(SHIPPED_DIR / "model")
    dataset = load_dataset("parquet", data_files=args.data or str(SHIPPED_DIR / "train.parquet"), split="train")
    rounds = []
    for k in range(args.rounds):
        rounds.append({name: train_one(name, model, dataset, f"{args.out}/{k}-{name}", args.steps, args.batch,
                                       args.max_completion_length) for name in rotated(list(TRAINERS), k)})
    rows = summarize(rounds)
    print(f"bench_trl: {args.rounds} round(s) x {args.steps} steps, {args.batch} completions of <= "
          f"{args.max_completion_length} tokens per step, {args.threads} torch thread(s), model {model}")
    print(table(rows), end="")
    if args.json:
        atomic_write(args.json, json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(math.isfinite(r.step_ratio) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
