"""Same numbers on AVX2-only and AVX-512 CPUs: the CPU path's instruction-set pin, measured on one machine.

::

    python -m stapo_cpu.benchmarks.bench_isa [--steps 2] [--out results/bench_isa] [--method stapo] [--json rows.json]

Runs the same CPU training run (verl's real trainer, the shipped tiny assets, ``--steps`` steps,
seed 0) under each of :data:`SETTINGS` and prints per setting how many seeded numbers differ from
the pinned run's and which of vLLM's kernel libraries its processes loaded; then the speed cost: the
pinned over the native mean step time, and the tiny model's forward + backward timed in fresh
processes alternated ``--kernel-repeats`` times. The reading of the results: docs/reproducibility.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

from recipe.stapo.metrics import read_metrics
from stapo_core.fileio import atomic_write
from stapo_cpu.assets import SHIPPED_DIR
from stapo_cpu.reproducibility import isa_settings, seeded_metrics
from stapo_cpu.trainer import cpu_env, run_cpu_trainer

#: the environment an AVX2-only machine amounts to (every library capped at AVX2)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: an environment asking for AVX-512 (what the pin must override)
AVX512 = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
ISA_KEYS = sorted({*AVX2_ONLY, *AVX512, "MKL_CBWR"})
#: (name, isa setting of the CPU path, environment the run starts from): pinned as shipped; pinned from an
#: environment asking for AVX-512 (the pin must win in every process); native; native capped at AVX2
#: without MKL's reproducibility mode MKL_CBWR
SETTINGS = (("pinned", "avx2", {}), ("pinned, inherited avx512", "avx2", AVX512), ("native", "native", {}),
            ("native, avx2-only", "native", AVX2_ONLY))


def differences(a: dict[str, float], b: dict[str, float]) -> list[str]:
    """The metrics whose values differ (or that only one run logged)."""
    same = lambda x, y: x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))


def run_setting(name: str, isa: str, start_env: dict[str, str], args: argparse.Namespace) -> dict:
    """One run under ``isa`` with ``start_env`` in the environment it starts from; its metrics."""
    run_dir = (Path(args.out) / name.replace(", ", "_").replace(" ", "_")).resolve()
    kernels: set[str] = set()

    def note_kernels(step: int, metrics: dict) -> None:  # while the run's processes live
        # the wing's vLLM module loads verl (seconds): only when a run is measured, not for --help
        from stapo_cpu.patches.vllm_cpu import run_vllm_kernels

        kernels.update(run_vllm_kernels(str(run_dir)))

    with mock.patch.dict(os.environ):  # this process's environment as it was, once the run ended
        for key in ISA_KEYS:
            os.environ.pop(key, None)
        os.environ.update(start_env)
        run = run_cpu_trainer(args.method, SHIPPED_DIR, run_dir, steps=args.steps, isa=isa, timeout=args.timeout,
                              on_step=note_kernels)
    if not run.ok:
        raise SystemExit(f"[bench_isa] {name}: the run failed ({run}); log tail:\n{run.tail()}")
    steps = read_metrics(run.metrics)
    step_s = [data["timing_s/step"] for data in steps.values() if "timing_s/step" in data]
    return {"name": name, "isa": isa, "start_env": start_env, "wall_s": run.wall_s, "vllm_kernels": sorted(kernels),
            "step_s": sum(step_s) / len(step_s) if step_s else float("nan"),
            "metrics": {f"{step}:{key}": value for (step, key), value in seeded_metrics(steps).items()}}


#: a fresh process timing the shipped model's forward + backward (one thread, 16 x 120 tokens)
KERNEL_SCRIPT = """
import sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager", dtype=torch.float32)
ids = torch.randint(0, model.config.vocab_size, (16, 120), generator=torch.Generator().manual_seed(0))
def once():
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
once()
start = time.perf_counter()
for _ in range(5):
    once()
print(torch.backends.cpu.get_cpu_capability(), (time.perf_counter() - start) / 5)
"""


def kernel_seconds(isa: str) -> tuple[str, float]:
    """(ATen's capability, seconds per forward + backward) in a fresh process under ``isa``."""
    env = cpu_env(base={k: v for k, v in os.environ.items() if k not in ISA_KEYS}, isa=isa)
    out = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT, str(SHIPPED_DIR / "model")], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    capability, seconds = out.stdout.split()[-2:]
    return capability, float(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stapo_cpu.benchmarks.bench_isa",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    parser.add_argument("--method", default="stapo", help="method to train (default stapo)")
    parser.add_argument("--out", default="results/bench_isa", help="run folders (default results/bench_isa)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", default=None, help="also write the rows (without metrics) here")
    parser.add_argument("--kernel-repeats", type=int, default=5, help="fresh processes per setting for the "
                        "forward + backward timing (default 5; 0: skip)")
    args = parser.parse_args(argv)
    rows = [run_setting(name, isa, env, args) for name, isa, env in SETTINGS]
    base = rows[0]
    print(f"[bench_isa] machine: {isa_settings()['cpu_vector_flags']}; {args.method}, {args.steps} steps, seed 0, "
          f"{len(base['metrics'])} metrics compared")
    print("| setting | metrics differing from `pinned` | vLLM's kernels | mean step (s) |\n|---|---|---|---|")
    for row in rows:
        diff = differences(base["metrics"], row["metrics"])
        row["differing"] = diff
        example = f" (e.g. {diff[0]}: {base['metrics'].get(diff[0])} vs {row['metrics'].get(diff[0])})" if diff else ""
        kernels = ", ".join(row["vllm_kernels"]) or "-"
        print(f"| {row['name']} | {len(diff)}{example} | {kernels} | {row['step_s']:.2f} |")
    native = next(r for r in rows if r["name"] == "native")
    print(f"[bench_isa] speed: a pinned step takes {base['step_s'] / native['step_s']:.2f}x a native one")
    if args.kernel_repeats > 0:
        times: dict[str, list[float]] = {"avx2": [], "native": []}
        capability = {}
        for _ in range(args.kernel_repeats):  # alternated, so load changes hit both alike
            for isa in times:
                capability[isa], seconds = kernel_seconds(isa)
                times[isa].append(seconds)
        pinned_s, native_s = (statistics.median(times[isa]) for isa in ("avx2", "native"))
        print(f"[bench_isa] forward + backward of the tiny model: pinned ({capability['avx2']}) {1e3 * pinned_s:.1f} ms, "
              f"native ({capability['native']}) {1e3 * native_s:.1f} ms: {pinned_s / native_s:.2f}x")
        rows.append({"name": "kernel", "pinned_s": times["avx2"], "native_s": times["native"], "ratio": pinned_s / native_s})
    if args.json:
        atomic_write(args.json, json.dumps([{k: v for k, v in r.items() if k != "metrics"} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
