"""GPU memory of one training step, pass by pass: an estimate from the model's shape and the run's
settings (plain arithmetic, no GPU, no verl import), every term following the code docs/memory.md names.
Token terms are per GPU (with sequence parallelism of size ``sp`` a micro-batch holds ``budget x sp``
tokens split over ``sp`` GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import OmegaConf

from recipe.stapo.policy_loss import settings_of
from recipe.stapo.preflight.problem import ACTOR, REF, ROLLOUT

from .shape import ModelShape
from .terms import (BF16, ENTROPY_CHUNK_ROWS, FP32, GIB, NORM_BACKWARD_TEMPORARIES, OVERHEAD_BYTES,
                    SUM_PI_SQUARED_CHUNK_ROWS, entropy_extra_bytes, entropy_with_grad_bytes,
                    layer_backward_bytes_per_token, layer_forward_bytes_per_token, layer_inputs_bytes_per_token,
                    no_grad_layer_bytes_per_token, norm_saved_bytes, sum_pi_squared_extra_bytes)

#: the estimate's stated uncertainty, the margin a pass must leave below the GPU's capacity: the rest
#: of the overhead's range, plus a share of everything the estimate computes beside vLLM's share (which
#: vLLM enforces itself) and the overhead
MARGIN_FIXED_BYTES = 1.5 * GIB
MARGIN_FRACTION = 0.10
#: vLLM's share must hold, beside its weights and the KV cache of one longest sequence, the activations
#: of its profiling run (``max_num_batched_tokens`` tokens) and its CUDA graphs: 1 GiB counted
VLLM_RUNTIME_BYTES = 1.0 * GIB

#: what CUDA reports as a card's total memory (GiB, ``torch.cuda.get_device_properties(0).total_memory``),
#: the meaning of ``GPU_MEM_GB``; vLLM's ``gpu_memory_utilization`` is a share of the same number
GPU_CAPACITY_GIB = {
    "A100 40GB": 39.4,
    "L40S / L40 / A40 48GB": 44.4,
    "A100 / A800 / H100 / H800 80GB": 79.1,
    "H20 96GB": 95.0,
    "H200 141GB": 139.8,
}
#: ``GPU_MEM_GB``'s default: an 80 GB card as CUDA reports it
DEFAULT_GPU_MEM_GIB = 79.1


@dataclass(frozen=True)
class Settings:
    """The settings the estimate reads (per GPU unless named otherwise). Token budgets are the tokens
    one micro-batch holds per GPU (fixed micro-batches: micro-batch size x longest sequence); a chunk of
    None is verl's unchunked computation; ``longest`` (prompt + response) 0 means not known, and then
    the budgets' floor and vLLM's share are not checked."""

    world_size: int
    gpu_memory_utilization: float
    log_prob_tokens: int
    update_tokens: int
    ref_tokens: Optional[int] = None            # None: no reference pass
    current_tokens: Optional[int] = None        # None: no current-policy forward
    calculate_sum_pi_squared: bool = True
    sum_pi_squared_chunk: Optional[int] = SUM_PI_SQUARED_CHUNK_ROWS
    entropy_chunk: Optional[int] = ENTROPY_CHUNK_ROWS
    update_entropy: bool = False                # entropy in the update's forward (logits' gradient not in place)
    update_entropy_grad: bool = False           # ... with autograd (an entropy bonus)
    compute_bytes: int = BF16                   # FSDP param_dtype: activations, logits
    param_offload: bool = False
    optimizer_offload: bool = False
    unit_temperature: bool = True               # temperature 1: verl scales no logits copy
    overhead_bytes: float = OVERHEAD_BYTES
    reference_root_resident: bool = False       # FSDP1 reference whose root unit stays unsharded (fsdp_size <= 1)
    actor_root_resident: bool = True            # FSDP1 actor whose root unit stays unsharded after a no-grad pass
    no_sync_gradients: bool = False             # use_no_sync_for_gradient_accumulation: unsharded gradients kept
    update_effect_tokens: Optional[int] = None  # None: no update-effect forward
    longest: int = 0
    sp: int = 1
    sequence_parallel_allowed: bool = True
    rollout_tp: int = 1
    dynamic_bsz: bool = True


@dataclass
class Pass:
    """One pass: its components (name -> bytes) at its peak phase, the setting that lowers it most,
    the part of its total that grows with ``tokens`` (bytes per token), the phase at the peak and every
    phase's total (name -> bytes)."""

    name: str
    components: dict[str, float]
    setting: str
    tokens: Optional[int] = None
    bytes_per_token: float = 0.0
    phase: str = ""
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.components.values()))


@dataclass
class Estimate:
    shape: ModelShape
    settings: Settings
    passes: list[Pass] = field(default_factory=list)

    @property
    def peak(self) -> Pass:
        return max(self.passes, key=lambda p: p.total)


def _resident(shape: ModelShape, s: Settings, *, rollout: bool = False, update: bool = False) -> dict[str, float]:
    """What stays on the GPU between passes: the actor's sharded state (FSDP over the world size,
    float32 master parameters, AdamW) and, with a reference model under FSDP1, its unsharded root unit."""
    p = shape.params / s.world_size
    out = {}
    if not (rollout and s.param_offload):
        out["parameters (fp32, sharded)"] = FP32 * p
    if update or not s.optimizer_offload:
        out["optimizer (AdamW, fp32, sharded)"] = 2 * FP32 * p
    if update:
        out["gradients (fp32, sharded)"] = FP32 * p
    if s.ref_tokens is not None and s.reference_root_resident:
        out["reference root unit (unsharded)"] = reference_root_bytes(shape, s)
    return out


def reference_root_bytes(shape: ModelShape, s: Settings) -> float:
    """The reference model's root unit (embeddings, LM head, final norm) in the compute dtype, which
    FSDP1 keeps on the GPU from the reference pass on when ``fsdp_size <= 1`` (docs/memory.md)."""
    return float(s.compute_bytes * shape.embedding_params)


def _gathered(shape: ModelShape, s: Settings) -> float:
    """Unsharded compute-dtype parameters during a forward or backward: FSDP's root unit for the whole
    pass, plus two decoder layers (the one running and the one prefetched)."""
    return s.compute_bytes * (shape.embedding_params + 2 * shape.layer_params)


def _reduce_scatter_bytes(unit_params: int, s: Settings) -> float:
    """An FSDP1 unit's gradient reduction: ``max(2b, b + 4)`` bytes per parameter, then the float32
    shard (docs/memory.md)."""
    b = s.compute_bytes
    return max(2 * b, b + FP32) * unit_params + FP32 * unit_params / s.world_size


Terms = list[tuple[str, float, float]]


def _phase(terms: Terms, tokens: int) -> tuple[dict[str, float], float]:
    """Components (name -> bytes at ``tokens``) and bytes per token of a list of
    ``(name, fixed bytes, bytes per token)``."""
    components: dict[str, float] = {}
    for name, fixed, per_token in terms:
        components[name] = components.get(name, 0.0) + float(fixed) + float(per_token) * tokens
    return components, float(sum(per_token for _, _, per_token in terms))


def _chunk_term(name: str, total: float, tokens: int, chunk: Optional[int]) -> tuple[str, float, float]:
    """A temporary bounded by its chunk (fixed bytes), or growing with the tokens when unchunked."""
    return (name, total, 0.0) if chunk is not None else (name, 0.0, total / max(1, tokens))


def forward_activation_phases(shape: ModelShape, s: Settings, tokens: int, *, entropy: bool,
                              sum_pi_squared: bool) -> dict[str, Terms]:
    """A no-grad micro-batch of ``tokens`` (verl's ``infer_batch``): what the model code allocates at
    each of its moments (docs/memory.md), as ``(name, fixed bytes, bytes per token)``."""
    b, v, h = s.compute_bytes, shape.vocab_size, shape.hidden_size
    logits = ("logits", 0.0, v * b)
    temporaries = {"entropy chunk": (entropy_extra_bytes(tokens, v, s.entropy_chunk), s.entropy_chunk)
                   if entropy else (0.0, None),
                   "sum_pi^2 chunk": (sum_pi_squared_extra_bytes(tokens, v, b, s.sum_pi_squared_chunk),
                                      s.sum_pi_squared_chunk) if sum_pi_squared else (0.0, None)}
    which = max(temporaries, key=lambda k: temporaries[k][0])
    side = [logits, ("log-probs, entropy, outputs", 0.0, 5 * FP32)]
    if not s.unit_temperature:
        side.append(("temperature-scaled logits", 0.0, v * b))
    if temporaries[which][0]:
        side.append(_chunk_term(which, temporaries[which][0], tokens, temporaries[which][1]))
    return {"layers": [("layer working set (no grad)", 0.0, no_grad_layer_bytes_per_token(shape, b))],
            "LM head": [("final hidden states", 0.0, h * b), logits],
            "logits": side}


def update_activation_phases(shape: ModelShape, s: Settings) -> dict[str, Terms]:
    """An update micro-batch of ``s.update_tokens`` (verl's ``forward_step``, then ``loss.backward()``):
    what the model code and autograd hold at each of its moments (docs/memory.md writes out each), as
    ``(name, fixed bytes, bytes per token)``."""
    b, v, h, t = s.compute_bytes, shape.vocab_size, shape.hidden_size, s.update_tokens
    inputs = ("checkpointed layer inputs", 0.0, layer_inputs_bytes_per_token(shape, b))
    final_norm = ("final norm (saved, output)", 0.0, norm_saved_bytes(h, b) + h * b)
    head_grad = ("LM head weight gradient (unsharded)", float(v * h * b), 0.0)
    logits = ("logits", 0.0, v * b)
    layer_forward = [inputs, ("last layer's forward (checkpointed)", 0.0, layer_forward_bytes_per_token(shape, b))]
    forward_end = [inputs, final_norm, logits, ("log-probs, outputs", 0.0, 3 * FP32)]
    if not s.unit_temperature:
        forward_end.append(("temperature-scaled logits", 0.0, v * b))
    logits_backward = [inputs, final_norm, logits if s.update_entropy or not s.unit_temperature
                       else ("logits (+ gradient in place)", 0.0, v * b)]
    if s.update_entropy or not s.unit_temperature:
        logits_backward.append(("logits gradient (not in place)" if s.update_entropy
                                else "gradient of the temperature's division", 0.0, v * b))
    if s.update_entropy:
        if s.update_entropy_grad:
            forward_end.append(_chunk_term("entropy (with grad)", entropy_with_grad_bytes(t, v, s.entropy_chunk),
                                           t, None))
            logits_backward.append(_chunk_term("entropy (with grad)", entropy_with_grad_bytes(
                t, v, s.entropy_chunk, backward=True), t, None))
        else:
            forward_end.append(_chunk_term("entropy chunk (no grad)", entropy_extra_bytes(t, v, s.entropy_chunk),
                                           t, s.entropy_chunk))
    head = [inputs, final_norm, ("logits gradient", 0.0, v * b), ("gradient of the LM head input", 0.0, h * b),
            head_grad]
    norm_backward = [inputs, ("final norm's backward (float32)", 0.0, (1 + NORM_BACKWARD_TEMPORARIES) * FP32 * h),
                     head_grad]
    layer = [inputs, ("layer recompute + backward", 0.0, layer_backward_bytes_per_token(shape, b)), head_grad]
    embedding = [("gradient flowing into the embedding", 0.0, h * b), head_grad]
    if not shape.tie_word_embeddings:
        embedding.append(("embedding weight gradient (unsharded)", float(v * h * b), 0.0))
    return {"layer forward": layer_forward, "forward end": forward_end, "logits backward": logits_backward,
            "LM head backward": head, "final norm backward": norm_backward, "layer backward": layer,
            "embedding backward": embedding}


def _pass_from_phases(name: str, phases: dict[str, Terms], tokens: int, fixed: dict[str, float],
                      setting: str) -> Pass:
    """The pass at its largest phase: the ``fixed`` components (resident state, gathered parameters,
    overhead) plus the phase's."""
    counted = {phase: _phase(terms, tokens) for phase, terms in phases.items()}
    totals = {phase: sum(fixed.values()) + sum(components.values()) for phase, (components, _) in counted.items()}
    peak = max(totals, key=totals.get)
    components, per_token = counted[peak]
    return Pass(name, {**fixed, **components}, setting, tokens, per_token, peak, totals)


def vllm_floor_bytes(shape: ModelShape, s: Settings) -> float:
    """What vLLM's share must hold on each GPU (else vLLM refuses to start): its bfloat16 weights and one
    longest sequence's KV cache over the tensor parallel size, and :data:`VLLM_RUNTIME_BYTES`."""
    tp = max(1, s.rollout_tp)
    weights = BF16 * shape.params / tp
    kv_heads = max(1, math.ceil(shape.num_kv_heads / tp))
    kv_cache = 2 * shape.num_layers * kv_heads * shape.head_dim * BF16 * s.longest
    return weights + kv_cache + VLLM_RUNTIME_BYTES


def estimate(shape: ModelShape, s: Settings, gpu_bytes: float) -> Estimate:
    """Every pass of one step; ``gpu_bytes`` (what CUDA reports) sizes vLLM's share."""
    b, h, overhead = s.compute_bytes, shape.hidden_size, {"overhead": float(s.overhead_bytes)}
    rollout = {**_resident(shape, s, rollout=True),
               "vLLM (gpu_memory_utilization)": s.gpu_memory_utilization * gpu_bytes, **overhead}
    passes = [Pass("rollout", rollout, f"{ROLLOUT}.gpu_memory_utilization", phase="generation")]

    def forward(name: str, tokens: Optional[int], entropy: bool = False, sum_pi_squared: bool = False,
                setting: str = f"{ROLLOUT}.log_prob_max_token_len_per_gpu") -> None:
        if tokens is None:
            return
        fixed = _resident(shape, s)
        if name == "reference":  # its own root is the gathered one of this pass; the actor's may stay beside it
            fixed.pop("reference root unit (unsharded)", None)
            if s.actor_root_resident:
                fixed["actor root unit (unsharded since the log-prob pass)"] = float(b * shape.embedding_params)
        fixed.update({"gathered parameters": _gathered(shape, s), **overhead})
        phases = forward_activation_phases(shape, s, tokens, entropy=entropy, sum_pi_squared=sum_pi_squared)
        passes.append(_pass_from_phases(name, phases, tokens, fixed, setting))

    forward("log_prob", s.log_prob_tokens, entropy=True, sum_pi_squared=s.calculate_sum_pi_squared)
    forward("reference", s.ref_tokens, setting=f"{REF}.log_prob_max_token_len_per_gpu")
    forward("current", s.current_tokens, entropy=True)  # S2T's current-policy statistics, at the log-prob settings
    forward("update_effect", s.update_effect_tokens)  # the update effect's forward of the measured responses
    # the update: one micro-batch, at the largest of its moments, FSDP's gradient buffers beside the model code's
    state = _resident(shape, s, update=True)
    if s.no_sync_gradients:
        state["unsharded gradients (no_sync)"] = float(b * shape.params)
    phases = update_activation_phases(shape, s)
    phases["layer backward"].append(("this layer's gradient (unsharded)", float(b * shape.layer_params), 0.0))
    phases["layer gradient reduce-scatter"] = [
        ("checkpointed layer inputs", 0.0, layer_inputs_bytes_per_token(shape, b)),
        ("gradient flowing down", 0.0, h * b),
        ("LM head weight gradient (unsharded)", float(shape.vocab_size * h * b), 0.0),
        ("layer gradient: unsharded, float32 copy, shard", _reduce_scatter_bytes(shape.layer_params, s), 0.0)]
    passes.append(_pass_from_phases("update", phases, s.update_tokens,
                                    {**state, "gathered parameters": _gathered(shape, s), **overhead},
                                    f"{ACTOR}.ppo_max_token_len_per_gpu"))
    # ... its end: the root unit's reduction (the embedding's gradient beside the LM head's); more GPUs shard
    # the state further
    end = {**state, "gathered parameters": float(b * shape.embedding_params),
           "root unit gradient: unsharded, float32 copy, shard": _reduce_scatter_bytes(shape.embedding_params, s),
           "gradient flowing into the embedding": float(h * b * s.update_tokens), **overhead}
    passes.append(Pass("update_end", end, "trainer.nnodes", phase="root unit reduce-scatter"))
    # ... and the optimizer step: AdamW's foreach update allocates one float32 temporary per parameter (more
    # GPUs shard the state further; optimizer_offload does not lower it)
    step = {**_resident(shape, s, update=True),
            "AdamW foreach temporary (fp32, sharded)": FP32 * shape.params / s.world_size, **overhead}
    passes.append(Pass("optimizer_step", step, "trainer.nnodes", phase="AdamW step"))
    return Estimate(shape, s, passes)


def settings_from_config(config) -> Settings:
    """:class:`Settings` of a composed recipe config (an OmegaConf config whose numbers the preflight
    has checked); the token selection's decisions come from its policy-loss dataclass."""
    pick = lambda key, default=None: OmegaConf.select(config, key, default=default)  # noqa: E731
    world = int(pick("trainer.nnodes")) * int(pick("trainer.n_gpus_per_node"))
    longest = int(pick("data.max_prompt_length")) + int(pick("data.max_response_length"))
    dynamic = bool(pick(f"{ACTOR}.use_dynamic_bsz", False))

    def tokens(dynamic_key: str, budget_key: str, micro_key: str) -> int:
        if pick(dynamic_key, False):
            return int(pick(budget_key))
        return int(pick(micro_key) or 1) * longest

    log_prob = tokens(f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
                      f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu")
    # verl builds the reference model for a KL loss or a KL penalty in the reward
    uses_ref = any(bool(pick(k, False)) for k in (f"{ACTOR}.use_kl_loss", "algorithm.use_kl_in_reward"))
    ref_tokens = tokens(f"{REF}.log_prob_use_dynamic_bsz", f"{REF}.log_prob_max_token_len_per_gpu",
                        f"{REF}.log_prob_micro_batch_size_per_gpu") if uses_ref else None
    loss = settings_of(config)
    current = loss is not None and (loss.forwards_current_policy or loss.monitor_forwards_current_policy)
    update_effect = None
    if loss is not None and loss.measures_update_effect:
        update_effect = min(log_prob, int(loss.update_effect_responses) * longest)
    # the cases the preflight refuses with sequence parallelism (recipe.stapo.preflight.names)
    sp_allowed = loss is None or not ((loss.selects_tokens and loss.statistics_source == "current")
                                      or loss.monitor_forwards_current_policy or loss.measures_update_effect)
    entropy_coeff = float(pick(f"{ACTOR}.entropy_coeff", 0) or 0)
    update_entropy = (bool(pick(f"{ACTOR}.calculate_entropy", False)) or entropy_coeff != 0
                      or (loss is not None and loss.needs_update_entropy))
    mixed = pick(f"{ACTOR}.fsdp_config.mixed_precision") or {}
    param_dtype = str(mixed.get("param_dtype", "bf16")) if hasattr(mixed, "get") else "bf16"

    def root_resident(role: str) -> bool:
        return (str(pick(f"{role}.strategy", "fsdp")) == "fsdp"
                and int(pick(f"{role}.fsdp_config.fsdp_size", -1) or -1) <= 1)

    return Settings(
        world_size=world,
        gpu_memory_utilization=float(pick(f"{ROLLOUT}.gpu_memory_utilization", 0.5)),
        log_prob_tokens=log_prob,
        update_tokens=tokens(f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_gpu",
                             f"{ACTOR}.ppo_micro_batch_size_per_gpu"),
        ref_tokens=ref_tokens,
        current_tokens=log_prob if current else None,
        calculate_sum_pi_squared=bool(pick(f"{ACTOR}.calculate_sum_pi_squared", False)),
        entropy_chunk=int(pick(f"{ACTOR}.entropy_from_logits_chunk_size", ENTROPY_CHUNK_ROWS))
        if pick(f"{ACTOR}.entropy_from_logits_with_chunking", False) else None,
        update_entropy=update_entropy,
        update_entropy_grad=entropy_coeff != 0,
        compute_bytes=FP32 if param_dtype in ("fp32", "float32") else BF16,
        param_offload=bool(pick(f"{ACTOR}.fsdp_config.param_offload", False)),
        optimizer_offload=bool(pick(f"{ACTOR}.fsdp_config.optimizer_offload", False)),
        unit_temperature=float(pick(f"{ROLLOUT}.temperature", 1.0)) == 1.0,
        reference_root_resident=root_resident(REF),
        actor_root_resident=root_resident(ACTOR),
        no_sync_gradients=bool(pick(f"{ACTOR}.fsdp_config.use_no_sync_for_gradient_accumulation", False)),
        update_effect_tokens=update_effect,
        longest=longest,
        sp=int(pick(f"{ACTOR}.ulysses_sequence_parallel_size", 1) or 1),
        sequence_parallel_allowed=sp_allowed,
        rollout_tp=int(pick(f"{ROLLOUT}.tensor_model_parallel_size", 1) or 1),
        dynamic_bsz=dynamic,
    )


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def margin_bytes(p: Pass) -> float:
    """The room ``p`` must leave below the GPU's capacity for what the estimate may miss:
    :data:`MARGIN_FIXED_BYTES` plus :data:`MARGIN_FRACTION` of its total beside vLLM's share and the
    overhead."""
    modelled = p.total - p.components.get("vLLM (gpu_memory_utilization)", 0.0) - p.components.get("overhead", 0.0)
    return MARGIN_FIXED_BYTES + MARGIN_FRACTION * max(0.0, modelled)


def fits(p: Pass, gpu_bytes: float) -> bool:
    """``p``'s estimate and its margin fit the GPU's capacity."""
    return p.total + margin_bytes(p) <= gpu_bytes


def verdict(p: Pass, gpu_bytes: float) -> str:
    """``ok`` (fits with its margin), ``TIGHT`` (within the capacity, not the margin) or ``DOES NOT FIT``."""
    if fits(p, gpu_bytes):
        return "ok"
    return "TIGHT" if p.total <= gpu_bytes else "DOES NOT FIT"


def vllm_share_fits(est: Estimate, gpu_bytes: float) -> bool:
    """vLLM's share holds its weights and one longest sequence (always true when ``longest`` is not known)."""
    s = est.settings
    return not s.longest or s.gpu_memory_utilization * gpu_bytes >= vllm_floor_bytes(est.shape, s)


def all_fit(est: Estimate, gpu_bytes: float) -> bool:
    return vllm_share_fits(est, gpu_bytes) and all(fits(p, gpu_bytes) for p in est.passes)


def problems(est: Estimate, gpu_bytes: float) -> list[tuple[str, str, str]]:
    """``(pass, setting, problem)`` for every pass whose estimated peak plus its margin exceeds
    ``gpu_bytes`` (the problem names its peak phase and largest components), and for a vLLM share too
    small for vLLM's weights and one longest sequence (pass ``rollout``)."""
    out = []
    for p in est.passes:
        if fits(p, gpu_bytes):
            continue
        top = sorted(p.components.items(), key=lambda kv: -kv[1])[:3]
        where = (f"more than the {gib(gpu_bytes)} GiB of the target GPU" if p.total > gpu_bytes else
                 f"within the {gib(gpu_bytes)} GiB of the target GPU but not with the estimate's margin of "
                 f"{gib(margin_bytes(p))} GiB")
        at = f" at {p.tokens} tokens" if p.tokens is not None else ""
        out.append((p.name, p.setting, f"needs about {gib(p.total)} GiB per GPU{at} ({p.phase}), {where} "
                    "(largest: " + ", ".join(f"{k} {gib(v)}" for k, v in top) + ")"))
    if not vllm_share_fits(est, gpu_bytes):
        s = est.settings
        out.append(("rollout", f"{ROLLOUT}.gpu_memory_utilization",
                    f"vLLM's share, {s.gpu_memory_utilization:g} x {gib(gpu_bytes)} GiB = "
                    f"{gib(s.gpu_memory_utilization * gpu_bytes)} GiB, is less than its weights and one "
                    f"{s.longest}-token sequence's KV cache need ({gib(vllm_floor_bytes(est.shape, s))} GiB with "
                    f"tensor parallel size {s.rollout_tp}): vLLM would refuse to start"))
    return out


def table(est: Estimate, gpu_bytes: float) -> str:
    """The estimate as text: one row per pass (its total, its margin, its peak phase and largest
    components) and the verdict."""
    s = est.shape
    lines = [f"GPU memory per GPU (estimate, GiB; target {gib(gpu_bytes)} GiB as CUDA reports it; model "
             f"{s.params / 1e9:.2f}B params, {s.num_layers} layers, hidden {s.hidden_size}, vocab {s.vocab_size}; "
             f"from {s.source or 'config'}):"]
    width = max(len(p.name) for p in est.passes)
    for p in est.passes:
        share = p.total / gpu_bytes
        tokens = f" at {p.tokens} tokens, {p.bytes_per_token / 1024:.0f} KiB/token" if p.tokens is not None else ""
        top = sorted(p.components.items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"  {p.name:<{width}}  {gib(p.total):>6} +{gib(margin_bytes(p)):>4}  {share:5.0%}  "
                     f"{verdict(p, gpu_bytes):<12}{tokens} ({p.phase}): "
                     + ", ".join(f"{k} {gib(v)}" for k, v in top))
    peak = est.peak
    lines.append(f"  peak: {peak.name}, {gib(peak.total)} GiB ({peak.total / gpu_bytes:.0%} of the GPU; a pass must "
                 "leave its margin, the second number, free)")
    st = est.settings
    if st.longest:
        share = st.gpu_memory_utilization * gpu_bytes
        floor = vllm_floor_bytes(est.shape, st)
        lines.append(f"  vLLM's share {gib(share)} GiB holds its weights, one {st.longest}-token sequence's KV cache "
                     f"and its runtime ({gib(floor)} GiB at tensor parallel size {st.rollout_tp}): "
                     + ("ok" if share >= floor else "TOO SMALL"))
    return "\n".join(lines)


#: the code each component follows (verl 0.9.1, transformers, flash-attn 2.8, PyTorch's FSDP1 and
#: AdamW; paths under site-packages), written out term by term in docs/memory.md
COMPONENT_SOURCES = {
    "parameters (fp32, sharded)": "verl/workers/engine/fsdp/transformer_impl.py:262 and fsdp.yaml model_dtype=fp32: "
                                  "float32 master weights, FULL_SHARD over every GPU (fsdp_size=-1)",
    "optimizer (AdamW, fp32, sharded)": "verl/workers/config/optimizer.py:298 build_optimizer: torch AdamW, two "
                                        "float32 moments per sharded parameter",
    "gradients (fp32, sharded)": "torch/distributed/fsdp/_runtime_utils.py:848 the reduce-scattered float32 shard; "
                                 "verl/workers/engine/fsdp/transformer_impl.py:1139 zeroed when train mode exits",
    "unsharded gradients (no_sync)": "verl/workers/engine/fsdp/transformer_impl.py:702 "
                                     "use_no_sync_for_gradient_accumulation: FSDP's no_sync keeps them",
    "reference root unit (unsharded)": "verl/workers/engine/fsdp/transformer_impl.py:1117 the root resharded only "
                                       "when fsdp_size > 1; FSDP1 keeps a root unsharded after its forward",
    "actor root unit (unsharded since the log-prob pass)": "verl/workers/engine/fsdp/transformer_impl.py:1117 (the "
                                                           "same for the actor's eval mode)",
    "gathered parameters": "FSDP1 FULL_SHARD, mixed precision bf16: the root unit for the whole pass, the running "
                           "and the prefetched layer",
    "vLLM (gpu_memory_utilization)": "vLLM's requested memory = gpu_memory_utilization x total; "
                                     "verl/workers/engine_workers.py:823 resumes its KV cache each step",
    "overhead": "unmeasured: CUDA contexts, NCCL communicators and NVLS buffers, vLLM's CUDA graphs asleep "
                "(pinned by python -m stapo_memory.calibration)",
    "layer working set (no grad)": "transformers/models/qwen3/modeling_qwen3.py:82 (MLP) and :392 (inputs_embeds "
                                   "kept by the model's forward)",
    "final hidden states": "transformers/models/qwen3/modeling_qwen3.py:505 the LM head's input",
    "logits": "transformers/models/qwen3/modeling_qwen3.py:505 lm_head in bf16 (autocast); kept by "
              "verl/workers/engine/fsdp/transformer_impl.py:1549 forward_step's output",
    "log-probs, entropy, outputs": "flash_attn/ops/triton/cross_entropy.py losses, lse, z_losses; the entropy and sum "
                                   "of squares per token",
    "log-probs, outputs": "flash_attn/ops/triton/cross_entropy.py losses, lse, z_losses",
    "temperature-scaled logits": "verl/workers/engine/fsdp/transformer_impl.py:98 logits / temperature, beside the "
                                 "model's output",
    "entropy chunk": "verl/utils/torch_functional.py:248 a chunk's float32 copy, softmax and product",
    "sum_pi^2 chunk": "verl_patches/sum_pi_squared.py (replacing verl/utils/torch_functional.py's unchunked "
                      "formula): a chunk's float32 copy, its double, logsumexp's temporary",
    "checkpointed layer inputs": "verl/workers/engine/fsdp/transformer_impl.py:336 gradient_checkpointing_enable("
                                 "use_reentrant=False): each layer's input kept",
    "last layer's forward (checkpointed)": "transformers/models/qwen3/modeling_qwen3.py:82 the MLP's tensors, "
                                           "nothing saved under checkpointing",
    "final norm (saved, output)": "transformers/models/qwen3/modeling_qwen3.py:59 Qwen3RMSNorm: float32 copy, "
                                  "normalised tensor; its output is the LM head's saved input",
    "logits (+ gradient in place)": "verl/utils/torch_functional.py:129 cross_entropy_loss(inplace_backward=True): "
                                    "flash-attn saves the logits and writes their gradient into them",
    "logits gradient (not in place)": "verl/workers/engine/fsdp/transformer_impl.py:1427 inplace_backward=False with "
                                      "the entropy: flash-attn's torch.empty_like(logits)",
    "gradient of the temperature's division": "autograd's DivBackward: a new tensor beside the logits' gradient",
    "entropy (with grad)": "verl/utils/torch_functional.py:248 every chunk's float32 copy and softmax kept for the "
                           "backward (an entropy bonus)",
    "entropy chunk (no grad)": "verl_patches/current_stats.py wrap_set_loss_fn: the update's entropy under no_grad, "
                               "one chunk at a time",
    "logits gradient": "flash-attn's cross entropy backward, then the LM head's backward reads it",
    "gradient of the LM head input": "the LM head's backward: the gradient of its input",
    "LM head weight gradient (unsharded)": "FSDP1 flat parameter: the root unit's view gradients wait for its "
                                           "reduction at the end of the backward",
    "final norm's backward (float32)": "transformers/models/qwen3/modeling_qwen3.py:59 differentiated: its float32 "
                                       "copy and five float32 temporaries",
    "layer recompute + backward": "transformers/models/qwen3/modeling_qwen3.py:294 recomputed; saved tensors of its "
                                  "norms, flash-attn (transformers/modeling_flash_attention_utils.py:511) and MLP; "
                                  "flash-attn's mha_varlen_bwd dq_accum, softmax_d, dk/dv expanded",
    "gradient flowing into the embedding": "the embedding's backward: the gradient of its output",
    "embedding weight gradient (unsharded)": "the embedding's dense weight gradient, beside the LM head's (untied)",
    "this layer's gradient (unsharded)": "FSDP1 flat parameter: the unit's view gradients until its reduction",
    "gradient flowing down": "the gradient of a layer's input",
    "layer gradient: unsharded, float32 copy, shard": "torch/distributed/fsdp/_runtime_utils.py:764 cast to float32 "
                                                      "while the bf16 gradient is referenced, :848 reduce-scatter",
    "root unit gradient: unsharded, float32 copy, shard": "torch/distributed/fsdp/_runtime_utils.py:764 and :848, "
                                                          "for the root unit at the end of the backward",
    "AdamW foreach temporary (fp32, sharded)": "torch/optim/adam.py:762 torch._foreach_sqrt(exp_avg_sq): one "
                                               "float32 copy of the moments",
}
