#!/usr/bin/env bash
# Paper run: grpo on Qwen3-8B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=grpo, model=qwen3_8b); extra arguments are Hydra overrides.
exec bash "$(dirname "$0")/common.sh" grpo qwen3_8b "$@"
