#!/usr/bin/env bash
# One paper run: bash run_scripts/common.sh METHOD MODEL [hydra overrides...]
#   METHOD: grpo | entropy20 | justrl | stapo      MODEL: qwen3_1_7b | qwen3_8b | qwen3_14b
# Environment (defaults in brackets):
#   NNODES [8]  GPUS_PER_NODE [8]       the paper used 64 GPUs
#   STAPO_DATA_DIR [data/stapo]         train.parquet, aime24.parquet from `python -m recipe.stapo.data.prepare`
#   STAPO_MODEL_DIR [Qwen]              folder holding Qwen3-*-Base (or the hub org name)
#   CKPT_DIR [checkpoints]              checkpoints go to CKPT_DIR/<project>/<experiment>
#   LOGGER [wandb]                      wandb | console | file | tensorboard (comma-separated)
#   PROJECT [stapo]  EXPERIMENT [MODEL_METHOD]
#   PYTHON [python3]                    interpreter with requirements.txt installed
#   STAPO_DRY_RUN=1                     print the command instead of running it
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 METHOD MODEL [hydra overrides...]" >&2
  exit 2
fi
method=$1; model=$2; shift 2
cd "$(dirname "$0")/.."

loggers="console"
IFS=',' read -ra wanted <<< "${LOGGER:-wandb}"
for l in "${wanted[@]}"; do
  case "$l" in
    console) ;;
    wandb|file|tensorboard) loggers="$loggers,$l" ;;
    *) echo "LOGGER: unknown logger '$l' (expected wandb, console, file or tensorboard)" >&2; exit 2 ;;
  esac
done

cmd=(
  "${PYTHON:-python3}" -m recipe.stapo.main_stapo
  "method=$method" "model=$model"
  "trainer.nnodes=${NNODES:-8}"
  "trainer.n_gpus_per_node=${GPUS_PER_NODE:-8}"
  "trainer.logger=[$loggers]"
  "trainer.project_name=${PROJECT:-stapo}"
  "trainer.experiment_name=${EXPERIMENT:-${model}_${method}}"
  "trainer.default_local_dir=${CKPT_DIR:-checkpoints}/${PROJECT:-stapo}/${EXPERIMENT:-${model}_${method}}"
  "$@"
)
if [ "${STAPO_DRY_RUN:-0}" = "1" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:-verl_patches}"
exec "${cmd[@]}"
