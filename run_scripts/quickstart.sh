#!/usr/bin/env bash
# Quickstart on a machine without a GPU (README's main command):
#   bash run_scripts/quickstart.sh [--steps 16] [--out results/quickstart] [--methods grpo,stapo] ...
#   bash run_scripts/quickstart.sh --out results/study --seeds 3 --test-freq 8   # the study (docs/miniature.md)
#   bash run_scripts/quickstart.sh --evaluate   # also each method's final checkpoint, merged, evaluated, Table 2
# Creates/refreshes .venv (CPU stack), takes the tiny assets the repository ships (stapo_cpu/shipped_assets),
# then trains GRPO, 20-Entropy, JustRL and STAPO with verl's real trainer on CPU, identical settings
# and seeds, STAPO at the paper's S2T settings (tau_p = 0.002, q = 0.75; refused otherwise), and
# writes results/quickstart/ (per-method run folders with verl's metrics.jsonl and the S2T token
# dump, summary.md with the settings, summary.json, settings.json, curves). See docs/miniature.md.
# Each run may take --timeout seconds (default 1200); one still going then is stopped and named.
# Arguments go to `python -m stapo_cpu.quickstart` (see --help); each is checked before anything
# is built, and a bad one exits 2 with a message naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/_venv.sh
exec python -m stapo_cpu.quickstart "$@"
