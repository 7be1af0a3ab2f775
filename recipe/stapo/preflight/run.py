"""The preflight as a whole: :func:`check` runs every check and reports all problems; :func:`summary`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from omegaconf import DictConfig

from stapo_core.rules import NO_SELECTION, RULES
from verl_patches.registry import resolve

from .context import check_context
from .loggers import check_loggers
from .names import POLICY_LOSS, check_identity, check_names, token_selection, valid_settings
from .numbers import check_numbers, check_step_host_memory, uses_reference
from .paths import check_paths, check_token_dump
from .problem import ACTOR, REF, ROLLOUT, PreflightError, Problem, Report, pick, world_size
from .values import check_values
from .verl_config import check_model_and_data, check_verl_configs

#: the GPU memory check (docs/memory.md), named as data: the preflight imports nothing of it until it runs
MEMORY_CHECK = "stapo_memory.preflight:check"


def check(config: DictConfig, environ: Optional[Mapping[str, str]] = None, log: Callable[[str], None] = print,
          advise: bool = True) -> Report:
    """Every check on a resolved config: :class:`PreflightError` listing the problems, else the (logged)
    :class:`Report`. ``advise``: a memory refusal's advice, each change rechecked with ``advise=False``."""
    environ = os.environ if environ is None else environ
    submit = environ.get("LAUNCH", "") == "submit"
    found: list[Problem] = []
    report = Report()
    if submit:
        report.notes.append("LAUNCH=submit: paths this machine cannot see are left to the job's driver, which runs "
                            "the same checks on the head node before Ray starts")
    numbers_ok = check_numbers(config, found)
    check_step_host_memory(config, found, submit)
    found += check_values(config, environ)  # types and ranges verl checks after Ray; the run's environment
    found += check_loggers(config, environ)  # the names, loggers, wandb's settings and credentials
    check_names(config, found)
    if numbers_ok:
        check_ranks_per_pool(config, found)
    check_identity(config, found)
    check_paths(config, found, report.notes, submit)
    check_token_dump(config, found)
    numbers_ok &= check_verl_configs(config, found, numbers_ok)  # verl's own validation: types, config classes
    check_model_and_data(config, found)  # verl's model config, and its dataset on the data files' first rows
    if numbers_ok:
        check_context(config, found)
        recheck = (lambda changed: problems_of(changed, environ)) if advise else None
        report.memory_table = resolve(MEMORY_CHECK)(config, found, report.notes, recheck)
    if found:
        raise PreflightError(found)
    log(report.text())
    return report


def data_parallel_size(config: DictConfig) -> int:
    """The actor's data-parallel ranks, in a config whose numbers the preflight passed (:func:`check_numbers`)."""
    return world_size(config) // pick(config, f"{ACTOR}.ulysses_sequence_parallel_size")


def check_ranks_per_pool(config: DictConfig, found: list[Problem]) -> None:
    """``policy_loss.ranks_per_pool`` divides the data-parallel ranks (the workers check it after Ray)."""
    cfg, dp = valid_settings(config), data_parallel_size(config)
    if cfg is None or cfg.ranks_per_pool is None:
        return
    try:
        cfg.pool_ranks(dp)
    except ValueError as e:
        found.append(Problem(f"{POLICY_LOSS}.ranks_per_pool", str(e).split(" is invalid: ", 1)[-1],
                             f"set it to a divisor of {dp} (8 gives 20-Entropy's authors' pool, docs/method.md), "
                             "or null to pool over every rank", cfg.ranks_per_pool))


@dataclass(frozen=True)
class SelectionPool:
    """What one threshold of a token selection is computed over: up to ``tokens`` on ``ranks`` ranks (``what``)."""

    tokens: int
    ranks: int
    data_parallel: int
    what: str

    def text(self) -> str:
        return f"up to {self.tokens:,} tokens per threshold: {self.what}"


def selection_pool(config: DictConfig) -> Optional[SelectionPool]:
    """The pool of the token selection of a config the preflight passed; None without one."""
    cfg, dp = valid_settings(config), data_parallel_size(config)
    if cfg is None or not cfg.selects_tokens:
        return None
    ranks = cfg.pool_ranks(dp)
    response = pick(config, "data.max_response_length")
    where = (f"all {dp} data-parallel ranks" if ranks == dp else "one data-parallel rank" if ranks == 1
             else f"each group of {ranks} of the {dp} data-parallel ranks")
    if cfg.resolved_scope == "mini_batch":
        held = pick(config, f"{ACTOR}.ppo_mini_batch_size") * pick(config, f"{ROLLOUT}.n") * ranks // dp
        return SelectionPool(held * response, ranks, dp, f"the PPO mini-batch's {held} sequences on {where}, "
                             f"up to {response:,} response tokens each")
    if pick(config, f"{ACTOR}.use_dynamic_bsz"):
        sp = pick(config, f"{ACTOR}.ulysses_sequence_parallel_size")
        budget = pick(config, f"{ACTOR}.ppo_max_token_len_per_gpu") * sp
        return SelectionPool(ranks * budget, ranks, dp, f"one micro-batch of {where}, up to {budget:,} tokens "
                             "per rank (the update's token budget, prompts included)")
    micro = pick(config, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    return SelectionPool(ranks * micro * response, ranks, dp, f"one micro-batch of {where}, {micro} "
                         f"sequences per rank, up to {response:,} response tokens each")


def problems_of(config: DictConfig, environ: Mapping[str, str]) -> list[Problem]:
    """Every problem the whole preflight finds in ``config`` (none: it passes), without advice."""
    try:
        check(config, environ, log=lambda _: None, advise=False)
    except PreflightError as e:
        return e.problems
    return []


def summary(config: DictConfig) -> str:
    """What a config the preflight passed runs, in ``key = value`` lines."""
    _get = lambda key: pick(config, key)  # noqa: E731
    selection = token_selection(config)
    lines = [("recipe.method", _get("recipe.method")), ("recipe.model", _get("recipe.model")),
             (f"{POLICY_LOSS}.loss_mode", _get(f"{POLICY_LOSS}.loss_mode") or "vanilla"),
             (f"{POLICY_LOSS}.token_selection", selection)]
    if selection in RULES:
        lines += [(f"{POLICY_LOSS}.{k}", _get(f"{POLICY_LOSS}.{k}")) for k in RULES[selection].fields]
    if selection != NO_SELECTION:
        lines += [(f"{POLICY_LOSS}.stats_from", _get(f"{POLICY_LOSS}.stats_from")),
                  (f"{POLICY_LOSS}.scope", _get(f"{POLICY_LOSS}.scope") or "mini_batch"),
                  (f"{POLICY_LOSS}.ranks_per_pool",
                   _get(f"{POLICY_LOSS}.ranks_per_pool") or "null (every data-parallel rank)"),
                  ("token selection pool", selection_pool(config).text())]
    lines += [("reward.custom_reward_function", f"{_get('reward.custom_reward_function.path')}:"
               f"{_get('reward.custom_reward_function.name')}"),
              ("algorithm.adv_estimator", _get("algorithm.adv_estimator"))]
    lines += [(k, _get(k)) for k in ("actor_rollout_ref.model.path", "data.train_files", "data.val_files",
                                     "trainer.default_local_dir", "trainer.nnodes", "trainer.n_gpus_per_node")]
    n, batch, mini = _get(f"{ROLLOUT}.n"), _get("data.train_batch_size"), _get(f"{ACTOR}.ppo_mini_batch_size")
    lines += [("GPUs", world_size(config)), (f"{ROLLOUT}.n", n),
              ("data.train_batch_size", f"{batch} prompts = {batch * n} sequences per step"),
              (f"{ACTOR}.ppo_mini_batch_size", f"{mini} prompts = {mini * n} sequences per update, "
               f"{batch // mini} updates per step, {mini * n // data_parallel_size(config)} sequences per "
               "data-parallel rank")]
    prompt, response = _get("data.max_prompt_length"), _get("data.max_response_length")
    lines.append(("data.max_prompt_length + data.max_response_length", f"{prompt} + {response}"))
    if _get(f"{ACTOR}.use_dynamic_bsz"):
        budgets = [f"update {_get(f'{ACTOR}.ppo_max_token_len_per_gpu')}",
                   f"log-prob {_get(f'{ROLLOUT}.log_prob_max_token_len_per_gpu')}"]
        if uses_reference(config):
            budgets.append(f"reference {_get(f'{REF}.log_prob_max_token_len_per_gpu')}")
        lines.append(("token budgets per GPU", ", ".join(budgets)
                      + f" (sequence parallel {_get(f'{ACTOR}.ulysses_sequence_parallel_size')})"))
    else:
        lines.append((f"{ACTOR}.ppo_micro_batch_size_per_gpu", _get(f"{ACTOR}.ppo_micro_batch_size_per_gpu")))
    lines += [(k, _get(k)) for k in ("actor_rollout_ref.rollout.gpu_memory_utilization", "recipe.gpu_mem_gb",
                                     "trainer.logger", "trainer.project_name", "trainer.experiment_name",
                                     "trainer.max_actor_ckpt_to_keep")]
    return "\n".join(f"  {key} = {value}" for key, value in lines)
