#!/usr/bin/env bash
# Paper run: stapo on Qwen3-1.7B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=stapo, model=qwen3_1_7b); extra arguments are Hydra overrides.
exec bash "$(dirname "$0")/common.sh" stapo qwen3_1_7b "$@"
