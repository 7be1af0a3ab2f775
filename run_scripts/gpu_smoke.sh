#!/usr/bin/env bash
# The first thing to run on a new cluster: one node, short lengths, STEPS training steps of each method
# (checkpoint at the last step), then an evaluation of 2 problems of that checkpoint. A few minutes on one GPU.
# Then LENGTHS=paper: the same at the paper's 16k-token lengths and token budgets (the memory-hungry steps).
#   MODEL=/models/Qwen3-1.7B-Base bash run_scripts/gpu_smoke.sh [hydra overrides for every run...]
#   MODEL=/models/Qwen3-1.7B-Base LENGTHS=paper bash run_scripts/gpu_smoke.sh
# Every run goes through the driver's preflight (docs/preflight.md): GPU_MEM_GB [79.1, an 80 GB card as CUDA
# reports it] sizes its memory check. In GPU mode every run is a calibration run (the memory probes in
# every verl process: stapo_memory.probes in VERL_USE_EXTERNAL_MODULES); after each run the estimate and the
# measured peaks go to OUT/memory_calibration.txt (python -m stapo_memory.calibration, docs/memory.md).
# Environment (defaults in brackets):
#   MODEL                  local Hugging Face folder of the model (GPU mode; required)
#   GPUS [1]               GPUs of this node to use
#   STAPO_DATA_DIR [data/stapo]  train.parquet, aime24_val.parquet and aime24.parquet (`python -m recipe.stapo.data.prepare`)
#   METHODS [the paper's: recipe.stapo.methods.PAPER_METHODS]   STEPS [2]
#   LENGTHS [short]        short: prompt / response 512 / 1024 tokens, 16 prompts x 4 responses (minutes);
#                          paper: the paper's 1024 / 15360 tokens with the model config's token budgets,
#                          8 prompts x 4 responses, 2 updates per step: the first 16k-token steps run on
#                          this node, not on the cluster (GPU mode only)
#   OUT [results/gpu_smoke]  per-method run folders (metrics.jsonl, log, checkpoints) and eval/
#   PYTHON [python3 with the requirements, else the project's .venv]  interpreter with requirements.txt installed
#   SMOKE_DEVICE [gpu]     cpu: the same script without a GPU: the tiny model in ASSETS [the shipped
#                          set, stapo_cpu/shipped_assets; another folder is built], verl's real
#                          trainer on CPU with verl's vLLM rollout on vLLM's CPU build, HF evaluation
#                          (the project's tests run this mode)
#   STAPO_DRY_RUN=1        print the training commands only
# It stops at the first failure and names the log to read.
set -euo pipefail
launch_dir=$PWD
cd "$(dirname "$0")/.."
here=$PWD/run_scripts
source run_scripts/_python.sh   # sets python (PYTHON, else python3 or the project's .venv)
abs() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$2" "$1" ;; esac; }
out=$(abs "${OUT:-results/gpu_smoke}" "$([ -n "${OUT:-}" ] && echo "$launch_dir" || echo "$PWD")")
steps=${STEPS:-2}
[[ "$steps" =~ ^[0-9]+$ ]] && [ "$steps" -ge 1 ] || { echo "STEPS='$steps': expected a whole number >= 1 (training steps per method)" >&2; exit 2; }
device=${SMOKE_DEVICE:-gpu}
lengths=${LENGTHS:-short}
case "$lengths" in
  short|paper) ;;
  *) echo "LENGTHS: unknown value '$lengths' (expected short or paper)" >&2; exit 2 ;;
esac
if [ "$lengths" = paper ] && [ "$device" != gpu ]; then
  echo "LENGTHS=paper needs SMOKE_DEVICE=gpu (the tiny CPU model is trained on ~100-token sequences)" >&2; exit 2
fi

case "$device" in
  gpu)
    : "${MODEL:?set MODEL to a local Hugging Face model folder (e.g. Qwen3-1.7B-Base)}"
    model=$(abs "$MODEL" "$launch_dir")
    [ -f "$model/config.json" ] || { echo "MODEL=$model: no config.json (a Hugging Face model folder is needed)" >&2; exit 2; }
    gpus=${GPUS:-1}
    if [ -n "${STAPO_DATA_DIR:-}" ]; then data=$(abs "$STAPO_DATA_DIR" "$launch_dir"); else data=$PWD/data/stapo; fi
    bench_dir=$data
    eval_backend=vllm; eval_tokens=1024
    export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:-verl_patches.activate},stapo_memory.probes"
    [ "$lengths" = paper ] && eval_tokens=15360
    ;;
  cpu)
    assets=$(abs "${ASSETS:-stapo_cpu/shipped_assets}" "$([ -n "${ASSETS:-}" ] && echo "$launch_dir" || echo "$PWD")")
    "$python" -m stapo_cpu.assets "$assets" >&2   # reused when already built
    # the CPU path's environment (VERL_PLATFORM=cpu, the CPU shims in every verl process...)
    exports=$("$python" -c '
import os, shlex
from stapo_cpu.trainer import cpu_env
for key, value in cpu_env().items():
    if os.environ.get(key) != value:
        print(f"export {key}={shlex.quote(value)}")')
    eval "$exports"
    bench_dir=$out/bench
    eval_backend=hf; eval_tokens=32
    ;;
  *) echo "SMOKE_DEVICE: unknown device '$device' (expected gpu or cpu)" >&2; exit 2 ;;
esac
[ -n "${METHODS:-}" ] || METHODS=$("$python" -c 'from recipe.stapo.methods import PAPER_METHODS; print(*PAPER_METHODS)')
read -ra methods <<< "$METHODS"
# every refusal is above: a refused or dry run leaves no folder behind
if [ "${STAPO_DRY_RUN:-0}" = "0" ]; then
  mkdir -p "$out"
  if [ "$device" = cpu ]; then mkdir -p "$bench_dir" && cp "$assets/val.parquet" "$bench_dir/aime24.parquet"; fi
fi

# overrides RUN_DIR: this device's settings for one short run saving a checkpoint at its last step (the run's
# names come from PROJECT and EXPERIMENT, which common.sh reads)
overrides() {
  local run_dir=$1
  if [ "$device" = cpu ]; then
    "$python" -c '
import sys
from stapo_cpu.trainer import cpu_overrides
names = ("trainer.project_name=", "trainer.experiment_name=")
print("\n".join(o for o in cpu_overrides(sys.argv[1], sys.argv[2], steps=int(sys.argv[3]), save_freq=int(sys.argv[3]))
                if not o.startswith(names)))' \
      "$assets" "$run_dir" "$steps"
  else
    if [ "$lengths" = paper ]; then   # the paper's lengths (stapo_trainer.yaml), the model config's budgets
      printf '%s\n' "data.train_batch_size=8" "actor_rollout_ref.rollout.n=4" "actor_rollout_ref.actor.ppo_mini_batch_size=4"
    else
      printf '%s\n' "data.max_prompt_length=512" "data.max_response_length=1024" "data.train_batch_size=16" \
        "actor_rollout_ref.rollout.n=4" "actor_rollout_ref.actor.ppo_mini_batch_size=8"
    fi
    printf '%s\n' \
      "actor_rollout_ref.model.path=$model" "trainer.nnodes=1" "trainer.n_gpus_per_node=$gpus" \
      "actor_rollout_ref.rollout.tensor_model_parallel_size=1" "actor_rollout_ref.rollout.gpu_memory_utilization=0.5" \
      "trainer.total_training_steps=$steps" "trainer.save_freq=$steps" "trainer.test_freq=-1" \
      "trainer.val_before_train=false" "trainer.resume_mode=disable" "trainer.logger=[console,file]" \
      "trainer.default_local_dir=$run_dir/checkpoints"
  fi
}

for m in "${methods[@]}"; do
  run_dir=$out/$m
  mapfile -t run_overrides < <(overrides "$run_dir")
  if [ "${STAPO_DRY_RUN:-0}" != "0" ]; then   # print each run's command (common.sh), nothing else
    NNODES=1 GPUS_PER_NODE=${gpus:-1} PYTHON=$python LAUNCH=local PROJECT=stapo_smoke EXPERIMENT=smoke_$m \
      bash "$here/common.sh" "$m" qwen3_1_7b "${run_overrides[@]}" "$@"
    continue
  fi
  mkdir -p "$run_dir"
  echo "[smoke] $m: $steps step(s), log in $run_dir/train.log" >&2
  if ! VERL_FILE_LOGGER_PATH=$run_dir/metrics.jsonl STAPO_DATA_DIR=${data:-} LAUNCH=local \
       NNODES=1 GPUS_PER_NODE=${gpus:-1} PYTHON=$python PROJECT=stapo_smoke EXPERIMENT=smoke_$m \
       bash "$here/common.sh" "$m" qwen3_1_7b "${run_overrides[@]}" "$@" > "$run_dir/train.log" 2>&1; then
    echo "[smoke] $m FAILED: see $run_dir/train.log" >&2
    tail -n 40 "$run_dir/train.log" >&2
    exit 1
  fi
  [ -d "$run_dir/checkpoints/global_step_$steps" ] || { echo "[smoke] $m: no checkpoint global_step_$steps in $run_dir/checkpoints" >&2; exit 1; }
  if [ "$device" = gpu ]; then   # the memory model's estimate next to the measured peaks (docs/memory.md)
    "$python" -m stapo_memory.calibration "$run_dir" | tee -a "$out/memory_calibration.txt" >&2 || true
  fi
done

[ "${STAPO_DRY_RUN:-0}" != "0" ] && exit 0
last=${methods[${#methods[@]}-1]}
echo "[smoke] evaluating $last's checkpoint on 2 problems" >&2
MODEL=$out/$last/checkpoints/global_step_$steps STAPO_DATA_DIR=$bench_dir OUT=$out/eval BACKEND=$eval_backend \
  DECODING=train PYTHON=$python bash "$here/eval.sh" --benchmarks aime24 --n-samples 1 --limit 2 \
  --max-new-tokens "$eval_tokens" > "$out/eval.log" 2>&1 || {
    echo "[smoke] evaluation FAILED: see $out/eval.log" >&2; tail -n 40 "$out/eval.log" >&2; exit 1; }
echo "[smoke] OK: ${methods[*]} trained $steps step(s) each; evaluation in $out/eval" >&2
