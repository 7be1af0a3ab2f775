"""Quickstart on a machine without a GPU: GRPO, 20-Entropy, JustRL and STAPO, a few steps each
(docs/miniature.md: what it shows, its options, its measured numbers).

::

    python -m stapo_cpu.quickstart [--out results/quickstart] [--assets FOLDER] [--steps 16] [--evaluate]
    bash run_scripts/quickstart.sh --out results/study --seeds 3 --test-freq 8       # the study (docs/miniature.md)

Trains every method with verl's real trainer on CPU (:mod:`stapo_cpu.trainer`), one after the other
under identical settings and seeds. Exit status 2 when an option or STAPO's composed settings are
refused (nothing is built), 1 when a run failed or was stopped, or an evaluation failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from recipe.stapo.eval import tables
from recipe.stapo.methods import PAPER_METHODS, methods
from recipe.stapo.metrics import read_metrics
from recipe.stapo.plots import STOPPED_FILE, plot_bands, plot_runs, plot_update_effect
from stapo_core.fileio import atomic_write, cli_path, output_folder_problem

from . import reproducibility
from .assets import SHIPPED_DIR, AssetConfig, asset_paths, build_assets, is_built, verify_assets
from .quickstart_report import (APPLIED, DLOGP_SILENCED, ENTROPY, REWARD, SILENCED, STEP_TIME, fmt, learning_check,
                                learning_markdown, markdown_table, quadrant_markdown, summarise,
                                update_effect_by_method, update_effect_markdown, update_effect_table)
from .quickstart_settings import ACTOR, VAL_N, paper_settings, run_settings, s2t_differences, settings_markdown
from .trainer import CPU_ROLLOUT, REPO_ROOT, cpu_overrides, hydra_quoted, machine_turn, run_cpu_trainer

DONE = "quickstart_done.json"
#: key marking a step-0 validation record copied from the seed's first run, which measured it (same initial
#: weights, same validation samples: the same numbers, ~30 s saved per run)
SHARED_FROM = "shared_from"
#: the composed settings of the STAPO run and the paper's (written next to summary.json)
SETTINGS_FILE = "settings.json"

#: the quickstart's scale (defaults of the CLI): the tiny model needs a much larger lr than an 8B one
DEFAULT_STEPS, DEFAULT_PROMPTS, DEFAULT_N, DEFAULT_LR = 16, 4, 4, 1e-4
#: seconds a run may take before it is stopped (its folder then holds plots.STOPPED_FILE, which the tools
#: reading it report)
DEFAULT_TIMEOUT = 1200
#: the largest seed: verl's full-determinism setup seeds numpy with it, which takes [0, 2**32)
MAX_SEED = 2**32 - 1
#: seconds a run takes on an idle 2-core machine before its first step (Ray, verl's workers, vLLM's CPU engine), and
#: its validation before training (measured: docs/miniature.md)
STARTUP_S, VALIDATION_S = 50, 20
#: the tiny model's row label in Table 2 (its model column), and the table's file in ``--out/eval``
TINY_SCALE, TABLE_FILE = "tiny", "table2.md"


class OptionError(ValueError):
    """Quickstart options that cannot run; the message names each bad option and the fix."""


def _is_hydra_override(text: str) -> bool:
    """``key=value``, ``+key=value``, ``++key=value`` or ``~key`` (a non-empty key)."""
    if text.startswith("~"):
        return len(text) > 1
    key, eq, _ = text.lstrip("+").partition("=")
    return bool(key) and bool(eq)


def _override_key(override: str) -> str:
    """The key a Hydra override sets, without its ``+``, ``++`` or ``~``."""
    return override.lstrip("+~").partition("=")[0]


@dataclass(frozen=True)
class QuickstartOptions:
    """The quickstart's options, checked when built: an instance always describes runs that can
    start (:class:`OptionError` otherwise, naming every bad option and its fix).

    ``out`` / ``assets``: absolute folders. ``seeds``: one run per method and seed (more than one:
    study mode). ``mini_batch``: prompts per PPO mini-batch (divides ``prompts``). ``test_freq``:
    validate every ``test_freq`` steps as well (None: only before training and after the last
    step). ``overrides``: extra Hydra overrides for every run.
    """

    out: Path
    assets: Path
    methods: tuple[str, ...]
    steps: int
    prompts: int
    mini_batch: int
    n: int
    lr: float
    response_length: int
    prompt_length: int
    seeds: tuple[int, ...]
    test_freq: Optional[int]
    trainer: str
    overrides: tuple[str, ...]
    timeout: float
    force: bool
    evaluate: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if len(problems) == 1:
            raise OptionError(problems[0])
        if problems:
            raise OptionError(f"{len(problems)} options cannot run:\n  " + "\n  ".join(problems))

    def problems(self) -> list[str]:
        """One message per option that cannot run (empty: all can)."""
        problems = []
        choices = f"give a comma-separated subset of {','.join(methods())}"
        unknown = [m for m in self.methods if m not in methods()]
        if not self.methods:
            problems.append(f"--methods: none given; {choices}")
        if unknown:
            problems.append(f"--methods: unknown {','.join(unknown)}; {choices}")
        repeated = sorted({m for m in self.methods if self.methods.count(m) > 1})
        if repeated:
            problems.append(f"--methods: {','.join(repeated)} given more than once; name each method once")
        for option, value in (("--steps", self.steps), ("--prompts", self.prompts),
                              ("--response-length", self.response_length), ("--prompt-length", self.prompt_length)):
            if value < 1:
                problems.append(f"{option} must be >= 1, got {value}")
        if self.n < 2:
            problems.append(f"--n must be >= 2, got {self.n}: GRPO's advantage compares the responses of "
                            "a prompt, and a group of one has none")
        if self.prompts >= 1 and (self.mini_batch < 1 or self.prompts % self.mini_batch):
            problems.append(f"--mini-batch {self.mini_batch} must divide --prompts {self.prompts} (every PPO "
                            f"mini-batch holds the same number of prompts); give a divisor of {self.prompts}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"--lr must be a positive finite number, got {self.lr} (the default is {DEFAULT_LR})")
        if not self.seeds:
            problems.append("--seeds must be >= 1 (the number of seeds per method)")
        elif min(self.seeds) < 0 or max(self.seeds) > MAX_SEED:
            problems.append(f"--seed / --seeds: seeds {self.seeds[0]}..{self.seeds[-1]} must lie in [0, {MAX_SEED}]")
        if self.test_freq is not None and self.test_freq < 1:
            problems.append(f"--test-freq must be a positive number of steps, got {self.test_freq}; omit it to "
                            "validate only before training and after the last step")
        if self.trainer not in ("v1", "legacy"):
            problems.append(f"--trainer must be v1 or legacy, got {self.trainer!r}")
        for override in self.overrides:
            if not _is_hydra_override(override):
                problems.append(f"--override {override!r} is not a Hydra override; give key=value, +key=value, "
                                "++key=value or ~key")
        if self.evaluate and len(self.seeds) > 1:
            problems.append("--evaluate with --seeds: Table 2 has one row per method; evaluate one seed (--seed K)")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            problems.append(f"--timeout must be a positive number of seconds, got {self.timeout} (the default is "
                            f"{DEFAULT_TIMEOUT:g} per run)")
        out_problem = output_folder_problem("--out", self.out)
        if out_problem:
            problems.append(out_problem)
        if not is_built(self.assets):
            assets_problem = output_folder_problem("--assets", self.assets)
            if assets_problem:
                problems.append(assets_problem + " (or a folder holding built assets)")
        return problems

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "QuickstartOptions":
        """The options of the parsed command line (:func:`build_parser`)."""
        return cls(out=Path(args.out).resolve(), assets=Path(args.assets).resolve(),
                   methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                   steps=args.steps, prompts=args.prompts,
                   # without --mini-batch: two updates per step when --prompts is even, else one
                   mini_batch=(args.prompts // 2 if args.prompts % 2 == 0 else args.prompts)
                   if args.mini_batch is None else args.mini_batch,
                   n=args.n, lr=args.lr, response_length=args.response_length, prompt_length=args.prompt_length,
                   seeds=tuple(args.seed + k for k in range(max(args.seeds, 0))),
                   test_freq=args.test_freq, trainer=args.trainer, overrides=tuple(args.override),
                   timeout=args.timeout, force=args.force, evaluate=args.evaluate)

    @property
    def study(self) -> bool:
        """More than one seed per method (study mode)."""
        return len(self.seeds) > 1

    def run_dir(self, method: str, seed: int) -> Path:
        """The run folder of ``method`` with ``seed``: ``out/<method>``, in study mode ``out/seed<k>/<method>``."""
        return self.out / f"seed{seed}" / method if self.study else self.out / method

    def checkpoint(self, method: str, seed: int) -> Path:
        """The verl checkpoint a run saves after its last step with ``--evaluate``."""
        return self.run_dir(method, seed) / "checkpoints" / f"global_step_{self.steps}"


def validation_samples(assets: Path, settings: dict) -> int:
    """Samples per validation of the STAPO run's composed ``settings``: the held-out problems of
    ``assets`` times the samples per problem (``val_kwargs.n``)."""
    import pyarrow.parquet as pq  # pyarrow (half a second to import) only when the file is read, not for --help

    return pq.read_metadata(asset_paths(assets).val).num_rows * int(settings[VAL_N])


def _settings(opts: QuickstartOptions, seed: int, validate_before: bool = True) -> dict:
    """What a finished run records and a later invocation compares before reusing it."""
    return {"steps": opts.steps, "prompts": opts.prompts, "mini_batch": opts.mini_batch, "n": opts.n, "seed": seed,
            "lr": opts.lr, "response_length": opts.response_length, "prompt_length": opts.prompt_length,
            "use_v1": opts.trainer == "v1", "rollout": CPU_ROLLOUT, "assets": str(opts.assets), "validate": True,
            "validate_before": validate_before, "test_freq": opts.test_freq or 0, "token_dump": True,
            "update_effect_responses": opts.mini_batch * opts.n, "overrides": list(opts.overrides)}


def method_overrides(opts: QuickstartOptions, run_dir: Path, validate_before: bool = True) -> list[str]:
    """Overrides beyond ``method=`` and the CPU scale: the token dump into the run folder (every
    method, for ``python -m recipe.stapo.inspect``), the validation interval (and no validation
    before training when the seed's first run measured it), then ``--override``."""
    overrides = [f"recipe.token_dump.dir={hydra_quoted(run_dir)}"]
    if opts.test_freq:
        overrides.append(f"trainer.test_freq={opts.test_freq}")
    if not validate_before:
        overrides.append("trainer.val_before_train=false")
    return overrides + list(opts.overrides)


def initial_validation(metrics_file: Path) -> Optional[dict]:
    """The step-0 record (validation before training) of a run's ``metrics.jsonl``, or None."""
    if not metrics_file.is_file():
        return None
    data = read_metrics(metrics_file).get(0, {})
    validation = {k: v for k, v in data.items() if k.startswith("val-")}
    return validation or None


def share_initial_validation(metrics_file: Path, validation: dict, source: str) -> None:
    """Prepend ``validation`` (another run's step-0 record) to ``metrics_file``, marked with its source."""
    line = json.dumps({"step": 0, "data": validation, SHARED_FROM: source})
    atomic_write(metrics_file, line + "\n" + metrics_file.read_text())


def run_kwargs(opts: QuickstartOptions, seed: int) -> dict:
    """Keyword arguments of :func:`stapo_cpu.trainer.cpu_overrides` for one run."""
    return dict(steps=opts.steps, prompts=opts.prompts, n=opts.n, mini_batch_prompts=opts.mini_batch,
                response_length=opts.response_length, prompt_length=opts.prompt_length, lr=opts.lr, seed=seed,
                use_v1=opts.trainer == "v1", validate=True, save_freq=opts.steps if opts.evaluate else -1)


def check_stapo_settings(opts: QuickstartOptions, assets: Path) -> tuple[dict, list[str]]:
    """Compose the STAPO run's config (first seed) with the built ``assets`` and compare it with the
    paper's settings. Returns (its settings, the differences); or ({}, each ``--override`` of a key the
    quickstart sets from its own options: the run would differ from what its summary reports)."""
    seed = opts.seeds[0]
    run_dir = opts.run_dir("stapo", seed)
    overrides = cpu_overrides(assets, run_dir, **run_kwargs(opts, seed)) + method_overrides(opts, run_dir)
    own = {_override_key(override) for override in overrides[:len(overrides) - len(opts.overrides)]}
    twice = [f"--override {override}: the quickstart sets {_override_key(override)} from its options (see "
             "--help); give the option instead" for override in opts.overrides if _override_key(override) in own]
    if twice:  # composed with them, Hydra may refuse a +key the quickstart sets
        return {}, twice
    settings = run_settings("stapo", overrides)
    return settings, s2t_differences(settings, paper_settings())


def _finished(run_dir: Path, settings: dict) -> Optional[dict]:
    marker = run_dir / DONE
    if not marker.is_file():
        return None
    done = json.loads(marker.read_text())
    return done if done.get("settings") == settings else None


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished descendants (the trainer's driver and,
    reaped through it, Ray and its workers): a run's cost independent of the machine's load."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def record_stop(run_dir: Path, label: str, wall_s: float, timeout: float, logged: int, steps: int) -> str:
    """Write ``run_dir``'s record of a run stopped at ``timeout`` seconds after logging ``logged`` of its
    ``steps`` steps (:data:`recipe.stapo.plots.STOPPED_FILE`: its message, for the tools reading the
    folder, and the numbers); returns the reason for the summary."""
    reason = (f"stopped after {wall_s:.0f} s (the quickstart's limit per run, --timeout {timeout:g}) with {logged} "
              f"of {steps} steps logged: raise --timeout")
    atomic_write(run_dir / STOPPED_FILE, json.dumps({"message": f"run {label} {reason}", "wall_s": wall_s,
                                                     "timeout_s": timeout, "steps_logged": logged, "steps": steps}))
    return reason


def run_method(method: str, index: int, total: int, seed: int, opts: QuickstartOptions, assets: Path,
               shared: Optional[tuple[str, dict]] = None) -> dict:
    """Train one method with one seed (or reuse its finished run); returns its summary row.
    ``shared``: ``(method, step-0 validation record)`` of an earlier run of this seed: this run then
    skips the validation before training and gets that record instead."""
    run_dir, settings = opts.run_dir(method, seed), _settings(opts, seed, validate_before=shared is None)
    tag = f"[quickstart] ({index}/{total}) {method}" + (f" seed {seed}" if opts.study else "")
    done = None if opts.force else _finished(run_dir, settings)
    if done is not None and opts.evaluate and not opts.checkpoint(method, seed).is_dir():
        done = None  # finished without --evaluate: trained again, saving its checkpoint
    if done is not None:
        print(f"{tag}: reusing the finished run in {run_dir}", flush=True)
        return {**summarise(method, read_metrics(run_dir / "metrics.jsonl"), done["wall_s"]), "seed": seed,
                "cpu_s": done.get("cpu_s")}
    print(f"{tag}: training {opts.steps} steps (log: {run_dir / 'metrics.log'}); first Ray, verl's workers and vLLM's "
          f"CPU engine start (about {STARTUP_S} s on an idle 2-core machine, minutes on a busy one)"
          + (f", then it validates before training (about {VALIDATION_S} s)" if shared is None else ""), flush=True)

    def on_step(step: int, data: dict) -> None:
        validation = {k: v for k, v in data.items() if k.startswith("val-core/")}
        if validation:
            print(f"{tag}: validation after step {step}: " + ", ".join(f"{k} {fmt(v)}" for k, v in validation.items()),
                  flush=True)
        if REWARD not in data:
            return  # a validation-only record (before training)
        extra = ""
        if SILENCED in data:
            would = "" if data.get(APPLIED) == 1.0 else " (monitored)"
            extra = (f", candidates {fmt(data.get('actor/s2t/candidates'), 1)}, silenced{would} "
                     f"{fmt(data.get('actor/s2t/silenced'), 1)} ({fmt(data.get(SILENCED))})")
        if DLOGP_SILENCED in data:
            extra += f", dlogp silenced {fmt(data[DLOGP_SILENCED])}"
        print(f"{tag}: step {step}/{opts.steps}: reward {fmt(data.get(REWARD))}, entropy "
              f"{fmt(data.get(ENTROPY))}{extra}, {fmt(data.get(STEP_TIME), 2)} s", flush=True)

    (run_dir / STOPPED_FILE).unlink(missing_ok=True)  # a record of an earlier run stopped at its limit
    for stale in (run_dir / "checkpoints", opts.out / "eval" / method):  # an earlier run's checkpoint and its evaluation
        shutil.rmtree(stale, ignore_errors=True)
    cpu_before = _children_cpu_seconds()
    run = run_cpu_trainer(method, assets, run_dir, timeout=opts.timeout, on_step=on_step,
                          extra=method_overrides(opts, run_dir, validate_before=shared is None),
                          **run_kwargs(opts, seed))
    if run.ok and shared is not None:
        share_initial_validation(run.metrics, shared[1], shared[0])
    steps = read_metrics(run.metrics) if run.metrics.is_file() else {}
    if run.timed_out:  # stopped at its limit (run_cpu_trainer kills it there)
        row = summarise(method, steps, run.wall_s)
        reason = record_stop(run_dir, method + (f" seed {seed}" if opts.study else ""), run.wall_s, opts.timeout,
                             row["steps"], opts.steps)
        print(f"{tag}: {reason} (log: {run.log})", flush=True)
        return {**row, "error": reason, "seed": seed}
    if not run.ok:
        print(f"{tag}: FAILED (exit {run.returncode}) after {run.wall_s} s; log tail:\n{run.tail(25)}", flush=True)
        return {**summarise(method, steps, run.wall_s, error=f"FAILED: exit {run.returncode}, see {run.log}"),
                "seed": seed}
    cpu_s = round(_children_cpu_seconds() - cpu_before, 1)
    atomic_write(run_dir / DONE, json.dumps({"settings": settings, "wall_s": run.wall_s, "cpu_s": cpu_s}))
    print(f"{tag}: done in {run.wall_s} s ({cpu_s} CPU s)", flush=True)
    return {**summarise(method, steps, run.wall_s), "seed": seed, "cpu_s": cpu_s}


def evaluate(checkpoints: dict[str, Path], out: Path) -> tuple[str, list[str]]:
    """Evaluate each method's verl checkpoint as the paper's are (``PRESET=cpu bash run_scripts/eval.sh``
    into ``out/<method>``), then build Table 2 over their summaries (``python -m recipe.stapo.eval.tables
    --allow-partial``: the tiny task is not the paper's six benchmarks) into ``out/table2.md``. Returns
    the markdown (one line per evaluation with mean@N and its standard error, then the table's report)
    and one error per evaluation that failed.
    """
    lines, errors, summaries = [], [], []
    for method, checkpoint in checkpoints.items():
        folder = out / method
        settings = {"PRESET": "cpu", "MODEL": str(checkpoint), "SCALE": TINY_SCALE, "METHOD": method, "OUT": str(folder)}
        print(f"[quickstart] evaluating {method}'s checkpoint: " + " ".join(f"{k}={v}" for k, v in settings.items())
              + " bash run_scripts/eval.sh", flush=True)
        with machine_turn():
            code = subprocess.run(["bash", str(REPO_ROOT / "run_scripts" / "eval.sh")], cwd=REPO_ROOT,
                                  env={**os.environ, **settings, "PYTHON": sys.executable}).returncode
        if code != 0:
            errors.append(f"the evaluation of {checkpoint} failed (exit {code}; its messages are above)")
            continue
        summaries.append(folder / "summary.json")
        for decoding in json.loads(summaries[-1].read_text())["decodings"].values():
            for bench, result in decoding["benchmarks"].items():
                lines.append(f"- {method}: {bench} mean@{result['n_samples']} {result['mean_at_n']:.2f} (standard error "
                             f"{fmt(result['mean_at_n_se'], 2)}, {result['problems']} problems, temperature "
                             f"{decoding['temperature']}): {folder}")
    if not summaries:
        return "", errors
    argv = [*map(str, summaries), "--allow-partial", "--stapo-method", "stapo", "--out", str(out / TABLE_FILE)]
    print("[quickstart] Table 2: python -m recipe.stapo.eval.tables " + " ".join(argv), flush=True)
    with contextlib.redirect_stdout(io.StringIO()):  # the report is printed with the quickstart's summary
        code = tables.main(argv)
    if code != 0:
        errors.append("Table 2 could not be built (the message is above)")
        return "\n".join(lines) + "\n", errors
    return "\n".join(lines) + "\n\n" + (out / TABLE_FILE).read_text(), errors


def build_parser() -> argparse.ArgumentParser:
    """The quickstart's command line (defaults: the quickstart's scale)."""
    parser = argparse.ArgumentParser(prog="python -m stapo_cpu.quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=cli_path, default="results/quickstart", help="output folder (default: results/quickstart)")
    parser.add_argument("--assets", type=cli_path, default=str(SHIPPED_DIR),
                        help="tiny assets folder (default: the shipped set; another folder is built if missing)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help=f"prompts per step (default {DEFAULT_PROMPTS})")
    parser.add_argument("--mini-batch", type=int, default=None,
                        help="prompts per PPO mini-batch, a divisor of --prompts (default: half of --prompts when "
                             "even, else --prompts)")
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"responses per prompt, >= 2 (default {DEFAULT_N})")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"actor learning rate (default {DEFAULT_LR})")
    parser.add_argument("--response-length", type=int, default=AssetConfig().max_new_tokens,
                        help="max response tokens (default: the assets' sampling length)")
    parser.add_argument("--prompt-length", type=int, default=64, help="max prompt tokens (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds per method (default 1; more: study mode, one band per method across seeds)")
    parser.add_argument("--test-freq", type=int, default=None,
                        help="validate every N steps too (default: only before training and after the last step)")
    parser.add_argument("--trainer", choices=("v1", "legacy"), default="v1", help="verl trainer (default v1)")
    parser.add_argument("--methods", default=",".join(PAPER_METHODS),
                        help=f"comma-separated subset of {','.join(methods())} (default: the paper's four)")
    parser.add_argument("--override", action="append", default=[],
                        help="extra Hydra override for every run (repeatable); refused if it changes STAPO's "
                             "paper settings")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds each run may take before it is stopped (default {DEFAULT_TIMEOUT:g}: a run "
                             "takes 1.5-2 minutes on a 2-core machine)")
    parser.add_argument("--force", action="store_true", help="rerun methods that already finished")
    parser.add_argument("--evaluate", action="store_true",
                        help="also save each run's checkpoint after its last step, evaluate it with the CPU evaluation "
                             "(PRESET=cpu bash run_scripts/eval.sh) and build Table 2 (python -m recipe.stapo.eval.tables) "
                             "in OUT/eval; about 2.5 minutes per method on a 2-core machine")
    return parser


def parse_options(argv: Optional[list[str]] = None) -> QuickstartOptions:
    """The checked options of a command line; exits with status 2, naming each bad option and the
    fix, when any cannot run (nothing is left behind)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return QuickstartOptions.from_args(args)
    except OptionError as exc:
        parser.error(str(exc))


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse_options(argv)
    try:  # the overrides alone, before anything is built or written: a refusal leaves nothing behind
        early = s2t_differences(run_settings("stapo", list(opts.overrides)), paper_settings())
    except ValueError as exc:  # an override Hydra refuses (unknown key, bad syntax)
        early = [f"--override: {exc}"]
    if early:
        print("[quickstart] refusing to run:\n  " + "\n  ".join(early), file=sys.stderr, flush=True)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    print(f"[quickstart] tiny assets in {opts.assets}"
          f"{' (the shipped set)' if opts.assets == SHIPPED_DIR else ' (built once, then reused)'}", flush=True)
    # the shipped set is checked against its manifest (never rebuilt here); another folder is built or reused
    assets = verify_assets(SHIPPED_DIR) if opts.assets == SHIPPED_DIR else build_assets(opts.assets).root
    settings, differences = check_stapo_settings(opts, assets)
    if differences:
        print("[quickstart] refusing to run (STAPO at the paper's settings, each option once):\n  "
              + "\n  ".join(differences), file=sys.stderr, flush=True)
        return 2
    print(f"[quickstart] STAPO at the paper's settings: tau_p={settings[f'{ACTOR}.policy_loss.tau_p']}, "
          f"q={settings[f'{ACTOR}.policy_loss.q']}, clip [{1 - settings[f'{ACTOR}.clip_ratio_low']:g}, "
          f"{1 + settings[f'{ACTOR}.clip_ratio_high']:g}], {settings[f'{ACTOR}.loss_agg_mode']}", flush=True)
    plan = [(method, seed) for seed in opts.seeds for method in opts.methods]
    rows, shared = [], {}  # shared: seed -> (method, its validation before training)
    for i, (method, seed) in enumerate(plan, start=1):
        rows.append(run_method(method, i, len(plan), seed, opts, assets, shared=shared.get(seed)))
        if seed not in shared and not rows[-1]["error"]:
            record = initial_validation(opts.run_dir(method, seed) / "metrics.jsonl")
            if record is not None:
                shared[seed] = (method, record)

    study, out = opts.study, opts.out
    by_seed = [{**r, "method": f"{r['method']} (seed {r['seed']})"}
               for r in sorted(rows, key=lambda r: (list(methods()).index(r["method"]), r["seed"]))]
    table = markdown_table(by_seed if study else rows)
    finished = [r for r in rows if not r["error"]]
    stapo_dirs = [opts.run_dir("stapo", r["seed"]) for r in finished if r["method"] == "stapo"]
    check = learning_check(rows, validation_samples(assets, settings))
    learning_md = learning_markdown(check)
    by_method = update_effect_by_method(rows)
    effect = update_effect_table(by_seed if study else rows)
    effect_md = ("## Update effect: the change of log-probability across each update\n\n"
                 "Mean over every step of `actor/s2t/dlogp_*` (token-weighted): tokens S2T silenced (STAPO) or "
                 "would have silenced (the other methods, where S2T is only monitored), the candidates it keeps, "
                 "and all tokens of the measured responses (the positive-advantage responses holding a candidate); "
                 "token counts in brackets. A positive value: the update made the tokens more likely.\n\n"
                 + (update_effect_markdown(by_method) + "\nPer run:\n\n" if study else "") + effect) if effect else ""
    evaluation_md, eval_errors = "", []
    if opts.evaluate and finished:
        evaluation_md, eval_errors = evaluate({r["method"]: opts.checkpoint(r["method"], r["seed"]) for r in finished},
                                              out / "eval")
        evaluation_md = ("## Evaluation: each method's final checkpoint, and Table 2 on the tiny task\n\n"
                         + evaluation_md) if evaluation_md else ""
    extra_md = effect_md + "\n" + evaluation_md + "\n" + settings_markdown(settings)
    if shared:
        extra_md = ("Validation before training: measured once per seed, by "
                    + ", ".join(f"{m} (seed {sd})" for sd, (m, _) in sorted(shared.items()))
                    + ", and shared with the seed's other runs (same initial weights, same validation samples).\n\n"
                    + extra_md)
    if stapo_dirs:
        try:
            extra_md += "\n" + quadrant_markdown(stapo_dirs)
        except (FileNotFoundError, ValueError) as exc:
            extra_md += f"\n(no token quadrants: {exc})\n"
    provenance = reproducibility.collect(list(opts.seeds), assets)  # what it takes to repeat these numbers
    atomic_write(out / "summary.md", f"# STAPO {'study' if study else 'quickstart'} (CPU, tiny model, {opts.steps} steps, "
                                     f"{len(opts.seeds)} seed(s), verl {opts.trainer} trainer)\n\n"
                                     f"{learning_md}{table}\n{extra_md}\n"
                                     f"{reproducibility.markdown(provenance)}")
    atomic_write(out / "summary.json", json.dumps({"methods": rows, "learning": check, "update_effect": by_method,
                                                   "reproducibility": provenance}, indent=2))
    atomic_write(out / SETTINGS_FILE, json.dumps({"stapo": settings, "paper": paper_settings()}, indent=2, default=str))
    groups = {m: [opts.run_dir(m, r["seed"]) for r in finished if r["method"] == m] for m in opts.methods}
    groups = {m: dirs for m, dirs in groups.items() if dirs}
    plots = []
    if finished:
        plots = plot_bands(groups, out) if study else plot_runs({r["method"]: out / r["method"] for r in finished}, out)
        plots += plot_update_effect(groups, out)
    print("\n" + learning_md + table + "\n" + effect_md + "\n" + evaluation_md, flush=True)
    print(f"[quickstart] wrote {out / 'summary.md'}" + "".join(f", {p.name}" for p in plots), flush=True)
    for run_dir in stapo_dirs:
        print(f"[quickstart] silenced tokens: python -m recipe.stapo.inspect {run_dir}", flush=True)
    for r in rows:
        if r["error"]:
            print(f"[quickstart] {r['method']}" + (f" seed {r['seed']}" if study else "") + f": {r['error']}",
                  file=sys.stderr, flush=True)
    for error in eval_errors:
        print(f"[quickstart] {error}", file=sys.stderr, flush=True)
    return 1 if eval_errors or any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
