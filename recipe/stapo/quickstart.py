"""Quickstart on a machine without a GPU: GRPO, 20-Entropy, JustRL and STAPO, a few steps each.

::

    python -m recipe.stapo.quickstart [--out results/quickstart] [--assets assets/tiny] [--steps 5]

Builds (or reuses) the tiny assets, then trains every method with verl's real trainer on CPU
(:mod:`recipe.stapo.cpu`) under identical settings and seeds, one after the other, validating
on the held-out problems before training and after the last step. Writes into
``--out``: one run folder per method (verl's file-logger ``metrics.jsonl``, the run log,
checkpoints off), ``summary.md`` (final / mean reward, entropy, STAPO's silenced fraction, step
time, wall time per method, then what makes the run reproducible: seed, asset hash, library
versions, thread counts), ``summary.json`` (``methods``: the rows, ``reproducibility``: the same
record) and PNG plots of reward and entropy over steps.

A method whose run folder already holds a finished run with the same settings is not rerun
(``--force`` reruns everything); a failed method is reported in the summary and the others still
run. Exit status 1 when any method failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

from recipe.stapo.cpu import METHODS, read_metrics, run_cpu_trainer
from recipe.stapo.cpu import reproducibility
from recipe.stapo.cpu.assets import build_assets
from recipe.stapo.plots import plot_runs

REWARD = "critic/score/mean"
ENTROPY = "actor/entropy"
SILENCED = "actor/s2t/silenced_frac"
STEP_TIME = "timing_s/step"
DONE = "quickstart_done.json"


def _series(steps: dict[int, dict], key: str) -> list[float]:
    return [float(steps[s][key]) for s in sorted(steps) if key in steps[s] and steps[s][key] is not None]


def _fmt(value: Optional[float], digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}g}" if abs(value) < 1e-3 and value != 0 else f"{value:.{digits}f}"


def _validation_accuracy(data: dict) -> Optional[float]:
    """verl's validation accuracy in one step's record (``val-core/<source>/acc/mean@N``), if any."""
    values = [v for k, v in data.items() if k.startswith("val-core/") and "/acc/" in k]
    return sum(values) / len(values) if values else None


def summarise(method: str, steps: dict[int, dict], wall_s: Optional[float], error: Optional[str] = None) -> dict:
    """One summary row from a run's per-step metrics (means over the logged steps)."""
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    reward, entropy = _series(steps, REWARD), _series(steps, ENTROPY)
    silenced, step_time = _series(steps, SILENCED), _series(steps, STEP_TIME)
    validation = [_validation_accuracy(steps[s]) for s in sorted(steps)]
    validation = [v for v in validation if v is not None]
    return {
        "method": method, "steps": len(reward), "error": error, "wall_s": wall_s,
        "val_acc_first": validation[0] if validation else None, "val_acc_last": validation[-1] if validation else None,
        "final_reward": reward[-1] if reward else None, "mean_reward": mean(reward),
        "final_entropy": entropy[-1] if entropy else None, "mean_entropy": mean(entropy),
        "mean_silenced_frac": mean(silenced), "mean_step_s": mean(step_time),
    }


def markdown_table(rows: list[dict]) -> str:
    """The summary table (markdown)."""
    head = ("| method | steps | final reward | mean reward | final entropy | mean entropy | silenced frac (S2T) "
            "| val acc before -> after | mean step s | wall s |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['method']} | FAILED: {r['error']} | | | | | | | | |")
            continue
        lines.append(f"| {r['method']} | {r['steps']} | {_fmt(r['final_reward'])} | {_fmt(r['mean_reward'])} | "
                     f"{_fmt(r['final_entropy'])} | {_fmt(r['mean_entropy'])} | {_fmt(r['mean_silenced_frac'])} | "
                     f"{_fmt(r.get('val_acc_first'))} -> {_fmt(r.get('val_acc_last'))} | "
                     f"{_fmt(r['mean_step_s'], 2)} | {_fmt(r['wall_s'], 1)} |")
    return head + "\n".join(lines) + "\n"


def _settings(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "prompts": args.prompts, "n": args.n, "seed": args.seed, "tau_p": args.tau_p,
            "use_v1": args.trainer == "v1", "assets": str(Path(args.assets).resolve()), "validate": True,
            "token_dump": True}


def method_overrides(method: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Overrides beyond ``method=``: the token dump into the run folder (every method, for
    ``python -m recipe.stapo.inspect``) and STAPO's tau_p (see --tau-p), the only difference."""
    overrides = [f"recipe.token_dump.dir={run_dir}"]
    if method == "stapo":
        overrides.append(f"actor_rollout_ref.actor.policy_loss.tau_p={args.tau_p}")
    return overrides


def _finished(run_dir: Path, settings: dict) -> Optional[dict]:
    marker = run_dir / DONE
    if not marker.is_file():
        return None
    done = json.loads(marker.read_text())
    return done if done.get("settings") == settings else None


def run_method(method: str, index: int, args: argparse.Namespace, assets: Path, out: Path) -> dict:
    """Train one method (or reuse its finished run); returns its summary row."""
    run_dir, settings = out / method, _settings(args)
    tag = f"[quickstart] ({index}/{len(args.methods)}) {method}"
    done = None if args.force else _finished(run_dir, settings)
    if done is not None:
        print(f"{tag}: reusing the finished run in {run_dir}", flush=True)
        return summarise(method, read_metrics(run_dir / "metrics.jsonl"), done["wall_s"])
    print(f"{tag}: training {args.steps} steps (log: {run_dir / 'metrics.log'})", flush=True)

    def on_step(step: int, data: dict) -> None:
        validation = {k: v for k, v in data.items() if k.startswith("val-core/")}
        if validation:
            print(f"{tag}: validation after step {step}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in validation.items()),
                  flush=True)
        if REWARD not in data:
            return  # a validation-only record (before training)
        extra = f", silenced {_fmt(data.get(SILENCED))}" if SILENCED in data else ""
        print(f"{tag}: step {step}/{args.steps}: reward {_fmt(data.get(REWARD))}, entropy "
              f"{_fmt(data.get(ENTROPY))}{extra}, {_fmt(data.get(STEP_TIME), 2)} s", flush=True)

    run = run_cpu_trainer(method, assets, run_dir, steps=args.steps, prompts=args.prompts, n=args.n,
                          mini_batch_prompts=args.prompts // 2 if args.prompts % 2 == 0 else args.prompts,
                          seed=args.seed, use_v1=settings["use_v1"], validate=settings["validate"],
                          timeout=args.timeout, on_step=on_step,
                          extra=method_overrides(method, args, run_dir))
    steps = read_metrics(run.metrics) if run.metrics.is_file() else {}
    if not run.ok:
        print(f"{tag}: FAILED (exit {run.returncode}) after {run.wall_s} s; log tail:\n{run.tail(25)}", flush=True)
        return summarise(method, steps, run.wall_s, error=f"exit {run.returncode}, see {run.log}")
    (run_dir / DONE).write_text(json.dumps({"settings": settings, "wall_s": run.wall_s}))
    print(f"{tag}: done in {run.wall_s} s", flush=True)
    return summarise(method, steps, run.wall_s)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/quickstart", help="output folder (default: results/quickstart)")
    parser.add_argument("--assets", default="assets/tiny", help="tiny assets folder (built if missing)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per method (default 5)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tau-p", type=float, default=0.5,
                        help="STAPO's probability threshold (default 0.5: the tiny model is far more confident than "
                             "an LLM, so with the paper's 0.002 no token is ever a candidate)")
    parser.add_argument("--trainer", choices=("v1", "legacy"), default="v1", help="verl trainer (default v1)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per method before it is stopped")
    parser.add_argument("--force", action="store_true", help="rerun methods that already finished")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if args.steps < 1 or args.prompts < 1 or args.n < 2:
        parser.error("--steps and --prompts must be >= 1 and --n >= 2 (GRPO needs a group)")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[quickstart] tiny assets in {Path(args.assets).resolve()} (built once, then reused)", flush=True)
    assets = build_assets(args.assets).root
    rows = [run_method(method, i, args, assets, out) for i, method in enumerate(args.methods, start=1)]

    table = markdown_table(rows)
    provenance = reproducibility.collect(args.seed, assets)  # what it takes to repeat these numbers
    (out / "summary.md").write_text(f"# STAPO quickstart (CPU, tiny model, {args.steps} steps, verl "
                                    f"{args.trainer} trainer, STAPO tau_p={args.tau_p})\n\n{table}\n"
                                    f"{reproducibility.markdown(provenance)}")
    (out / "summary.json").write_text(json.dumps({"methods": rows, "reproducibility": provenance}, indent=2))
    finished = {r["method"]: out / r["method"] for r in rows if not r["error"]}
    plots = plot_runs(finished, out) if finished else []
    print("\n" + table, flush=True)
    print(f"[quickstart] wrote {out / 'summary.md'}" + "".join(f", {p.name}" for p in plots), flush=True)
    if "stapo" in finished:
        print(f"[quickstart] silenced tokens: python -m recipe.stapo.inspect {finished['stapo']}", flush=True)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
