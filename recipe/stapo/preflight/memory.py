"""GPU memory and context: the model's ``config.json`` read whole (every shape field named when it
cannot be used; Mixture-of-Experts models refused as not estimated), prompt + response within the
context vLLM serves, and the memory model's estimate per pass (:mod:`recipe.stapo.memory.model`), with
its margin, against ``recipe.gpu_mem_gb`` (``GPU_MEM_GB``: GiB as CUDA reports them, default 79.1 for
an 80 GB card). A pass that does not fit is refused with the changes that make every pass fit, each
set of changes run through the whole preflight before it is printed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.stapo.memory import model as memory_model

from .problem import ROLLOUT, Problem, is_int, pick

#: rollouts served by an engine whose context is the model's ``max_position_embeddings`` unless
#: ``rollout.max_model_len`` says otherwise (verl's ``_validate_configs``)
CONTEXT_ROLLOUTS = ("vllm", "sglang")
#: how many candidate plans of one kind the preflight runs through the whole preflight at most
MAX_TRIES_PER_KIND = 12

Recheck = Callable[[DictConfig], list[Problem]]


def model_path(config: DictConfig) -> str:
    return str(pick(config, "actor_rollout_ref.model.hf_config_path", "") or pick(config, "actor_rollout_ref.model.path", ""))


#: the key under which :func:`_config_json` reports a file that is not a JSON object
UNUSABLE = "__unusable__"


def _config_json(path: str) -> tuple[Optional[dict], str]:
    """(the parsed ``<path>/config.json``, its path), (None, why not) when it cannot be read here, or
    ({UNUSABLE: why}, its path) when it is read but is not a JSON object."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except OSError as e:
        return None, f"{file}: {e.strerror or e}"
    except ValueError as e:
        return {UNUSABLE: f"not JSON ({e})"}, str(file)
    if not isinstance(data, dict):
        return {UNUSABLE: "not a JSON object"}, str(file)
    return data, str(file)


def _shape_problem(e: memory_model.ShapeError, path: str) -> Problem:
    return Problem(f"{e.source}: {e.field}" if e.field else e.source, e.problem,
                   "the model's config.json must describe the model verl builds from it: correct the field, or "
                   f"point actor_rollout_ref.model.path (or model.hf_config_path) at the right folder ({path})")


def check_context(config: DictConfig, raw: Optional[dict], source: str, found: list[Problem]) -> None:
    """Prompt + response fit the context vLLM serves: verl sets ``max_model_len`` to the model's
    ``max_position_embeddings`` unless ``rollout.max_model_len`` is set (and refuses one above it after
    Ray starts), then clamps every request's new tokens to ``max_model_len`` minus the prompt, so a
    shorter context silently cuts the responses below ``data.max_response_length``."""
    if str(pick(config, f"{ROLLOUT}.name", "")) not in CONTEXT_ROLLOUTS or raw is None:
        return
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else None
    positions = raw.get("max_position_embeddings", (text or {}).get("max_position_embeddings"))
    if positions is None:
        found.append(Problem(f"{source}: max_position_embeddings", "missing: verl reads it to size vLLM's context "
                             "and raises when it is absent (after Ray starts)",
                             "use the model's own config.json, which has it"))
        return
    if not is_int(positions) or positions < 1:
        found.append(Problem(f"{source}: max_position_embeddings", f"{positions!r} is not a whole number >= 1",
                             "use the model's own config.json"))
        return
    prompt, response = pick(config, "data.max_prompt_length"), pick(config, "data.max_response_length")
    longest = prompt + response
    served = pick(config, f"{ROLLOUT}.max_model_len")
    if served is not None:
        if not is_int(served) or served < 1:
            found.append(Problem(f"{ROLLOUT}.max_model_len", "must be a whole number >= 1 or null",
                                 f"leave it null (the model's max_position_embeddings, {positions})", served))
            return
        if served > positions:
            found.append(Problem(f"{ROLLOUT}.max_model_len", f"above the model's max_position_embeddings={positions} "
                                 f"({source}): verl refuses it when the rollout starts",
                                 f"set it to at most {positions}, or leave it null", served))
            return
    context, named = (served, f"{ROLLOUT}.max_model_len={served}") if served is not None else (
        positions, f"the model's max_position_embeddings={positions} ({source})")
    if longest > context:
        found.append(Problem(
            "data.max_response_length", f"data.max_prompt_length + data.max_response_length = {prompt} + {response} "
            f"= {longest} tokens exceed {named}: vLLM serves at most that context, and verl clamps each request's "
            f"new tokens to it minus the prompt, so responses would stop before {response} tokens",
            f"set data.max_response_length to at most {context - prompt} (or shorten data.max_prompt_length), or "
            "use a model whose context holds prompt + response", response))


def _shape(config: DictConfig, raw: Optional[dict], source: str, found: list[Problem], notes: list[str],
           refuse: bool) -> Optional[memory_model.ModelShape]:
    """The model's shape, from its config.json, or the built-in shape of a paper model the launching
    machine cannot read; None (with a note or a problem) when there is none to estimate."""
    path = model_path(config)
    if raw is None:
        shape = memory_model.builtin_shape(path)
        if shape is None:
            notes.append(f"GPU memory not estimated: no readable config.json ({source}) and no built-in shape for {path}")
        return shape
    if UNUSABLE in raw:
        found.append(Problem(source, raw[UNUSABLE], "use the model's own config.json"))
        return None
    try:
        return memory_model.shape_from_hf_config(raw, source=source)
    except memory_model.ShapeError as e:
        found.append(_shape_problem(e, path))
    except memory_model.NotEstimated as e:
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


def verified_plans(config: DictConfig, estimate: memory_model.Estimate, gpu: float, gpus_per_node: int,
                   recheck: Recheck) -> dict[str, memory_model.Plan]:
    """The first plan of each kind (``settings``, ``offload``, ``gpus``) with which the whole preflight
    passes (``recheck`` runs it on the changed config); at most :data:`MAX_TRIES_PER_KIND` tries a kind."""
    chosen: dict[str, memory_model.Plan] = {}
    tries: dict[str, int] = {}
    for plan in memory_model.plans(estimate.shape, estimate.settings, gpu, gpus_per_node):
        if plan.kind in chosen or tries.get(plan.kind, 0) >= MAX_TRIES_PER_KIND:
            if plan.kind == "gpus":  # the last kind the plans come in
                break
            continue
        tries[plan.kind] = tries.get(plan.kind, 0) + 1
        if not recheck(_apply(config, plan.overrides)):
            chosen[plan.kind] = plan
    return chosen


def advice(chosen: dict[str, memory_model.Plan]) -> str:
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


def check_memory(config: DictConfig, found: list[Problem], notes: list[str],
                 recheck: Optional[Recheck] = None) -> Optional[str]:
    """The context check, then the memory table for the target GPU and a problem per pass that does not
    fit (``recipe.memory_check``: ``refuse``; ``warn`` makes them notes, ``off`` skips the estimate).
    ``recheck`` (the whole preflight on a changed config, returning its problems): with it, each
    refusal names the changes that make every pass fit, verified; without it (the preflight re-run
    for a candidate), none."""
    raw, source = _config_json(model_path(config))
    check_context(config, raw if raw is not None and UNUSABLE not in raw else None, source, found)
    mode = pick(config, "recipe.memory_check", "refuse")
    if mode == "off":
        notes.append("GPU memory not checked (recipe.memory_check=off)")
        return None
    if str(pick(config, "trainer.device", "cuda")) == "cpu" or pick(config, f"{ROLLOUT}.name") not in ("vllm", "sglang"):
        notes.append("GPU memory not estimated: the CPU path (trainer.device=cpu) or a rollout other than vLLM/SGLang")
        return None
    shape = _shape(config, raw, source, found, notes, refuse=mode == "refuse")
    if shape is None:
        return None
    gpu = float(pick(config, "recipe.gpu_mem_gb")) * memory_model.GIB
    try:
        settings = memory_model.settings_from_config(config)
    except ValueError as e:  # the policy-loss block, refused by check_names
        notes.append(f"GPU memory not estimated: {e}")
        return None
    estimate = memory_model.estimate(shape, settings, gpu)
    gpus_per_node = int(pick(config, "trainer.n_gpus_per_node", 8))
    accept_tight = pick(config, "recipe.memory_accept_tight", False)
    if not isinstance(accept_tight, bool):
        found.append(Problem("recipe.memory_accept_tight", "must be true or false",
                             "set recipe.memory_accept_tight=true to run a TIGHT pass, else leave it false", accept_tight))
        accept_tight = False
    passes = {p.name: p for p in estimate.passes}
    failing = memory_model.problems(estimate, gpu)
    refusing = [(n, st, pr) for n, st, pr in failing
                if mode != "warn" and not (accept_tight and memory_model.verdict(passes[n], gpu) == "TIGHT"
                                           and memory_model.vllm_share_fits(estimate, gpu))]
    fix = advice(verified_plans(config, estimate, gpu, gpus_per_node, recheck)) if refusing and recheck else None
    first = None
    for name, setting, problem in failing:
        if (name, setting, problem) not in refusing:
            flag = "recipe.memory_check=warn" if mode == "warn" else "recipe.memory_accept_tight=true"
            notes.append(f"GPU memory ({flag}): pass '{name}' {problem}" + (f"; {fix}" if fix else ""))
            continue
        tight = memory_model.verdict(passes[name], gpu) == "TIGHT"
        key = f"GPU memory, pass '{name}' ({setting})"
        shown = fix if first is None else (f"the changes named for {first} make every pass fit" if fix else None)
        first = first or key
        found.append(Problem(key, problem, (f"{shown}; " if shown else "") + "or set GPU_MEM_GB to your GPU's memory as CUDA reports it"
                             + (", or recipe.memory_accept_tight=true to run inside the margin" if tight else "")
                             + ", or recipe.memory_check=warn if you know the estimate is wrong for your setup "
                             "(docs/memory.md)"))
    return memory_model.table(estimate, gpu)
