#!/usr/bin/env bash
# Paper run: entropy20 on Qwen3-8B-Base. Settings: run_scripts/common.sh (environment) and
# recipe/stapo/config (method=entropy20, model=qwen3_8b); extra arguments are Hydra overrides.
exec bash "$(dirname "$0")/common.sh" entropy20 qwen3_8b "$@"
