""":func:`check`, the one function of this package the preflight calls (``MEMORY_CHECK`` in
recipe/stapo/preflight/run.py): the model's shape from its ``config.json`` (every shape field named when
it cannot be used; Mixture-of-Experts models refused as not estimated) and the estimate per pass, with
its margin, against ``recipe.gpu_mem_gb`` (``GPU_MEM_GB``: GiB as CUDA reports them, default 79.1 for an
80 GB card). A pass that does not fit is refused with the changes that make every pass fit, each set
run through the whole preflight before it is printed."""

from __future__ import annotations

import copy
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.stapo.preflight.context import UNUSABLE, model_config_json, model_path
from recipe.stapo.preflight.problem import ROLLOUT, Problem, pick

from . import advice, model
from .shape import ModelShape, NotEstimated, ShapeError, builtin_shape, shape_from_hf_config

#: how many candidate plans of one kind the preflight runs through the whole preflight at most
MAX_TRIES_PER_KIND = 12

Recheck = Callable[[DictConfig], list[Problem]]


def _shape(config: DictConfig, raw: Optional[dict], source: str, found: list[Problem], notes: list[str],
           refuse: bool) -> Optional[ModelShape]:
    """The model's shape, from its config.json, or the built-in shape of a paper model the launching
    machine cannot read; None (with a note or a problem) when there is none to estimate."""
    path = model_path(config)
    if raw is None:
        shape = builtin_shape(path)
        if shape is None:
            notes.append(f"GPU memory not estimated: no readable config.json ({source}) and no built-in shape for {path}")
        return shape
    if UNUSABLE in raw:
        found.append(Problem(source, raw[UNUSABLE], "use the model's own config.json"))
        return None
    try:
        return shape_from_hf_config(raw, source=source)
    except ShapeError as e:
        found.append(Problem(f"{e.source}: {e.field}" if e.field else e.source, e.problem,
                             "the model's config.json must describe the model verl builds from it: correct the "
                             f"field, or point actor_rollout_ref.model.path (or model.hf_config_path) at the right "
                             f"folder ({path})"))
    except NotEstimated as e:
        message = f"{e.field}={e.problem}"
        fix = ("run it with recipe.memory_check=warn (or off) after sizing its memory yourself: the preflight's "
               "estimate would not count its experts")
        if refuse:
            found.append(Problem(f"GPU memory ({e.source})", f"not estimated: {message}", fix))
        else:
            notes.append(f"GPU memory not estimated ({e.source}): {message}")
    return None


def _apply(config: DictConfig, overrides: dict) -> DictConfig:
    """A copy of ``config`` with ``overrides`` (key -> value) set."""
    changed = copy.deepcopy(config)
    with open_dict(changed):
        for key, value in overrides.items():
            OmegaConf.update(changed, key, value, force_add=True)
    return changed


def verified_plans(config: DictConfig, estimate: model.Estimate, gpu: float, gpus_per_node: int,
                   recheck: Recheck) -> dict[str, advice.Plan]:
    """The first plan of each kind (``settings``, ``offload``, ``gpus``) with which the whole preflight
    passes (``recheck`` runs it on the changed config); at most :data:`MAX_TRIES_PER_KIND` tries a kind."""
    chosen: dict[str, advice.Plan] = {}
    tries: dict[str, int] = {}
    for plan in advice.plans(estimate.shape, estimate.settings, gpu, gpus_per_node):
        if plan.kind in chosen or tries.get(plan.kind, 0) >= MAX_TRIES_PER_KIND:
            if plan.kind == "gpus":  # the last kind the plans come in
                break
            continue
        tries[plan.kind] = tries.get(plan.kind, 0) + 1
        if not recheck(_apply(config, plan.overrides)):
            chosen[plan.kind] = plan
    return chosen


def fix_text(chosen: dict[str, advice.Plan]) -> str:
    """The fix text: the settings that make every pass fit (with more GPUs or offload as alternatives),
    or, when only those do, them first."""
    checked = "every pass then fits by the estimate and the whole preflight passes"
    others = [chosen[k] for k in ("gpus", "offload") if k in chosen]
    if "settings" in chosen:
        text = f"run with {chosen['settings'].text()} ({checked})"
        if others:
            text += "; or with " + " or with ".join(p.text() for p in others)
        return text
    if others:
        return f"only offload or more GPUs make it fit: run with {' or with '.join(p.text() for p in others)} ({checked})"
    return ("no setting the preflight can change makes it fit: a smaller model, shorter sequences (prompt + response) "
            "or GPUs with more memory")


def check(config: DictConfig, found: list[Problem], notes: list[str], recheck: Optional[Recheck] = None) -> Optional[str]:
    """The memory table for the target GPU (returned) and a problem per pass that does not
    fit (``recipe.memory_check``: ``refuse``; ``warn`` makes them notes, ``off`` skips the estimate).
    ``recheck`` (the whole preflight on a changed config, returning its problems): with it, each
    refusal names the changes that make every pass fit, verified; without it (the preflight re-run
    for a candidate), none."""
    mode = pick(config, "recipe.memory_check", "refuse")
    if mode == "off":
        notes.append("GPU memory not checked (recipe.memory_check=off)")
        return None
    if str(pick(config, "trainer.device", "cuda")) == "cpu" or pick(config, f"{ROLLOUT}.name") not in ("vllm", "sglang"):
        notes.append("GPU memory not estimated: the CPU path (trainer.device=cpu) or a rollout other than vLLM/SGLang")
        return None
    raw, source = model_config_json(config)
    shape = _shape(config, raw, source, found, notes, refuse=mode == "refuse")
    if shape is None:
        return None
    gpu = float(pick(config, "recipe.gpu_mem_gb")) * model.GIB
    try:
        settings = model.settings_from_config(config)
    except ValueError as e:  # the policy-loss block, refused by check_names
        notes.append(f"GPU memory not estimated: {e}")
        return None
    estimate = model.estimate(shape, settings, gpu)
    gpus_per_node = int(pick(config, "trainer.n_gpus_per_node", 8))
    accept_tight = pick(config, "recipe.memory_accept_tight", False)
    if not isinstance(accept_tight, bool):
        found.append(Problem("recipe.memory_accept_tight", "must be true or false",
                             "set recipe.memory_accept_tight=true to run a TIGHT pass, else leave it false", accept_tight))
        accept_tight = False
    passes = {p.name: p for p in estimate.passes}
    failing = model.problems(estimate, gpu)
    refusing = [(n, st, pr) for n, st, pr in failing
                if mode != "warn" and not (accept_tight and model.verdict(passes[n], gpu) == "TIGHT"
                                           and model.vllm_share_fits(estimate, gpu))]
    fix = fix_text(verified_plans(config, estimate, gpu, gpus_per_node, recheck)) if refusing and recheck else None
    first = None
    for name, setting, problem in failing:
        if (name, setting, problem) not in refusing:
            flag = "recipe.memory_check=warn" if mode == "warn" else "recipe.memory_accept_tight=true"
            notes.append(f"GPU memory ({flag}): pass '{name}' {problem}" + (f"; {fix}" if fix else ""))
            continue
        tight = model.verdict(passes[name], gpu) == "TIGHT"
        key = f"GPU memory, pass '{name}' ({setting})"
        shown = fix if first is None else (f"the changes named for {first} make every pass fit" if fix else None)
        first = first or key
        found.append(Problem(key, problem, (f"{shown}; " if shown else "") + "or set GPU_MEM_GB to your GPU's memory as CUDA reports it"
                             + (", or recipe.memory_accept_tight=true to run inside the margin" if tight else "")
                             + ", or recipe.memory_check=warn if you know the estimate is wrong for your setup "
                             "(docs/memory.md)"))
    return model.table(estimate, gpu)
