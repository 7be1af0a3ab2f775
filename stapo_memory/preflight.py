""":func:`check`, the one function of this package the preflight calls (``MEMORY_CHECK`` in
recipe/stapo/preflight/run.py): the estimate per pass against ``recipe.gpu_mem_gb``, a refusal naming
the changes that make every pass fit (each verified by the whole preflight) or what can lower the need."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.stapo.preflight.context import UNUSABLE, model_config_json, model_path
from recipe.stapo.preflight.problem import ACTOR, ROLLOUT, Problem, pick

from . import advice, model
from .shape import ModelShape, NotEstimated, ShapeError, builtin_shape, shape_from_hf_config

#: how many candidate plans of one kind the preflight runs through the whole preflight at most
MAX_TRIES_PER_KIND = 12

Recheck = Callable[[DictConfig], list[Problem]]
#: whether the whole preflight passes a config changed by some overrides
Verify = Callable[[dict], bool]


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
    except NotEstimated as e:
        message = f"{e.field}={e.problem}"
        fix = ("run it with recipe.memory_check=warn (or off) after sizing its memory yourself: the preflight's "
               "estimate would not count its experts")
        if refuse:
            found.append(Problem(f"GPU memory ({e.source})", f"not estimated: {message}", fix))
        else:
            notes.append(f"GPU memory not estimated ({e.source}): {message}")
    except ShapeError as e:
        found.append(Problem(f"{e.source}: {e.field}" if e.field else e.source, e.problem,
                             "the model's config.json must describe the model verl builds from it: correct the "
                             f"field, or point actor_rollout_ref.model.path (or model.hf_config_path) at the right "
                             f"folder ({path})"))
    return None


def _apply(config: DictConfig, overrides: dict) -> DictConfig:
    """A copy of ``config`` with ``overrides`` (key -> value) set."""
    changed = copy.deepcopy(config)
    with open_dict(changed):
        for key, value in overrides.items():
            OmegaConf.update(changed, key, value, force_add=True)
    return changed


def verifier(config: DictConfig, recheck: Recheck, known: list[Problem] = ()) -> Verify:
    """Whether the whole preflight (``recheck``) finds nothing in ``config`` changed by some overrides but
    the ``known`` problems, the config's own outside the memory check (a missing data file must not
    refuse a change that does not touch it)."""
    seen = {str(p) for p in known}
    return lambda overrides: all(str(p) in seen for p in recheck(_apply(config, overrides)))


def verified_plans(estimate: model.Estimate, gpu: float, gpus_per_node: int, verify: Verify) -> dict[str, advice.Plan]:
    """The first plan of each kind (``settings``, ``offload``, ``gpus``) that ``verify`` passes; at most
    :data:`MAX_TRIES_PER_KIND` tries a kind."""
    chosen: dict[str, advice.Plan] = {}
    tries: dict[str, int] = {}
    for plan in advice.plans(estimate.shape, estimate.settings, gpu, gpus_per_node):
        if plan.kind in chosen or tries.get(plan.kind, 0) >= MAX_TRIES_PER_KIND:
            if plan.kind == "gpus":  # the last kind the plans come in
                break
            continue
        tries[plan.kind] = tries.get(plan.kind, 0) + 1
        if verify(plan.overrides):
            chosen[plan.kind] = plan
    return chosen


def _need(est: model.Estimate) -> tuple[float, model.Pass]:
    """The most any pass of ``est`` needs with the estimate's margin, and that pass."""
    peak = max(est.passes, key=lambda p: p.total + model.margin_bytes(p))
    return peak.total + model.margin_bytes(peak), peak


def floor_text(config: DictConfig, estimate: model.Estimate, gpu: float, verify: Verify) -> str:
    """The fix of a refusal no change the preflight makes can lift: what a GPU needs at the least of the
    run (:func:`advice.one_sequence`), then, in order, what can lower it or hold it: shorter responses,
    a larger card, offload; or, where that least fits the card without the margin, that."""
    shape, s = estimate.shape, estimate.settings

    def least(longest: int = s.longest, card: float = gpu, **change) -> model.Estimate:
        return model.estimate(shape, advice.one_sequence(shape, replace(s, **change), card, longest), card)

    at_least = least()
    need, peak = _need(at_least)
    text = (f"no setting the preflight can change makes it fit, nor more GPUs: with one {s.longest}-token sequence "
            f"per micro-batch and vLLM's share at its least ({at_least.settings.gpu_memory_utilization:g}) a GPU "
            f"still needs {model.gib(need)} GiB with the estimate's margin (pass '{peak.name}'), more than the "
            f"{model.gib(gpu)} GiB of the target GPU")
    overrides = advice.budget_overrides(s, at_least.settings)
    if (all(p.total <= gpu for p in at_least.passes) and model.vllm_share_fits(at_least, gpu)
            and verify({**overrides, "recipe.memory_accept_tight": True})):
        return (f"{text}, though not without it: run with {advice.Plan('', overrides, at_least).text()} "
                "recipe.memory_accept_tight=true to run inside the margin, which is there for what the estimate "
                "may miss (the whole preflight then passes)")
    step, prompt = advice.BUDGET_STEP, int(pick(config, "data.max_prompt_length"))
    longest = advice.largest(range(prompt + step, s.longest, step), lambda n: model.all_fit(least(n), gpu))
    if longest:
        levers = [f"shorter responses: data.max_response_length={longest - prompt} fits with every budget at one "
                  f"{longest}-token sequence"]
    else:
        short_need, short_peak = _need(least(prompt + step))
        levers = [f"not shorter responses: at {step}-token ones pass '{short_peak.name}' still needs "
                  f"{model.gib(short_need)} GiB"]
    tenths = advice.largest(range(round(gpu / model.GIB * 10), 2000),
                            lambda g: not model.all_fit(least(card=g / 10 * model.GIB), g / 10 * model.GIB))
    if tenths is not None and tenths + 1 < 2000:
        card = (tenths + 1) / 10
        named = [name for name, capacity in model.GPU_CAPACITY_GIB.items() if capacity >= card]
        levers.append(f"a larger card: {card:.1f} GiB as CUDA reports it fits at one sequence"
                      + (f" (an {named[0]} or larger)" if named else ""))
    offloaded, _ = _need(least(param_offload=True, optimizer_offload=True))
    if offloaded < need - model.GIB / 20:
        levers.append(f"offload ({ACTOR}.fsdp_config.param_offload=true {ACTOR}.fsdp_config.optimizer_offload=true) "
                      f"lowers the need to {model.gib(offloaded)} GiB")
    else:
        levers.append(f"not offload: pass '{peak.name}' holds the actor's whole state with it too")
    return f"{text}. What can, by the estimate and in this order: " + "; ".join(levers)


def fix_text(chosen: dict[str, advice.Plan], floor: Callable[[], str]) -> str:
    """The fix text: the settings that make every pass fit (with more GPUs or offload as alternatives),
    or, when only those do, them first, or, when nothing does, ``floor()``."""
    checked = "every pass then fits by the estimate and the whole preflight passes"
    others = [chosen[k] for k in ("gpus", "offload") if k in chosen]
    if "settings" in chosen:
        text = f"run with {chosen['settings'].text()} ({checked})"
        if others:
            text += "; or with " + " or with ".join(p.text() for p in others)
        return text
    if others:
        return f"only offload or more GPUs make it fit: run with {' or with '.join(p.text() for p in others)} ({checked})"
    return floor()


#: how a budget's room reads (settings field -> whose micro-batches, what one holds at most, the batch the GPUs share)
_ROOM = {"update_tokens": ("the update's", "the whole mini-batch a GPU gets", f"{ACTOR}.ppo_mini_batch_size"),
         "log_prob_tokens": ("the log-prob passes'", "the whole batch a GPU gets", "data.train_batch_size"),
         "ref_tokens": ("the reference's", "the whole batch a GPU gets", "data.train_batch_size")}


def room_text(config: DictConfig, estimate: model.Estimate, gpu: float) -> Optional[str]:
    """What the room of a run that fits could buy by the estimate (:func:`advice.room`); None without room."""
    s = estimate.settings
    n = int(pick(config, f"{ROLLOUT}.n", 1) or 1)
    ceilings = {knob: math.ceil(int(pick(config, prompts)) * n * s.longest / s.world_size)
                for knob, (_, _, prompts) in _ROOM.items()}
    t = advice.room(estimate.shape, s, gpu, ceilings)
    overrides = advice.budget_overrides(s, t)
    if not overrides:
        return None
    bought = []
    if t.gpu_memory_utilization != s.gpu_memory_utilization:
        bought.append(f"vLLM's share {model.gib(t.gpu_memory_utilization * gpu)} GiB instead of "
                      f"{model.gib(s.gpu_memory_utilization * gpu)} (more KV cache: more sequences generated at once)")
    for knob, (whose, whole, _) in _ROOM.items():
        if getattr(s, knob) is not None and getattr(t, knob) != getattr(s, knob):
            bought.append(f"{whose} micro-batches of {getattr(t, knob)} tokens instead of {getattr(s, knob)} "
                          f"({getattr(t, knob) // s.longest} longest sequences instead of {getattr(s, knob) // s.longest}"
                          + (f": {whole}" if getattr(t, knob) == ceilings[knob] else "") + ", so fewer micro-batches)")
    return (f"  room to spare: by the estimate every pass still fits with "
            f"{advice.Plan('', overrides, estimate).text()}: " + "; ".join(bought))


def check(config: DictConfig, found: list[Problem], notes: list[str], recheck: Optional[Recheck] = None) -> Optional[str]:
    """The memory table for the target GPU (returned) and a problem per pass that does not fit
    (``recipe.memory_check``: ``refuse``; ``warn`` makes them notes, ``off`` skips the estimate). Only
    with ``recheck`` (the whole preflight on a changed config; not in the preflight re-run for a
    candidate) does a refusal name its fix or a run its room."""
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
    except (TypeError, ValueError) as e:  # the policy-loss block or a null, refused by the checks before
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
    verify = verifier(config, recheck, found) if recheck else None
    chosen = verified_plans(estimate, gpu, gpus_per_node, verify) if refusing and verify else {}
    fix = fix_text(chosen, lambda: floor_text(config, estimate, gpu, verify)) if refusing and verify else None
    first = None
    for name, setting, problem in failing:
        if (name, setting, problem) not in refusing:
            flag = "recipe.memory_check=warn" if mode == "warn" else "recipe.memory_accept_tight=true"
            notes.append(f"GPU memory ({flag}): pass '{name}' {problem}" + (f"; {fix}" if fix else ""))
            continue
        tight = model.verdict(passes[name], gpu) == "TIGHT"
        key = f"GPU memory, pass '{name}' ({setting})"
        then = f"the changes named for {first} make every pass fit" if chosen else f"{first} says what can"
        shown = fix if first is None else (then if fix else None)
        first = first or key
        found.append(Problem(key, problem, (f"{shown}; " if shown else "") + "or set GPU_MEM_GB to your GPU's memory as CUDA reports it"
                             + (", or recipe.memory_accept_tight=true to run inside the margin" if tight else "")
                             + ", or recipe.memory_check=warn if you know the estimate is wrong for your setup "
                             "(docs/memory.md)"))
    room = room_text(config, estimate, gpu) if recheck and not failing else None
    return model.table(estimate, gpu) + (f"\n{room}" if room else "")
