"""The quickstart's report: one summary row per run, the tables of its ``summary.md`` and the
learning check (did the baselines learn, each change next to its standard error)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Optional

from recipe.stapo.eval.tables import markdown_table as _table
from recipe.stapo.inspect import QUADRANT_LABELS, quadrant_table, write_report
from recipe.stapo.methods import PAPER_METHODS, methods
from recipe.stapo.plots import DLOGP_SETS, update_effect_of_run
from stapo_core.rules import S2T
from stapo_core.token_records import read_dump

REWARD = "critic/score/mean"
ENTROPY = "actor/entropy"
SILENCED = "actor/s2t/silenced_frac"
CANDIDATES = "actor/s2t/candidates"
SILENCED_COUNT = "actor/s2t/silenced"
STEP_TIME = "timing_s/step"
#: 1 when the run applied S2T (STAPO), 0 when it only monitored it (the baselines)
APPLIED = "actor/s2t/applied"
#: seconds per step spent measuring the update effect (actor/s2t/dlogp_*)
DLOGP_SECONDS = "actor/s2t/dlogp_seconds"
DLOGP_SILENCED = "actor/s2t/dlogp_silenced"
#: the methods whose learning the summary's first lines report (the paper's baselines: its methods without S2T)
BASELINES = tuple(m for m in PAPER_METHODS if methods()[m].token_selection != S2T.name)
def _series(steps: dict[int, dict], key: str) -> list[float]:
    return [float(steps[s][key]) for s in sorted(steps) if key in steps[s] and steps[s][key] is not None]


def fmt(value: Optional[float], digits: int = 3) -> str:
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
    applied = _series(steps, APPLIED)
    half = len(reward) // 2
    effect = update_effect_of_run(steps)
    return {
        "method": method, "steps": len(reward), "error": error, "wall_s": wall_s,
        "val_acc_first": validation[0] if validation else None, "val_acc_last": validation[-1] if validation else None,
        "final_reward": reward[-1] if reward else None, "mean_reward": mean(reward),
        "reward_first_half": mean(reward[:half]) if half else None,
        "reward_second_half": mean(reward[half:]) if half else None,
        "reward_change_se": half_change_se(reward[:half], reward[half:]),
        "final_entropy": entropy[-1] if entropy else None, "mean_entropy": mean(entropy),
        "mean_silenced_frac": mean(silenced), "mean_step_s": mean(step_time),
        "mean_candidates": mean(_series(steps, CANDIDATES)),
        "mean_silenced": mean(_series(steps, SILENCED_COUNT)),
        "s2t": None if not applied else ("applied" if min(applied) == 1.0 else "monitored"),
        "update_effect": {name: {"mean": e.mean, "tokens": e.tokens} for name, e in effect.items()},
        "mean_dlogp_seconds": mean(_series(steps, DLOGP_SECONDS)),
    }


def markdown_table(rows: list[dict]) -> str:
    """The summary table (markdown). S2T: ``applied`` (STAPO) or ``monitored``; CPU s: user + system
    CPU seconds of the run's processes, its cost whatever the machine's load (wall s is not)."""
    header = ["method", "steps", "final reward", "mean reward", "final entropy", "mean entropy", "S2T",
              "S2T candidates / silenced per step", "silenced frac (S2T)", "val acc before -> after", "mean step s",
              "wall s", "CPU s"]
    return _table(header, [[r["method"], r["error"]] + [""] * 11 if r["error"] else _summary_cells(r)
                           for r in rows]) + "\n"


def _summary_cells(r: dict) -> list[str]:
    return [r["method"], str(r["steps"]), fmt(r["final_reward"]), fmt(r["mean_reward"]), fmt(r["final_entropy"]),
            fmt(r["mean_entropy"]), r.get("s2t") or "n/a",
            f"{fmt(r.get('mean_candidates'), 1)} / {fmt(r.get('mean_silenced'), 1)}", fmt(r["mean_silenced_frac"]),
            f"{fmt(r.get('val_acc_first'))} -> {fmt(r.get('val_acc_last'))}", fmt(r["mean_step_s"], 2),
            fmt(r["wall_s"], 1), fmt(r.get("cpu_s"), 1)]


def _effect_cell(effect: dict) -> str:
    return f"{fmt(effect['mean'])} ({effect['tokens']})" if effect["tokens"] else "- (0)"


def update_effect_table(rows: list[dict]) -> str:
    """Per run: the mean change of log-probability across the update of the tokens S2T silenced
    (STAPO) or would have silenced (monitored), of the candidates it keeps and of all tokens of the
    measured responses (token counts in brackets), and the measurement's cost; empty when no run
    measured it (every run failed or was stopped)."""
    measured = [r for r in rows if not r["error"] and r.get("update_effect")]
    header = ["method", "S2T", "dlogp silenced (tokens)", "dlogp kept candidates (tokens)", "dlogp all (tokens)",
              "measurement s / step", "step s"]
    return _table(header, [[r["method"], r.get("s2t") or "n/a"]
                           + [_effect_cell(r["update_effect"][name]) for name, *_ in DLOGP_SETS]
                           + [fmt(r.get("mean_dlogp_seconds"), 3), fmt(r["mean_step_s"], 2)]
                           for r in measured]) + "\n" if measured else ""


def update_effect_by_method(rows: list[dict]) -> dict[str, dict]:
    """Per method, per token set: the runs' update effects over seeds: ``mean`` (of the runs'
    means), ``low`` / ``high`` (their range), ``runs`` (seeds that measured it), ``tokens`` (all runs)."""
    out: dict[str, dict] = {}
    for method in dict.fromkeys(r["method"] for r in rows if not r["error"]):
        runs = [r for r in rows if r["method"] == method and not r["error"]]
        out[method] = {"s2t": runs[0].get("s2t")}
        for name, *_ in DLOGP_SETS:
            values = [r["update_effect"][name]["mean"] for r in runs if r["update_effect"][name]["mean"] is not None]
            out[method][name] = {
                "mean": sum(values) / len(values) if values else None,
                "low": min(values) if values else None, "high": max(values) if values else None,
                "runs": len(values), "tokens": sum(r["update_effect"][name]["tokens"] for r in runs)}
    return out


def update_effect_markdown(by_method: dict[str, dict]) -> str:
    """The study's update-effect table: mean over seeds [min, max] of each run's token-weighted mean."""
    def cell(e: dict) -> str:
        return "-" if e["mean"] is None else (f"{fmt(e['mean'])} [{fmt(e['low'])}, {fmt(e['high'])}] "
                                              f"({e['runs']} seeds, {e['tokens']} tokens)")

    header = ["method", "S2T", "dlogp silenced", "dlogp kept candidates", "dlogp all"]
    return _table(header, [[method, sets["s2t"] or "n/a"] + [cell(sets[name]) for name, *_ in DLOGP_SETS]
                           for method, sets in by_method.items()]) + "\n"


def half_change_se(first: list[float], second: list[float]) -> Optional[float]:
    """Standard error of ``mean(second) - mean(first)`` from the spread of the steps' values in each
    half, ``sqrt(s1^2 / n1 + s2^2 / n2)`` (sample variances); None when a half has fewer than 2 steps."""
    if len(first) < 2 or len(second) < 2:
        return None
    return math.sqrt(statistics.variance(first) / len(first) + statistics.variance(second) / len(second))


def mean_se(standard_errors: list[float]) -> float:
    """Standard error of the mean of independent estimates with these standard errors (one per
    seed): ``sqrt(sum se_i^2) / n``."""
    return math.sqrt(sum(se ** 2 for se in standard_errors)) / len(standard_errors)


def validation_noise(accuracy: float, samples: int) -> float:
    """Standard error of a validation accuracy measured on ``samples`` independent samples (one per
    held-out problem): ``sqrt(p (1 - p) / samples)`` at ``p = accuracy``."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / samples)


def learning_check(rows: list[dict], val_samples: Optional[int] = None) -> dict:
    """Did the baselines visibly learn (docs/miniature.md)? Per baseline, means over its seeds: validation
    accuracy before and after training, training reward over each half of the steps, each change's
    standard error (``val_change_se``: two validations of ``val_samples`` samples each), ``rose`` (both
    changes positive) and ``learned`` (both above twice their standard error); the check's ``learned``:
    every baseline that ran learned."""
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    per_method = {}
    for method in BASELINES:
        runs = [r for r in rows if r["method"] == method and not r["error"]]
        if not runs:
            continue
        got = {key: mean([r[key] for r in runs if r.get(key) is not None])
               for key in ("val_acc_first", "val_acc_last", "reward_first_half", "reward_second_half")}
        complete = all(v is not None for v in got.values())
        val_change = got["val_acc_last"] - got["val_acc_first"] if complete else None
        reward_change = got["reward_second_half"] - got["reward_first_half"] if complete else None
        val_firsts = [r.get("val_acc_first") for r in runs]
        # a change between two validations: sqrt(2) times one validation's standard error
        val_se = (mean_se([math.sqrt(2) * validation_noise(p, val_samples) for p in val_firsts])
                  if val_samples and None not in val_firsts else None)
        reward_ses = [r.get("reward_change_se") for r in runs]
        reward_se = mean_se(reward_ses) if None not in reward_ses else None
        got.update(val_change_se=val_se, reward_change_se=reward_se,
                   rose=complete and val_change > 0 and reward_change > 0)
        got["learned"] = got["rose"] and val_se is not None and reward_se is not None \
            and val_change > 2 * val_se and reward_change > 2 * reward_se
        per_method[method] = got
    return {"methods": per_method, "learned": bool(per_method) and all(m["learned"] for m in per_method.values())}


def learning_markdown(check: dict) -> str:
    """The summary's first lines: whether the baselines learned with these settings, each change with
    its standard error (the scale against which it reads as learning or as noise)."""
    if not check["methods"]:
        return ""
    se = lambda v: "" if v is None else f" (standard error {fmt(v, 2)})"  # noqa: E731
    parts = [f"{m}: validation accuracy {fmt(v['val_acc_first'])} -> {fmt(v['val_acc_last'])}"
             f"{se(v['val_change_se'])}, training reward {fmt(v['reward_first_half'])} (first half of the steps) -> "
             f"{fmt(v['reward_second_half'])} (second half){se(v['reward_change_se'])}"
             for m, v in check["methods"].items()]
    rule = (" A baseline learned when its validation accuracy and its training reward both rose by more than two "
            "standard errors of the change (validation: an accuracy p measured on k samples has a standard error "
            "sqrt(p (1 - p) / k); reward: from the spread of the steps' rewards in each half).")
    if check["learned"]:
        return "**The baselines learned**: " + "; ".join(parts) + "." + rule + "\n\n"
    failed = [m for m, v in check["methods"].items() if not v["learned"]]
    within = [m for m in failed if check["methods"][m]["rose"]]
    head = ("**Not every baseline visibly learned with these settings** (" + ", ".join(failed) + ": validation "
            "accuracy and training reward did not both rise beyond their noise"
            + (f"; {', '.join(within)} rose, but within it" if within else "") + "): ")
    return head + "; ".join(parts) + "." + rule + "\n\n"


def quadrant_markdown(stapo_dirs: list[Path]) -> str:
    """The inspector's four-quadrant table (:func:`recipe.stapo.inspect.quadrant_table`) over the
    token dumps of all ``stapo_dirs`` together (every step of every seed); also writes each run's
    ``inspect/report.md``."""
    responses, tokens = [], []
    for run_dir in stapo_dirs:
        dump = read_dump(run_dir, progress=False)
        tokens += dump.tokens
        responses += dump.responses
        write_report(run_dir)
    rows = quadrant_table(responses)
    silenced = sum(t["silenced"] for t in tokens)
    candidates = sum(t["candidate"] for t in tokens)
    return (f"## Token quadrants of STAPO's positive-advantage responses ({len(stapo_dirs)} run(s), all steps; "
            f"{candidates} candidates, {silenced} silenced)\n\n"
            + _table(["quadrant", "tokens", "share", "mean grad norm"],
                     [[QUADRANT_LABELS[r.name], str(r.count), fmt(r.share, 4), fmt(r.mean_grad_norm)] for r in rows])
            + "\n")
