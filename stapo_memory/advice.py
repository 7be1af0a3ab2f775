"""The memory model's advice, each change re-estimated: for a run that does not fit, the changes after
which every pass does (:func:`plans`) and the least a GPU can hold of the run (:func:`one_sequence`); for
one that fits, what its room could buy (:func:`room`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from recipe.stapo.preflight.problem import ACTOR, REF, ROLLOUT

from .model import Estimate, Settings, all_fit, estimate, fits, vllm_floor_bytes, vllm_share_fits
from .shape import ModelShape

#: the lowest ``gpu_memory_utilization`` the advice proposes, in steps of 0.05
UTILISATION_STEP = 0.05
#: the highest ``gpu_memory_utilization`` the advice proposes
MAX_UTILISATION = 0.95
#: a token budget the advice proposes is a multiple of this (or the floor itself)
BUDGET_STEP = 1024
_NO_SYNC_KEY = f"{ACTOR}.fsdp_config.use_no_sync_for_gradient_accumulation"


@dataclass
class Plan:
    """Changes after which every pass fits by the estimate: ``overrides`` (config key -> value, as
    Hydra overrides), ``kind`` (``settings``: budgets, utilisation, sequence parallelism; ``offload``;
    ``gpus``) and the estimate with them."""

    kind: str
    overrides: dict[str, object]
    estimate: Estimate

    def text(self) -> str:
        return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides.items())


def _budget_knobs(s: Settings) -> list[tuple[str, tuple[str, ...], str]]:
    """(settings field, passes it sizes, config key) of every token budget the run has."""
    budget = lambda dynamic_key, micro_key: dynamic_key if s.dynamic_bsz else micro_key  # noqa: E731
    knobs = [("update_tokens", ("update", "update_end"),
              budget(f"{ACTOR}.ppo_max_token_len_per_gpu", f"{ACTOR}.ppo_micro_batch_size_per_gpu")),
             ("log_prob_tokens", ("log_prob", "current", "update_effect"),
              budget(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"))]
    if s.ref_tokens is not None:
        knobs.append(("ref_tokens", ("reference",),
                      budget(f"{REF}.log_prob_max_token_len_per_gpu", f"{REF}.log_prob_micro_batch_size_per_gpu")))
    return knobs


def _with_budget(s: Settings, knob: str, tokens: int) -> Settings:
    if knob == "log_prob_tokens":
        return replace(s, log_prob_tokens=tokens,
                       current_tokens=tokens if s.current_tokens is not None else None,
                       update_effect_tokens=min(tokens, s.update_effect_tokens)
                       if s.update_effect_tokens is not None else None)
    return replace(s, **{knob: tokens})


def _fit(shape: ModelShape, s: Settings, gpu_bytes: float, names: tuple[str, ...]) -> bool:
    est = estimate(shape, s, gpu_bytes)
    return all(fits(p, gpu_bytes) for p in est.passes if p.name in names)


def _largest_budget(shape: ModelShape, s: Settings, gpu_bytes: float, knob: str, names: tuple[str, ...],
                    floor: int, ceiling: Optional[int] = None) -> Optional[int]:
    """The largest budget from ``floor`` to ``ceiling`` (default: the current one) at which ``names``
    fit, None when ``floor`` does not: ``floor``, ``ceiling`` or a multiple of :data:`BUDGET_STEP` between
    (without dynamic batching: a multiple of the longest sequence), searched by :func:`largest`."""
    ceiling = getattr(s, knob) if ceiling is None else ceiling

    def ok(tokens: int) -> bool:
        return _fit(shape, _with_budget(s, knob, tokens), gpu_bytes, names)

    if not s.dynamic_bsz:
        step = max(1, s.longest)
        return largest(range(math.ceil(floor / step) * step or step, ceiling + 1, step), ok)
    if floor > ceiling or not ok(floor):
        return None
    if ok(ceiling):
        return ceiling
    between = range(math.floor(floor / BUDGET_STEP + 1) * BUDGET_STEP, ceiling, BUDGET_STEP)
    return largest(between, ok) or floor


def largest(candidates: Sequence[int], ok: Callable[[int], bool]) -> Optional[int]:
    """The largest of ascending ``candidates`` (a list or a range, never listed) for which ``ok``, holding
    up to some point and not beyond, holds (a binary search); None when it fails on the first."""
    if not candidates or not ok(candidates[0]):
        return None
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(candidates[mid]):
            lo = mid
        else:
            hi = mid - 1
    return candidates[lo]


def budget_overrides(s: Settings, t: Settings) -> dict[str, object]:
    """The config overrides that change ``s``'s vLLM share and token budgets into ``t``'s."""
    out: dict[str, object] = {}
    if t.gpu_memory_utilization != s.gpu_memory_utilization:
        out[f"{ROLLOUT}.gpu_memory_utilization"] = t.gpu_memory_utilization
    for knob, _, key in _budget_knobs(s):
        if getattr(t, knob) != getattr(s, knob):
            out[key] = getattr(t, knob) if s.dynamic_bsz else getattr(t, knob) // max(1, s.longest)
    return out


def _utilisation(shape: ModelShape, s: Settings, gpu_bytes: float) -> Optional[float]:
    """The largest ``gpu_memory_utilization`` (a multiple of :data:`UTILISATION_STEP`) with which the
    rollout fits and vLLM's share holds its weights and one longest sequence; None when none does."""
    for k in range(round(MAX_UTILISATION / UTILISATION_STEP), 0, -1):
        u = round(k * UTILISATION_STEP, 2)
        est = estimate(shape, replace(s, gpu_memory_utilization=u), gpu_bytes)
        if fits(est.passes[0], gpu_bytes) and vllm_share_fits(est, gpu_bytes):  # the rollout: the first pass
            return u
    return None


def _sequence_parallel_sizes(shape: ModelShape, s: Settings) -> list[int]:
    """Sizes above the current one that verl accepts: dividing the GPUs and the attention heads, the
    key-value heads dividing it or it dividing them."""
    return [sp for sp in (2, 4, 8) if sp > s.sp and s.world_size % sp == 0 and shape.num_heads % sp == 0
            and (shape.num_kv_heads % sp == 0 or sp % shape.num_kv_heads == 0)]


def settings_plan(shape: ModelShape, s: Settings, gpu_bytes: float) -> Optional[tuple[Settings, dict[str, object]]]:
    """Settings and overrides that make every pass fit with the GPUs and offload of ``s``, changing only
    what does not fit: deferred gradient sync off, the largest ``gpu_memory_utilization`` that fits, the
    largest budget of each pass that does not fit (at least one longest sequence over the sequence
    parallel size), a larger sequence parallel size only where the recipe allows one; None when none fits."""
    est = estimate(shape, s, gpu_bytes)
    failing = {p.name for p in est.passes if not fits(p, gpu_bytes)}
    overrides: dict[str, object] = {}
    if s.no_sync_gradients and failing & {"update", "update_end"}:
        s = replace(s, no_sync_gradients=False)
        overrides[_NO_SYNC_KEY] = False
    if "rollout" in failing or not vllm_share_fits(est, gpu_bytes):
        u = _utilisation(shape, s, gpu_bytes)
        if u is None:
            return None
        s = replace(s, gpu_memory_utilization=u)
        overrides[f"{ROLLOUT}.gpu_memory_utilization"] = u
    if failing & {"update_end", "optimizer_step"} and not _fit(shape, s, gpu_bytes, ("update_end", "optimizer_step")):
        return None
    for sp in [s.sp] + (_sequence_parallel_sizes(shape, s) if s.sequence_parallel_allowed and s.longest else []):
        trial, ok = replace(s, sp=sp), True
        floor = math.ceil(s.longest / sp) if s.longest else 1
        for knob, names, _ in _budget_knobs(trial):
            if _fit(shape, trial, gpu_bytes, names):
                continue
            budget = _largest_budget(shape, trial, gpu_bytes, knob, names, floor)
            if budget is None:
                ok = False
                break
            trial = _with_budget(trial, knob, budget)
        if ok and all_fit(estimate(shape, trial, gpu_bytes), gpu_bytes):
            if sp != s.sp:
                overrides[f"{ACTOR}.ulysses_sequence_parallel_size"] = sp
                if s.ref_tokens is not None:
                    overrides[f"{REF}.ulysses_sequence_parallel_size"] = sp
            overrides.update(budget_overrides(s, trial))
            return trial, overrides
    return None


def _plan(kind: str, shape: ModelShape, s: Settings, gpu_bytes: float, overrides: dict) -> Optional[Plan]:
    """``overrides`` alone when every pass fits with them, else with the settings changes
    (:func:`settings_plan`) still needed; None when neither fits."""
    est = estimate(shape, s, gpu_bytes)
    if all_fit(est, gpu_bytes):
        return Plan(kind, dict(overrides), est)
    found = settings_plan(shape, s, gpu_bytes)
    if found is None:
        return None
    return Plan(kind, {**overrides, **found[1]}, estimate(shape, found[0], gpu_bytes))


def plans(shape: ModelShape, s: Settings, gpu_bytes: float, gpus_per_node: int = 8, max_gpus: int = 512):
    """Candidate :class:`Plan` s for a run that does not fit, in the order the preflight verifies them:
    the settings alone (:func:`settings_plan`), then optimizer offload, parameter and optimizer offload,
    and more GPUs (whole nodes of ``gpus_per_node``, or up to a node of 8 when the run uses fewer)."""
    found = settings_plan(shape, s, gpu_bytes)
    if found:
        yield Plan("settings", found[1], estimate(shape, found[0], gpu_bytes))
    for change in ({"optimizer_offload": True}, {"param_offload": True, "optimizer_offload": True}):
        if all(getattr(s, k) for k in change):
            continue
        plan = _plan("offload", shape, replace(s, **change), gpu_bytes,
                     {f"{ACTOR}.fsdp_config.{k}": v for k, v in change.items() if not getattr(s, k)})
        if plan:
            yield plan
    nodes = s.world_size // gpus_per_node if gpus_per_node and s.world_size % gpus_per_node == 0 else None
    worlds = []
    if gpus_per_node < 8 and nodes == 1:
        worlds += [(1, g) for g in (2, 4, 8) if g > gpus_per_node]
    if nodes:
        worlds += [(n, gpus_per_node) for n in range(nodes + 1, max_gpus // gpus_per_node + 1)]
    for n, g in worlds:  # the fewest GPUs, as the run is or with the settings changes it still needs
        plan = _plan("gpus", shape, replace(s, world_size=n * g), gpu_bytes,
                     {"trainer.nnodes": n} if g == gpus_per_node else {"trainer.n_gpus_per_node": g})
        if plan:
            yield plan


def one_sequence(shape: ModelShape, s: Settings, gpu_bytes: float, longest: Optional[int] = None) -> Settings:
    """The least of the run a GPU can hold: every budget at one sequence of ``longest`` tokens (the run's
    own by default) over the sequence parallel size, and vLLM's share the least step of
    :data:`UTILISATION_STEP` that holds its weights and that sequence."""
    t = replace(s, longest=longest or s.longest)
    for knob, _, _ in _budget_knobs(t):
        t = _with_budget(t, knob, math.ceil(t.longest / t.sp) if t.dynamic_bsz else t.longest)
    steps = math.ceil(round(vllm_floor_bytes(shape, t) / gpu_bytes / UTILISATION_STEP, 6))
    return replace(t, gpu_memory_utilization=min(MAX_UTILISATION, round(steps * UTILISATION_STEP, 2)))


def room(shape: ModelShape, s: Settings, gpu_bytes: float, ceilings: dict[str, int]) -> Settings:
    """For a run that fits: ``s`` with the largest ``gpu_memory_utilization`` and token budgets with which
    every pass still fits, none below its own, each at most its ``ceilings`` entry (by settings field: the
    tokens a GPU gets at once). Each sizes passes of its own, so they hold together."""
    t = replace(s, gpu_memory_utilization=max(s.gpu_memory_utilization, _utilisation(shape, s, gpu_bytes) or 0))
    for knob, names, _ in _budget_knobs(s):
        current = getattr(s, knob)
        t = _with_budget(t, knob, _largest_budget(shape, s, gpu_bytes, knob, names, current,
                                                  max(current, ceilings.get(knob, 0))) or current)
    return t
