#!/usr/bin/env bash
# Paper run: justrl on Qwen3-14B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=justrl, model=qwen3_14b); extra arguments are Hydra overrides.
# GPUs: NNODES [8] x GPUS_PER_NODE [8]. One node of 8 80 GB GPUs (docs/memory.md, "One node"; its
# "Verdicts on common cards" has 40 to 141 GB cards, and the preflight names what to change for any setup):
#   NNODES=1 with actor_rollout_ref.rollout.gpu_memory_utilization=0.6
source "$(dirname "$0")/common.sh" justrl qwen3_14b "$@"
