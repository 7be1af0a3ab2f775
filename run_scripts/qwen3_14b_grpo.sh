#!/usr/bin/env bash
# Paper run: grpo on Qwen3-14B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=grpo, model=qwen3_14b); extra arguments are Hydra overrides.
exec bash "$(dirname "$0")/common.sh" grpo qwen3_14b "$@"
