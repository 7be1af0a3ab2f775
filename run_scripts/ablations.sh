#!/usr/bin/env bash
# The paper's S2T ablations, one run each (docs/method.md, "S2T"):
#   masking strategy: low_entropy (STAPO) | high_entropy | random | full ("JustRL-FullMask")
#   q sweep and tau_p sweep around the defaults (q=0.75, tau_p=0.002).
# Beyond the paper: `compose` runs S2T on top of other verl policy losses (STAPO+GSPO, STAPO+CISPO)
# on Qwen3-8B (MODEL_CONFIG is ignored there).
# usage: bash run_scripts/ablations.sh [strategy|q|tau_p|compose|all] [hydra overrides...]
# Environment: as run_scripts/common.sh, plus MODEL_CONFIG [qwen3_1_7b] (the model config: qwen3_1_7b,
# qwen3_8b or qwen3_14b), Q_VALUES, TAU_P_VALUES. MODEL is not read: in this project's scripts it names
# a model folder (gpu_smoke.sh, eval.sh). With LAUNCH=local the runs follow one another; with
# LAUNCH=submit each is a detached Ray job and the loop returns once all are submitted. A run that fails
# (or whose earlier job still runs, in submit mode) does not stop the others; the list of failed runs
# is printed at the end and the exit status is 1.
set -euo pipefail
sweep=${1:-all}; [ $# -gt 0 ] && shift
case "$sweep" in strategy|q|tau_p|compose|all) ;; *) echo "unknown sweep '$sweep' (strategy|q|tau_p|compose|all)" >&2; exit 2 ;; esac
model=${MODEL_CONFIG:-qwen3_1_7b}
case "$model" in
  qwen3_1_7b|qwen3_8b|qwen3_14b) ;;
  *) echo "MODEL_CONFIG: unknown model config '$model' (expected qwen3_1_7b, qwen3_8b or qwen3_14b)" >&2; exit 2 ;;
esac
case "${MODEL:-}" in
  qwen3_1_7b|qwen3_8b|qwen3_14b)
    echo "MODEL=$MODEL: the ablations' model config is MODEL_CONFIG (MODEL names a model folder in this project's scripts)" >&2
    exit 2 ;;
esac
here="$(dirname "$0")"
extra=("$@")
failed=()

run() {  # run EXPERIMENT MODEL_CONFIG OVERRIDES...
  local name=$1 config=$2; shift 2
  if ! EXPERIMENT="$name" bash "$here/common.sh" stapo "$config" "$@" "${extra[@]}"; then
    failed+=("$name")
  fi
}
if [ "$sweep" = strategy ] || [ "$sweep" = all ]; then
  for s in low_entropy high_entropy random full; do
    run "${model}_stapo_strategy_$s" "$model" "actor_rollout_ref.actor.policy_loss.strategy=$s"
  done
fi
if [ "$sweep" = q ] || [ "$sweep" = all ]; then
  for q in ${Q_VALUES:-0.5 0.9}; do
    run "${model}_stapo_q_$q" "$model" "actor_rollout_ref.actor.policy_loss.q=$q"
  done
fi
if [ "$sweep" = tau_p ] || [ "$sweep" = all ]; then
  for t in ${TAU_P_VALUES:-0.001 0.005 0.01}; do
    run "${model}_stapo_tau_p_$t" "$model" "actor_rollout_ref.actor.policy_loss.tau_p=$t"
  done
fi
if [ "$sweep" = compose ]; then
  for loss in gspo cispo; do
    run "qwen3_8b_stapo_${loss}" qwen3_8b "actor_rollout_ref.actor.policy_loss.loss_mode=$loss"
  done
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "[stapo] ablations: ${#failed[@]} run(s) failed or were refused: ${failed[*]}" >&2
  exit 1
fi
