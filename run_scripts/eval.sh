#!/usr/bin/env bash
# Evaluate one checkpoint on the six benchmarks (mean@N, both decoding settings).
#   MODEL=/ckpt/stapo-8b/hf SCALE=8B METHOD=STAPO bash run_scripts/eval.sh [extra run_eval args]
# Env vars (defaults): MODEL (required), BENCH_DIR (data/stapo), OUT (results/eval/$(basename MODEL)),
# DECODING (both), BACKEND (vllm), VERIFIER (none), SCALE, METHOD. Extra args go to run_eval.
# Rerunning the same command resumes an interrupted evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${VIRTUAL_ENV:-}" ]; then :; elif [ -x .venv/bin/python ]; then source .venv/bin/activate; fi
: "${MODEL:?set MODEL to a checkpoint (HF format) path or hub id}"
BENCH_DIR="${BENCH_DIR:-data/stapo}"
OUT="${OUT:-results/eval/$(basename "$MODEL")}"
args=(--model "$MODEL" --benchmarks-dir "$BENCH_DIR" --out "$OUT"
      --decoding "${DECODING:-both}" --backend "${BACKEND:-vllm}" --verifier "${VERIFIER:-none}")
[ -n "${SCALE:-}" ] && args+=(--scale "$SCALE")
[ -n "${METHOD:-}" ] && args+=(--method "$METHOD")
exec python -m recipe.stapo.eval.run_eval "${args[@]}" "$@"
