#!/usr/bin/env bash
# Paper run: justrl on Qwen3-1.7B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=justrl, model=qwen3_1_7b); extra arguments are Hydra overrides.
# GPUs: NNODES [8] x GPUS_PER_NODE [8]. One node of 8 GPUs (docs/memory.md, "One node"; the preflight
# names what to change for another setup):
#   NNODES=1, nothing else
exec bash "$(dirname "$0")/common.sh" justrl qwen3_1_7b "$@"
