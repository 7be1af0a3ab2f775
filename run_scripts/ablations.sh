#!/usr/bin/env bash
# The paper's S2T ablations, one run each, sequentially (docs/method.md, "S2T"):
#   masking strategy: low_entropy (STAPO) | high_entropy | random | full ("JustRL-FullMask")
#   q sweep and tau_p sweep around the defaults (q=0.75, tau_p=0.002).
# Beyond the paper: `compose` runs S2T on top of other verl policy losses (STAPO+GSPO, STAPO+CISPO)
# on Qwen3-8B (MODEL is ignored there).
# usage: bash run_scripts/ablations.sh [strategy|q|tau_p|compose|all] [hydra overrides...]
# Environment: as run_scripts/common.sh, plus MODEL [qwen3_1_7b], Q_VALUES, TAU_P_VALUES.
set -euo pipefail
sweep=${1:-all}; [ $# -gt 0 ] && shift
model=${MODEL:-qwen3_1_7b}
here="$(dirname "$0")"
case "$sweep" in strategy|q|tau_p|compose|all) ;; *) echo "unknown sweep '$sweep' (strategy|q|tau_p|compose|all)" >&2; exit 2 ;; esac

run() {  # run NAME OVERRIDES...
  local name=$1; shift
  EXPERIMENT="${model}_stapo_${name}" bash "$here/common.sh" stapo "$model" "$@" "${extra[@]}"
}
extra=("$@")
if [ "$sweep" = strategy ] || [ "$sweep" = all ]; then
  for s in low_entropy high_entropy random full; do
    run "strategy_$s" "actor_rollout_ref.actor.policy_loss.strategy=$s"
  done
fi
if [ "$sweep" = q ] || [ "$sweep" = all ]; then
  for q in ${Q_VALUES:-0.5 0.9}; do
    run "q_$q" "actor_rollout_ref.actor.policy_loss.q=$q"
  done
fi
if [ "$sweep" = tau_p ] || [ "$sweep" = all ]; then
  for t in ${TAU_P_VALUES:-0.001 0.005 0.01}; do
    run "tau_p_$t" "actor_rollout_ref.actor.policy_loss.tau_p=$t"
  done
fi
if [ "$sweep" = compose ]; then
  for loss in gspo cispo; do
    EXPERIMENT="qwen3_8b_stapo_${loss}" bash "$here/common.sh" stapo qwen3_8b \
      "actor_rollout_ref.actor.policy_loss.loss_mode=$loss" "${extra[@]}"
  done
fi
