#!/usr/bin/env bash
# One paper run: bash run_scripts/common.sh METHOD MODEL [hydra overrides...]
#   METHOD: grpo | entropy20 | justrl | stapo      MODEL: qwen3_1_7b | qwen3_8b | qwen3_14b (a config name)
# The run scripts run_scripts/qwen3_<size>_<method>.sh source it with their method and model; a method= or
# model= override contradicting a script's name is refused (it would run something else under that name).
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
#   PROJECT [stapo]  EXPERIMENT [MODEL_METHOD]   the run's names, of its folder, its wandb run and its Ray job
#                                       alike (so trainer.project_name / experiment_name overrides are refused):
#                                       kept as written, except '${', a backslash, an absolute name, a '.' or '..' part
#   PYTHON [python3 with the requirements, else the project's .venv]   interpreter with requirements.txt
#                                       installed (every node: same path; run_scripts/_python.sh)
#   RAY [ray]                           submit: Ray's command-line tool
#   STAPO_SECRETS_FILE                  submit: a file only you can read (chmod 600) on storage every node
#                                       sees, NAME=value lines; WANDB_API_KEY, HF_TOKEN stay out of the job
#   STAPO_DRY_RUN=1                     print the exact command instead of running it (submit: and the
#                                       job's runtime env, secret values masked)
#   STAPO_DRY_RUN=check                 validate the composed config here (no Ray) and print what it runs
# Relative paths (variables and overrides) are taken from the directory you launch from. Each key reaches
# Hydra once, with its final value (an override replaces this script's value of the key, or an earlier one).
# Submit mode returns once the job is accepted and prints its submission id on stdout (how to follow and
# stop it on stderr); it refuses a second job of the same run while one is pending or running (exit 3).
# It forwards only an allow-list of variables (recipe/stapo/driver.py: STAPO_*, NCCL_*, GLOO_*,
# VLLM_*, CUDA_*, PyTorch's allocator, WANDB_*/HF_* ones); they never enter the Hydra config, and an
# override whose key names a credential is refused (docs/cluster.md, "Secrets").
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 METHOD MODEL [hydra overrides...]" >&2
  exit 2
fi
method=$1; model=$2; shift 2
script=$(basename "$0")   # the run script that sourced this file (qwen3_8b_stapo.sh), or common.sh
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

# hydra_name VAR VALUE [folder]: VALUE as a quoted string of Hydra's override grammar, which then reads '=',
# ',', quotes, spaces and words such as null or 1e-6 as the name itself; exits 2 naming VAR on what no quoting
# keeps as written ('${' starts an interpolation, a backslash an escape) and, for a name that is also a folder
# (`folder`), on an absolute name or a '.' or '..' part, which would put the folder elsewhere
hydra_name() {
  local problem=""
  case "$2" in
    *'${'*) problem="'\${' would be read as an interpolation and replaced" ;;
    *\\*) problem="a backslash would be read as an escape" ;;
  esac
  if [ -z "$problem" ] && [ "${3:-}" = folder ]; then
    case "/$2/" in
      //*|*/./*|*/../*) problem="an absolute name or a '.' or '..' part would put the run's folder (CKPT_DIR/PROJECT/EXPERIMENT) elsewhere" ;;
    esac
  fi
  if [ -n "$problem" ]; then
    echo "$1=$2: $problem; choose a name without it (any other character is kept as written)" >&2
    exit 2
  fi
  printf "'%s'" "${2//\'/\\\'}"
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
folder=$ckpt/$project/$experiment
quoted_project=$(hydra_name PROJECT "$project" folder)
quoted_experiment=$(hydra_name EXPERIMENT "$experiment" folder)
quoted_folder=$(hydra_name CKPT_DIR "$folder")

for override in "$@"; do
  key=${override%%=*}
  key=${key#"${key%%[!+~]*}"}   # without Hydra's +, ++ or ~
  case "$key" in
    method|model)
      mine=$method other=${model}_${override#*=}
      [ "$key" = model ] && mine=$model other=${override#*=}_$method
      [ "$override" = "$key=$mine" ] && continue
      hint="drop the override"
      [ -f "run_scripts/${other/1_7b/1.7b}.sh" ] && hint="run run_scripts/${other/1_7b/1.7b}.sh instead"
      echo "$script runs $key=$mine: the override $override would train another $key under this run's name" \
           "$project/$experiment (its folder, wandb run and Ray job); $hint" >&2
      exit 2 ;;
    trainer.project_name|trainer.experiment_name)
      var=PROJECT; [ "$key" = trainer.experiment_name ] && var=EXPERIMENT
      echo "$override: the run's names come from PROJECT and EXPERIMENT, which name its folder" \
           "(CKPT_DIR/PROJECT/EXPERIMENT), its wandb run and its Ray job together; set $var instead" >&2
      exit 2 ;;
    trainer.default_local_dir) folder=${override#*=} ;;
  esac
done
source run_scripts/_python.sh   # sets python (PYTHON, else python3 or the project's .venv)

# each key once, with its final value: a plain key=value is left out when a later argument sets its key
# again (Hydra would apply both, the later winning); +key (add) and ~key (delete) are kept as given
args=("method=$method" "model=$model" "trainer.nnodes=${NNODES:-8}" "trainer.n_gpus_per_node=${GPUS_PER_NODE:-8}"
      "trainer.logger=[$loggers]" "trainer.project_name=$quoted_project" "trainer.experiment_name=$quoted_experiment"
      "trainer.default_local_dir=$quoted_folder" "$@")
overrides=()
declare -A later=()
for ((i = ${#args[@]} - 1; i >= 0; i--)); do
  arg=${args[i]}
  key=${arg%%=*}
  case "$arg" in
    [+~]*) [[ $key == ++* ]] && later[${key#++}]=1 ;;
    *=*) [ -n "${later[$key]:-}" ] && continue
         later[$key]=1 ;;
  esac
  overrides=("$arg" "${overrides[@]}")
done
train=(-m recipe.stapo.main_stapo "${overrides[@]}")

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
  case "$python" in
    "$repo/.venv/"*|.venv/*)   # the upload leaves .venv out (recipe/stapo/driver.py, WORKING_DIR_EXCLUDES)
      echo "[stapo] warning: the job runs $python, the project's .venv, which is not uploaded with the job: it" \
           "starts only where the head node has it at this path; set PYTHON to an environment every node has" \
           "(docs/cluster.md, section 1)" >&2 ;;
  esac
  # the job's runtime env (secrets included) goes through a private file, never the command line; the
  # driver refuses an override it would refuse in the job (a credential) before the job exists
  runtime_env=$(mktemp "${TMPDIR:-/tmp}/stapo_runtime_env.XXXXXX.json")
  chmod 600 "$runtime_env"
  trap 'rm -f "$runtime_env"' EXIT
  "$python" -m recipe.stapo.driver runtime-env "${overrides[@]}" > "$runtime_env"
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
  # the command, or with check what it runs (after the check: every key once, its final value)
  [ "$STAPO_DRY_RUN" = check ] || { printf '%q ' "${cmd[@]}"; echo; }
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
  echo "[stapo] submitted $id (run $project/$experiment, folder $folder)" >&2
  "$python" -c 'import sys; from recipe.stapo.jobs import follow_commands; print(follow_commands(*sys.argv[1:]))' \
    "$id" "$address" >&2
  echo "$id"
else
  exec "${cmd[@]}"
fi
