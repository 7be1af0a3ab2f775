#!/usr/bin/env bash
# Quickstart on a machine without a GPU (README's main command):
#   bash run_scripts/quickstart.sh [--steps 5] [--out results/quickstart] [--methods grpo,stapo] ...
# Creates/refreshes .venv (CPU stack), builds the tiny assets in assets/tiny (reused when present),
# then trains GRPO, 20-Entropy, JustRL and STAPO with verl's real trainer on CPU, a few steps each,
# identical settings and seeds, and writes results/quickstart/ (per-method run folders with verl's
# metrics.jsonl, summary.md, summary.json, reward and entropy plots). About 8-10 minutes on 2 cores.
# Arguments go to `python -m recipe.stapo.quickstart` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/_venv.sh
exec python -m recipe.stapo.quickstart "$@"
