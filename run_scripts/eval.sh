#!/usr/bin/env bash
# Evaluate one checkpoint on the six benchmarks (mean@N, both decoding settings).
#   MODEL=checkpoints/stapo/qwen3_8b_stapo/global_step_3000 SCALE=8B METHOD=STAPO bash run_scripts/eval.sh [run_eval args]
# MODEL (required): a Hugging Face model folder, a hub id, or a verl checkpoint folder `global_step_N`
#   (or its `actor/` folder): that one is first converted with verl's own model merger
#   (`python -m verl.model_merger merge --backend fsdp`) into MERGED_DIR [global_step_N/merged_hf,
#   beside actor/, where checkpoint retention does not reach], once; a later run reuses the converted
#   copy, also after retention removed the checkpoint's actor/ folder.
# Env vars (defaults): PYTHON (python3: the interpreter with requirements.txt installed), BENCH_DIR
# (data/stapo), OUT (results/eval/[SCALE_][METHOD_]<run>_step<N>, or the model folder's last two names),
# DECODING (both), BACKEND (vllm), VERIFIER (none), SCALE, METHOD. Extra args go to run_eval.
# Relative paths are taken from the directory you launch from.
# Rerunning the same command resumes an interrupted evaluation.
set -euo pipefail
launch_dir=$PWD
cd "$(dirname "$0")/.."
repo=$PWD
: "${MODEL:?set MODEL to a checkpoint (HF folder, verl global_step_N folder) or hub id}"
python=${PYTHON:-python3}

# abs PATH BASE: PATH made absolute against BASE
abs() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$2" "$1" ;; esac; }

model=$MODEL
case "$model" in /*|./*|../*) model=$(abs "$model" "$launch_dir") ;; *) [ -e "$launch_dir/$model" ] && model="$launch_dir/$model" ;; esac
model=${model%/}

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

# a verl checkpoint (FSDP shards): convert it once with verl's own merger
actor=""
if [ -d "$model/actor" ] && [ ! -f "$model/config.json" ]; then actor="$model/actor"
elif compgen -G "$model/model_world_size_*_rank_0.pt" > /dev/null; then actor="$model"
elif [ -z "${MERGED_DIR:-}" ] && [ ! -f "$model/config.json" ] && [ -f "$model/merged_hf/config.json" ]; then
  model=$model/merged_hf   # its actor/ was pruned; the converted copy stays
fi
if [ -n "$actor" ]; then
  merged=${MERGED_DIR:+$(abs "$MERGED_DIR" "$launch_dir")}
  merged=${merged:-$(dirname "$actor")/merged_hf}
  if [ ! -f "$merged/config.json" ] || ! compgen -G "$merged/*.safetensors" > /dev/null; then
    echo "[stapo] converting the verl checkpoint $actor to a Hugging Face model in $merged" >&2
    rm -rf "$merged.partial"
    "$python" -m verl.model_merger merge --backend fsdp --local_dir "$actor" --target_dir "$merged.partial" >&2
    rm -rf "$merged"
    mv "$merged.partial" "$merged"
  fi
  model=$merged
fi

BENCH_DIR=$(abs "${BENCH_DIR:-data/stapo}" "$([ -n "${BENCH_DIR:-}" ] && echo "$launch_dir" || echo "$repo")")
OUT=$(abs "${OUT:-results/eval/$name}" "$([ -n "${OUT:-}" ] && echo "$launch_dir" || echo "$repo")")
args=(--model "$model" --benchmarks-dir "$BENCH_DIR" --out "$OUT"
      --decoding "${DECODING:-both}" --backend "${BACKEND:-vllm}" --verifier "${VERIFIER:-none}")
[ -n "${SCALE:-}" ] && args+=(--scale "$SCALE")
[ -n "${METHOD:-}" ] && args+=(--method "$METHOD")
echo "[stapo] evaluating $model -> $OUT" >&2
exec "$python" -m recipe.stapo.eval.run_eval "${args[@]}" "$@"
