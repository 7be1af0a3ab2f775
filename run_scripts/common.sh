#!/usr/bin/env bash
# One paper run: bash run_scripts/common.sh METHOD MODEL [hydra overrides...]
#   METHOD: grpo | entropy20 | justrl | stapo      MODEL: qwen3_1_7b | qwen3_8b | qwen3_14b (a config name)
# Environment (defaults in brackets):
#   LAUNCH [local]                      local: run the driver here (one node, or the head of a Ray cluster
#                                       whose nodes share this environment); submit: a detached Ray job on
#                                       the cluster at RAY_API_SERVER_ADDRESS (multi-node; docs/cluster.md)
#   RAY_API_SERVER_ADDRESS [http://127.0.0.1:8265]  submit: the Ray dashboard of the head node (Ray's own
#                                       variable for the jobs CLI; RAY_ADDRESS stays free for local runs)
#   NNODES [8]  GPUS_PER_NODE [8]       the paper used 64 GPUs; one node: NNODES=1 (docs/memory.md, "One node")
#   STAPO_DATA_DIR [data/stapo]         train.parquet, aime24_val.parquet from `python -m recipe.stapo.data.prepare`
#   STAPO_MODEL_DIR [Qwen]              folder holding Qwen3-*-Base (or the hub org name)
#   CKPT_DIR [checkpoints]              the run's folder is CKPT_DIR/<project>/<experiment>: checkpoints,
#                                       metrics.jsonl, tensorboard/; on a cluster, storage every node sees
#   LOGGER [wandb]                      wandb | console | file | tensorboard (comma-separated)
#   PROJECT [stapo]  EXPERIMENT [MODEL_METHOD]
#   PYTHON [python3 with the requirements, else the project's .venv]   interpreter with requirements.txt
#                                       installed (every node: same path; run_scripts/_python.sh)
#   RAY [ray]                           submit: Ray's command-line tool
#   STAPO_SECRETS_FILE                  submit: a file only you can read (chmod 600) on storage every node
#                                       sees, NAME=value lines; WANDB_API_KEY, HF_TOKEN stay out of the job
#   STAPO_DRY_RUN=1                     print the exact command instead of running it (submit: and the
#                                       job's runtime env, secret values masked)
#   STAPO_DRY_RUN=check                 print it, then validate the composed config here (no Ray)
# Relative paths (variables and overrides) are taken from the directory you launch from.
# Submit mode returns once the job is accepted and prints its submission id on stdout (how to follow and
# stop it on stderr); it refuses a second job of the same run while one is pending or running (exit 3).
# It forwards only an allow-list of variables (recipe/stapo/driver.py: STAPO_*, NCCL_*, GLOO_*,
# VLLM_*, CUDA_*, PyTorch's allocator, WANDB_*/HF_* ones); they never enter the Hydra config.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 METHOD MODEL [hydra overrides...]" >&2
  exit 2
fi
method=$1; model=$2; shift 2
launch_dir=$PWD
# the driver takes relative paths of the config from here (in submit mode it runs in Ray's copy of the project)
export STAPO_LAUNCH_DIR="$launch_dir"
cd "$(dirname "$0")/.."
repo=$PWD

# abs PATH BASE: PATH made absolute against BASE (URIs such as hdfs://... unchanged)
abs() {
  case "$1" in
    *://*|/*) printf '%s' "$1" ;;
    "~"|"~/"*) printf '%s' "$HOME${1#\~}" ;;
    *) printf '%s/%s' "$2" "$1" ;;
  esac
}

case "${LAUNCH:-local}" in
  local|submit) ;;
  *) echo "LAUNCH: unknown mode '${LAUNCH}' (expected local or submit)" >&2; exit 2 ;;
esac

loggers="console"
IFS=',' read -ra wanted <<< "${LOGGER:-wandb}"
for l in "${wanted[@]}"; do
  case "$l" in
    console) ;;
    wandb|file|tensorboard) loggers="$loggers,$l" ;;
    *) echo "LOGGER: unknown logger '$l' (expected wandb, console, file or tensorboard)" >&2; exit 2 ;;
  esac
done

# user-given paths are relative to where you launched; the defaults to the repository
if [ -n "${STAPO_DATA_DIR:-}" ]; then export STAPO_DATA_DIR="$(abs "$STAPO_DATA_DIR" "$launch_dir")"
else export STAPO_DATA_DIR="$repo/data/stapo"; fi
if [ -n "${STAPO_MODEL_DIR:-}" ]; then
  case "$STAPO_MODEL_DIR" in
    /*|./*|../*|"~"*) export STAPO_MODEL_DIR="$(abs "$STAPO_MODEL_DIR" "$launch_dir")" ;;
    *) [ -d "$launch_dir/$STAPO_MODEL_DIR" ] && export STAPO_MODEL_DIR="$launch_dir/$STAPO_MODEL_DIR" ;;
  esac
fi
if [ -n "${CKPT_DIR:-}" ]; then ckpt="$(abs "$CKPT_DIR" "$launch_dir")"; else ckpt="$repo/checkpoints"; fi
project=${PROJECT:-stapo}
experiment=${EXPERIMENT:-${model}_${method}}
source run_scripts/_python.sh   # sets python (PYTHON, else python3 or the project's .venv)
export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:-verl_patches.activate}"

train=(
  -m recipe.stapo.main_stapo
  "method=$method" "model=$model"
  "trainer.nnodes=${NNODES:-8}"
  "trainer.n_gpus_per_node=${GPUS_PER_NODE:-8}"
  "trainer.logger=[$loggers]"
  "trainer.project_name=$project"
  "trainer.experiment_name=$experiment"
  "trainer.default_local_dir=$ckpt/$project/$experiment"
  "$@"
)

if [ "${LAUNCH:-local}" = submit ]; then
  address=${RAY_API_SERVER_ADDRESS:-}
  case "${RAY_ADDRESS:-}" in http://*|https://*) address=${address:-$RAY_ADDRESS} ;; esac
  address=${address:-http://127.0.0.1:8265}
  # Ray's token authentication: the jobs client sends the token only with RAY_AUTH_MODE=token; a token
  # found here is sent (a cluster without authentication ignores it)
  if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] \
       || [ -f "$HOME/.ray/auth_token" ]; }; then
    export RAY_AUTH_MODE=token
  fi
  ray=${RAY:-ray}
  # the job's runtime env (secrets included) goes through a private file, never the command line
  runtime_env=$(mktemp "${TMPDIR:-/tmp}/stapo_runtime_env.XXXXXX.json")
  chmod 600 "$runtime_env"
  trap 'rm -f "$runtime_env"' EXIT
  "$python" -m recipe.stapo.driver runtime-env > "$runtime_env"
  if [ "${STAPO_DRY_RUN:-0}" != "0" ]; then
    id=$("$python" -m recipe.stapo.jobs next-id --offline --project "$project" --experiment "$experiment")
  else
    rc=0
    id=$("$python" -m recipe.stapo.jobs next-id --address "$address" --project "$project" --experiment "$experiment") || rc=$?
    [ "$rc" = 0 ] || exit "$rc"
  fi
  cmd=("$ray" job submit --address "$address" --submission-id "$id" --no-wait
       --working-dir "$repo" --runtime-env "$runtime_env" -- "$python" "${train[@]}")
else
  case "${RAY_ADDRESS:-}" in
    http://*|https://*)  # a dashboard address (the jobs CLI's): ray.init would refuse it
      echo "[stapo] RAY_ADDRESS=$RAY_ADDRESS is a dashboard address (for LAUNCH=submit, RAY_API_SERVER_ADDRESS);" \
           "the local driver ignores it" >&2
      unset RAY_ADDRESS ;;
  esac
  cmd=("$python" "${train[@]}")
fi

if [ "${STAPO_DRY_RUN:-0}" != "0" ]; then
  printf '%q ' "${cmd[@]}"; echo
  if [ "${LAUNCH:-local}" = submit ]; then   # the file the command names is deleted on exit: its content, here
    echo "[stapo] $runtime_env (deleted when this script exits; a launch writes its own) holds the job's" \
         "runtime env, secret values masked:" >&2
    "$python" -c 'import json, sys
from recipe.stapo.driver import SECRET_ENV_NAMES
env = json.load(open(sys.argv[1]))
env["env_vars"] = {k: "<secret, not shown>" if k in SECRET_ENV_NAMES else v for k, v in env["env_vars"].items()}
print(json.dumps(env, indent=1))' "$runtime_env" >&2
  fi
  if [ "$STAPO_DRY_RUN" = check ]; then
    "$python" "${train[@]}" --check >&2
  fi
  exit 0
fi
if [ "${LAUNCH:-local}" = submit ]; then
  "${cmd[@]}" >&2   # returns once the job is accepted (--no-wait); the runtime env file is removed on exit
  echo "[stapo] submitted $id (run $project/$experiment, folder $ckpt/$project/$experiment)" >&2
  "$python" -c 'import sys; from recipe.stapo.jobs import follow_commands; print(follow_commands(*sys.argv[1:]))' \
    "$id" "$address" >&2
  echo "$id"
else
  exec "${cmd[@]}"
fi
