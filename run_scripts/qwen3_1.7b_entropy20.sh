#!/usr/bin/env bash
# Paper run: entropy20 on Qwen3-1.7B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=entropy20, model=qwen3_1_7b); extra arguments are Hydra overrides.
# GPUs: NNODES [8] x GPUS_PER_NODE [8]. One node of 8 80 GB GPUs (docs/memory.md, "One node"; its
# "Verdicts on common cards" has 40 to 141 GB cards, and the preflight names what to change for any setup):
#   NNODES=1, nothing else
source "$(dirname "$0")/common.sh" entropy20 qwen3_1_7b "$@"
