"""GPU memory of one training step, pass by pass: an estimate from the model's shape and the run's
settings (plain arithmetic, no GPU, no verl import). docs/memory.md states every assumption.

A step of verl 0.9.1's FSDP actor with a colocated vLLM rollout runs these passes one after the
other on every GPU, each on top of what stays resident between them:

=================  ====================================================================================
pass               what is on the GPU at its peak
=================  ====================================================================================
``rollout``        the actor's resident training state + vLLM at ``gpu_memory_utilization`` x GPU memory
``log_prob``       resident state + one micro-batch's forward without grad at the log-prob token budget:
                   activations, logits, log-probs, chunked entropy, the sum of squared probabilities
``reference``      (GRPO with a KL loss) the same at the reference budget; its parameters live on the CPU,
                   except its root unit, which FSDP1 leaves unsharded on the GPU from then on
``current``        (S2T's current-policy statistics, applied or monitored) the actor's own no-grad forward
``update_effect``  (``update_effect_responses``) the no-grad forward of the measured responses
``update``         parameters, gradients and optimizer state, the layer inputs kept by gradient
                   checkpointing, one layer's recomputed activations and gradients, logits and their gradient
=================  ====================================================================================

Every token-dependent term is per GPU: with remove-padding a micro-batch packs at most the token budget
on each GPU (with Ulysses sequence parallelism of size ``sp`` a micro-batch holds ``budget x sp``
tokens split over ``sp`` GPUs). :func:`estimate` gives each pass's components; :func:`problems` turns
a pass that does not fit within :func:`margin_bytes` of the GPU's capacity into a message naming the
changes that make it fit, each one re-estimated before it is suggested (:func:`fixes`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Optional

from omegaconf import OmegaConf

from recipe.stapo.policy_loss import settings_of

GIB = 1024**3
#: bytes of the dtypes involved
FP32, BF16 = 4, 2
#: per GPU, beside what the passes allocate: the trainer's and vLLM's CUDA contexts, NCCL buffers,
#: vLLM's residue while it sleeps (CUDA graphs), the caching allocator's rounding: 3 to 6 GiB, the
#: middle of that range counted
OVERHEAD_BYTES = 4.5 * GIB
#: the estimate's stated uncertainty, the margin a pass must leave below the GPU's capacity: the rest
#: of the overhead's range, plus a share of everything the estimate computes beside vLLM's share (which
#: vLLM enforces itself) and the overhead (docs/memory.md: the terms measured on CPU at reduced width)
MARGIN_FIXED_BYTES = 1.5 * GIB
MARGIN_FRACTION = 0.10
#: the chunk (rows of logits) of the recipe's sum of squared probabilities: a copy of
#: ``verl_patches.sum_pi_squared.CHUNK_ROWS`` (no torch import here; a test ties the two)
SUM_PI_SQUARED_CHUNK_ROWS = 2048
#: the chunk of verl's ``entropy_from_logits_with_chunking``: a copy of its ``chunk_size`` default and of
#: ``actor.entropy_from_logits_chunk_size``'s (a test ties them)
ENTROPY_CHUNK_ROWS = 2048
#: one recomputed decoder layer's backward (its saved tensors and their gradients, the attention's and
#: the MLP's temporaries) in units of its saved set ``(2h + 3q + 3kv + 4I) x b`` bytes per token: 1.93
#: measured on CPU for Qwen3-8B's layer at 1/8 width (benchmarks/bench_layer_memory.py), rounded up
LAYER_BACKWARD_FACTOR = 1.95

#: what CUDA reports as a card's total memory (GiB, ``torch.cuda.get_device_properties(0).total_memory``),
#: the meaning of ``GPU_MEM_GB``; vLLM's ``gpu_memory_utilization`` is a share of the same number
GPU_CAPACITY_GIB = {
    "A100 / A800 / H100 / H800 80GB": 79.1,
    "H20 96GB": 95.0,
    "H200 141GB": 139.8,
    "A100 40GB": 39.4,
}
#: ``GPU_MEM_GB``'s default: an 80 GB card as CUDA reports it
DEFAULT_GPU_MEM_GIB = 79.1


# ------------------------------------------------------------------------------------------------
# the model's shape
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a decoder-only model's ``config.json``.

    ``qk_norm``: per-head RMSNorm of queries and keys (Qwen3); ``qkv_bias``: biases on the query, key
    and value projections (Qwen2); ``source``: where the numbers come from (a file or a built-in).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    qkv_bias: bool = False
    model_type: str = "qwen3"
    source: str = ""

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, MLP (gate, up, down), two RMSNorms."""
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        """Token embedding plus the LM head (once when tied) and the final norm: the parameters FSDP
        keeps in its root unit (every decoder layer is its own unit)."""
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.hidden_size

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params


def shape_from_hf_config(config: Mapping, source: str = "") -> ModelShape:
    """:class:`ModelShape` of a Hugging Face ``config.json`` (a nested ``text_config`` is used when
    present). Raises ``ValueError`` naming the missing field."""
    cfg = dict(config.get("text_config") or config)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(cfg.get(k), int)]
    if missing:
        raise ValueError(f"{source or 'config.json'}: no integer {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    return ModelShape(
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        qkv_bias=model_type.startswith("qwen2") or bool(cfg.get("attention_bias", False)),
        model_type=model_type,
        source=source,
    )


def _qwen3(hidden, layers, heads, intermediate, tied, name) -> ModelShape:
    return ModelShape(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128,
                      intermediate_size=intermediate, vocab_size=151936, tie_word_embeddings=tied, qk_norm=True,
                      model_type="qwen3", source=f"built-in {name} architecture")


#: the paper's models (their ``config.json``), for a model path the launching machine cannot read
#: (a hub id, or cluster storage not mounted here); the base and post-trained models share them
BUILTIN_SHAPES = {
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True, "Qwen3-1.7B"),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False, "Qwen3-8B"),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, False, "Qwen3-14B"),
}


def builtin_shape(model_path: str) -> Optional[ModelShape]:
    """The built-in shape whose name the path's last component carries (``.../Qwen3-8B-Base``), or None."""
    name = re.sub(r"[-_](base|instruct)$", "", Path(str(model_path).rstrip("/")).name.lower())
    return BUILTIN_SHAPES.get(name)


def load_shape(model_path: str) -> ModelShape:
    """The shape from ``<model_path>/config.json``; ``ValueError`` when it cannot be read."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return shape_from_hf_config(config, source=str(path))


# ------------------------------------------------------------------------------------------------
# the run's settings
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The settings the estimate reads (per GPU unless named otherwise).

    Token budgets are the tokens one micro-batch holds per GPU (dynamic batching: the budget itself;
    fixed micro-batches: micro-batch size x longest sequence). ``sum_pi_squared_chunk``: rows per chunk
    of the sum of squared probabilities (None: verl's own unchunked computation); ``entropy_chunk``:
    rows per chunk of the entropy (None: unchunked).
    """

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
    no_sync_gradients: bool = False             # use_no_sync_for_gradient_accumulation: unsharded gradients kept
    update_effect_tokens: Optional[int] = None  # None: no update-effect forward


@dataclass
class Pass:
    """One pass: its components (name -> bytes), the setting that lowers it most, and the part of
    its total that grows with ``tokens`` (bytes per token), for the largest budget that fits."""

    name: str
    components: dict[str, float]
    setting: str
    tokens: Optional[int] = None
    bytes_per_token: float = 0.0
    note: str = ""

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


# ------------------------------------------------------------------------------------------------
# the logits side (the pieces checked against a measurement: benchmarks/bench_logits_memory.py)
# ------------------------------------------------------------------------------------------------


def logits_bytes(tokens: int, vocab: int, dtype_bytes: int = BF16) -> float:
    """The logits of ``tokens`` positions: ``tokens x vocab`` in the compute dtype."""
    return float(tokens) * vocab * dtype_bytes


def sum_pi_squared_extra_bytes(tokens: int, vocab: int, logits_dtype_bytes: int = BF16,
                               chunk: Optional[int] = None, autocast_fp32: bool = True) -> float:
    """Peak bytes ``sum_n pi_n^2`` allocates beside the logits.

    verl's unchunked ``exp(logsumexp(2 x) - 2 logsumexp(x))`` holds ``2 x`` (logits dtype) while its
    ``logsumexp`` runs; under CUDA autocast ``logsumexp`` is a float32 op, so it first casts its
    input to float32 and then subtracts the row maximum into a second float32 temporary:
    ``tokens x vocab x (b + 4 + 4)`` bytes for logits of ``b`` bytes (float32 logits need no cast).
    Chunked (the recipe's patch): one float32 copy of ``chunk`` rows, its double and the
    ``logsumexp`` temporary, ``12 x chunk x vocab`` bytes, whatever the dtype.
    """
    if chunk is not None:
        return 3.0 * FP32 * min(chunk, tokens) * vocab
    cast = FP32 if (autocast_fp32 and logits_dtype_bytes < FP32) else 0
    return float(tokens) * vocab * (logits_dtype_bytes + cast + FP32)


def entropy_extra_bytes(tokens: int, vocab: int, chunk: Optional[int] = 2048) -> float:
    """Peak bytes verl's entropy allocates beside the logits, without autograd: per chunk a float32
    copy, its softmax and one more float32 temporary (the ``logsumexp`` or the product
    ``softmax x logits``): ``12 x rows x vocab`` (rows: the chunk, or every token unchunked).
    ``torch.compile`` (verl's default) fuses some of them: an upper bound."""
    rows = tokens if chunk is None else min(chunk, tokens)
    return 3.0 * FP32 * rows * vocab


# ------------------------------------------------------------------------------------------------
# the passes
# ------------------------------------------------------------------------------------------------


def _per_token_activation_bytes(shape: ModelShape, b: int) -> tuple[float, float, float]:
    """(no-grad forward working set, what the update keeps through its backward, one layer's backward)
    in bytes per token.

    Without grad only one layer's tensors are alive at a time: the residual stream in and out, a norm
    output and the MLP's gate, up and their product (``4h + 3I``). Gradient checkpointing keeps each
    layer's input (``L x h``); the final norm (outside the checkpointed layers) keeps its input, its
    output and the float32 copy of its input it normalises (``2h b + 4h``). The backward recomputes one
    layer, whose saved set (two norm outputs, queries and keys before and after their norm, values,
    attention output: ``2h + 3q + 3kv``; gate, up, activation and product: ``4I``) together with its
    gradients and the attention's and MLP's temporaries peaks at :data:`LAYER_BACKWARD_FACTOR` times
    that set (measured).
    """
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    no_grad = (4 * h + 3 * i) * b
    checkpoints = shape.num_layers * h * b + 2 * h * b + FP32 * h
    layer_backward = LAYER_BACKWARD_FACTOR * (2 * h + 3 * q + 3 * kv + 4 * i) * b
    return no_grad, checkpoints, layer_backward


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
    """The reference model's root unit (embeddings, LM head, final norm) in the compute dtype: FSDP1
    does not free a root's parameters after a forward, and verl's eval context reshards the root only
    when ``fsdp_size > 1``, so it stays on the GPU from the reference pass through the update, the next
    rollout and the next log-prob pass (its CPU offload covers only the sharded parameters)."""
    return float(s.compute_bytes * shape.embedding_params)


def _gathered(shape: ModelShape, s: Settings) -> float:
    """Unsharded compute-dtype parameters during a forward: FSDP's root unit (embeddings, LM head)
    for the whole pass, plus two decoder layers (the one running and the one prefetched)."""
    return s.compute_bytes * (shape.embedding_params + 2 * shape.layer_params)


def _forward_pass(name: str, shape: ModelShape, s: Settings, tokens: int, setting: str, *, entropy: bool,
                  sum_pi_squared: bool, resident: dict[str, float], note: str = "") -> Pass:
    """A no-grad forward's peak: the larger of the layers' working set and the logits side (the layers'
    tensors are freed before the LM head runs; the final hidden states stay for it)."""
    b, v, h = s.compute_bytes, shape.vocab_size, shape.hidden_size
    no_grad, _, _ = _per_token_activation_bytes(shape, b)
    logits = logits_bytes(tokens, v, b) * (1 if s.unit_temperature else 2)
    temporaries = {"entropy": entropy_extra_bytes(tokens, v, s.entropy_chunk) if entropy else 0.0,
                   "sum_pi^2": sum_pi_squared_extra_bytes(tokens, v, b, s.sum_pi_squared_chunk)
                   if sum_pi_squared else 0.0}
    which = max(temporaries, key=temporaries.get)  # computed one after the other
    logits_side = {"final hidden states": float(h * b * tokens),
                   "logits" + ("" if s.unit_temperature else " + temperature copy"): logits,
                   "log-probs, outputs": 3.0 * FP32 * tokens}
    if temporaries[which]:
        logits_side[f"{which} temporaries"] = temporaries[which]
    components = dict(resident)
    components["gathered parameters"] = _gathered(shape, s)
    if no_grad * tokens > sum(logits_side.values()):
        components["activations (no grad)"] = no_grad * tokens
        per_token = no_grad
    else:
        components.update(logits_side)
        per_token = h * b + v * b * (1 if s.unit_temperature else 2) + 3 * FP32
        if which == "sum_pi^2" and s.sum_pi_squared_chunk is None and sum_pi_squared:
            per_token += temporaries[which] / tokens
        if which == "entropy" and s.entropy_chunk is None and entropy:
            per_token += temporaries[which] / tokens
    components["overhead"] = float(s.overhead_bytes)
    return Pass(name, components, setting, tokens, per_token, note)


def estimate(shape: ModelShape, s: Settings, gpu_bytes: float) -> Estimate:
    """Every pass of one step (see the module docstring); ``gpu_bytes`` (what CUDA reports) sizes vLLM's share."""
    b, v = s.compute_bytes, shape.vocab_size
    passes = []
    rollout = _resident(shape, s, rollout=True)
    rollout["vLLM (gpu_memory_utilization)"] = s.gpu_memory_utilization * gpu_bytes
    rollout["overhead"] = float(s.overhead_bytes)
    passes.append(Pass("rollout", rollout, "actor_rollout_ref.rollout.gpu_memory_utilization"))
    log_prob_setting = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
    passes.append(_forward_pass("log_prob", shape, s, s.log_prob_tokens, log_prob_setting, entropy=True,
                                sum_pi_squared=s.calculate_sum_pi_squared, resident=_resident(shape, s)))
    if s.ref_tokens is not None:
        # the reference model is CPU-offloaded by verl (forward_only): its gathered units are here, and
        # its root stays (counted in the resident state of every pass)
        passes.append(_forward_pass("reference", shape, s, s.ref_tokens,
                                    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", entropy=False,
                                    sum_pi_squared=False, resident=_resident(shape, s)))
    if s.current_tokens is not None:
        passes.append(_forward_pass("current", shape, s, s.current_tokens, log_prob_setting, entropy=True,
                                    sum_pi_squared=False, resident=_resident(shape, s),
                                    note="S2T's current-policy statistics (verl's log-prob pass settings)"))
    if s.update_effect_tokens is not None:
        passes.append(_forward_pass("update_effect", shape, s, s.update_effect_tokens, log_prob_setting,
                                    entropy=False, sum_pi_squared=False, resident=_resident(shape, s),
                                    note="the update effect's forward of the measured responses"))
    # update: at the start of the backward (the token-dependent peak) ...
    t = s.update_tokens
    _, checkpoints, layer_backward = _per_token_activation_bytes(shape, b)
    update = _resident(shape, s, update=True)
    update["gathered parameters"] = _gathered(shape, s)
    # FSDP's root unit (embeddings, LM head) gets one unsharded gradient at the LM head's backward,
    # which lives until the embedding's backward ends the pass
    update["root unit gradient (unsharded)"] = float(b * shape.embedding_params)
    # each layer's backward leaves its unsharded gradient, cast to float32 for the reduce-scatter
    update["layer gradients (unsharded + fp32 copy)"] = float((b + FP32) * shape.layer_params)
    if s.no_sync_gradients:
        update["unsharded gradients (no_sync)"] = float(b * shape.params)
    update["checkpointed layer inputs, final norm"] = checkpoints * t
    update["layer recompute + backward"] = layer_backward * t
    per_token = checkpoints + layer_backward + v * b
    update["logits" if s.update_entropy else "logits (+ gradient in place)"] = logits_bytes(t, v, b)
    if not s.unit_temperature:
        update["temperature copy"] = logits_bytes(t, v, b)
        per_token += v * b
    if s.update_entropy:
        # verl passes inplace_backward=False to the log-prob kernel when the entropy is computed: the
        # logits' gradient is a new tensor beside the logits
        update["logits gradient (not in place)"] = logits_bytes(t, v, b)
        per_token += v * b
        if s.update_entropy_grad:
            # autograd keeps every chunk's float32 copy and softmax
            update["entropy (with grad)"] = 2.0 * FP32 * t * v
            per_token += 2 * FP32 * v
        else:
            update["entropy (no grad)"] = entropy_extra_bytes(t, v, s.entropy_chunk)
            if s.entropy_chunk is None:
                per_token += 3 * FP32 * v
    update["overhead"] = float(s.overhead_bytes)
    passes.append(Pass("update", update, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", t, per_token))
    # ... and at its end: the activations are gone, the root unit's gradient is cast to float32 for
    # the reduce-scatter over the world size (and each layer's, two at a time)
    end = _resident(shape, s, update=True)
    end["gathered parameters"] = _gathered(shape, s)
    end["root unit gradient (unsharded)"] = float(b * shape.embedding_params)
    end["float32 copies for the reduce-scatter"] = FP32 * (shape.embedding_params + 2 * shape.layer_params)
    if s.no_sync_gradients:
        end["unsharded gradients (no_sync)"] = float(b * shape.params)
    end["overhead"] = float(s.overhead_bytes)
    passes.append(Pass("update_end", end, "trainer.nnodes",
                       note="gradient reduction at the end of the backward: more GPUs shard the state further"))
    return Estimate(shape, s, passes)


# ------------------------------------------------------------------------------------------------
# reading a composed config
# ------------------------------------------------------------------------------------------------

#: what makes verl build the reference model (a KL loss or a KL penalty in the reward)
_KL_KEYS = ("actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward")


def settings_from_config(config) -> Settings:
    """:class:`Settings` of a composed recipe config (an OmegaConf config whose numbers the preflight
    has checked); the token selection's decisions come from its policy-loss dataclass."""
    pick = lambda key, default=None: OmegaConf.select(config, key, default=default)  # noqa: E731
    world = int(pick("trainer.nnodes")) * int(pick("trainer.n_gpus_per_node"))
    longest = int(pick("data.max_prompt_length")) + int(pick("data.max_response_length"))

    def tokens(dynamic_key: str, budget_key: str, micro_key: str) -> int:
        if pick(dynamic_key, False):
            return int(pick(budget_key))
        return int(pick(micro_key) or 1) * longest

    actor, rollout, ref = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    log_prob = tokens(f"{rollout}.log_prob_use_dynamic_bsz", f"{rollout}.log_prob_max_token_len_per_gpu",
                      f"{rollout}.log_prob_micro_batch_size_per_gpu")
    uses_ref = any(bool(pick(k, False)) for k in _KL_KEYS)
    ref_tokens = tokens(f"{ref}.log_prob_use_dynamic_bsz", f"{ref}.log_prob_max_token_len_per_gpu",
                        f"{ref}.log_prob_micro_batch_size_per_gpu") if uses_ref else None
    loss = settings_of(config)
    current = loss is not None and (loss.forwards_current_policy or loss.monitor_forwards_current_policy)
    update_effect = None
    if loss is not None and loss.measures_update_effect:
        update_effect = min(log_prob, int(loss.update_effect_responses) * longest)
    entropy_coeff = float(pick(f"{actor}.entropy_coeff", 0) or 0)
    update_entropy = (bool(pick(f"{actor}.calculate_entropy", False)) or entropy_coeff != 0
                      or (loss is not None and loss.needs_update_entropy))
    mixed = pick(f"{actor}.fsdp_config.mixed_precision") or {}
    param_dtype = str(mixed.get("param_dtype", "bf16")) if hasattr(mixed, "get") else "bf16"
    ref_fsdp1 = str(pick(f"{ref}.strategy", "fsdp")) == "fsdp"
    return Settings(
        world_size=world,
        gpu_memory_utilization=float(pick(f"{rollout}.gpu_memory_utilization", 0.5)),
        log_prob_tokens=log_prob,
        update_tokens=tokens(f"{actor}.use_dynamic_bsz", f"{actor}.ppo_max_token_len_per_gpu",
                             f"{actor}.ppo_micro_batch_size_per_gpu"),
        ref_tokens=ref_tokens,
        current_tokens=log_prob if current else None,
        calculate_sum_pi_squared=bool(pick(f"{actor}.calculate_sum_pi_squared", False)),
        entropy_chunk=int(pick(f"{actor}.entropy_from_logits_chunk_size", ENTROPY_CHUNK_ROWS))
        if pick(f"{actor}.entropy_from_logits_with_chunking", False) else None,
        update_entropy=update_entropy,
        update_entropy_grad=entropy_coeff != 0,
        compute_bytes=FP32 if param_dtype in ("fp32", "float32") else BF16,
        param_offload=bool(pick(f"{actor}.fsdp_config.param_offload", False)),
        optimizer_offload=bool(pick(f"{actor}.fsdp_config.optimizer_offload", False)),
        unit_temperature=float(pick(f"{rollout}.temperature", 1.0)) == 1.0,
        reference_root_resident=ref_fsdp1 and int(pick(f"{ref}.fsdp_config.fsdp_size", -1) or -1) <= 1,
        no_sync_gradients=bool(pick(f"{actor}.fsdp_config.use_no_sync_for_gradient_accumulation", False)),
        update_effect_tokens=update_effect,
    )


# ------------------------------------------------------------------------------------------------
# verdicts
# ------------------------------------------------------------------------------------------------


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


def _pass_named(est: Estimate, name: str) -> Optional[Pass]:
    return next((p for p in est.passes if p.name == name), None)


def _fits_with(est: Estimate, name: str, gpu_bytes: float, **changes) -> bool:
    """``name``'s pass fits with its margin once ``changes`` are applied (the model re-run)."""
    p = _pass_named(estimate(est.shape, replace(est.settings, **changes), gpu_bytes), name)
    return p is not None and fits(p, gpu_bytes)


#: the settings field each token-dependent pass's budget is
_BUDGET_FIELDS = {"log_prob": ("log_prob_tokens", "current_tokens"), "current": ("log_prob_tokens", "current_tokens"),
                  "reference": ("ref_tokens",), "update": ("update_tokens",), "update_effect": ("update_effect_tokens",)}


def _budget_changes(est: Estimate, name: str, tokens: int) -> dict:
    """The settings change that sets ``name``'s token budget (the log-prob budget also sizes the
    current-policy forward, when there is one)."""
    return {f: tokens for f in _BUDGET_FIELDS[name] if f == _BUDGET_FIELDS[name][0] or getattr(est.settings, f)}


def largest_budget(est: Estimate, name: str, gpu_bytes: float, floor: int, multiple: int = 1024) -> Optional[int]:
    """The largest token budget (a multiple of ``multiple``, at least ``floor``) at which ``name``'s pass
    fits with its margin, the model re-run at each candidate; None when even ``floor`` does not fit."""
    current = _pass_named(est, name).tokens
    if not _fits_with(est, name, gpu_bytes, **_budget_changes(est, name, floor)):
        return None
    lo, hi = math.ceil(floor / multiple), max(math.ceil(floor / multiple), current // multiple)
    while lo < hi:  # the pass grows with its tokens
        mid = (lo + hi + 1) // 2
        if _fits_with(est, name, gpu_bytes, **_budget_changes(est, name, mid * multiple)):
            lo = mid
        else:
            hi = mid - 1
    best = lo * multiple
    return best if _fits_with(est, name, gpu_bytes, **_budget_changes(est, name, best)) else floor


def _more_gpus(est: Estimate, name: str, gpu_bytes: float, gpus_per_node: int, max_gpus: int = 512) -> Optional[int]:
    """The fewest GPUs above the current world size on which the pass fits: whole nodes of
    ``gpus_per_node``, or up to a node of 8 when the world is smaller."""
    worlds = sorted({n * gpus_per_node for n in range(1, max_gpus // gpus_per_node + 1)} | {2, 4, 8})
    for world in worlds:
        if world > est.settings.world_size and _fits_with(est, name, gpu_bytes, world_size=world):
            return world
    return None


def fixes(est: Estimate, name: str, gpu_bytes: float, longest: int, sp: int = 1, gpus_per_node: int = 8) -> list[str]:
    """Changes that make pass ``name`` fit with its margin, each re-estimated before it is named: a
    lower budget or utilisation first; when only offload or more GPUs help, those (and the text says so)."""
    s, p = est.settings, _pass_named(est, name)
    out: list[str] = []
    if s.no_sync_gradients and _fits_with(est, name, gpu_bytes, no_sync_gradients=False):
        out.append("set actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=false (it keeps "
                   "every layer's unsharded gradient across micro-batches)")
    if name == "rollout":
        u = math.floor(round(s.gpu_memory_utilization * 20, 6)) / 20
        while u >= 0.3 - 1e-9:
            if u < s.gpu_memory_utilization and _fits_with(est, name, gpu_bytes, gpu_memory_utilization=u):
                out.append(f"lower {p.setting} to at most {u:.2f}")
                break
            u = round(u - 0.05, 2)
    elif name in _BUDGET_FIELDS:
        floor = math.ceil(longest / sp)
        budget = largest_budget(est, name, gpu_bytes, floor)
        if budget is not None and budget < p.tokens:
            out.append(f"lower {p.setting} to at most {budget} (it must stay >= {floor} = prompt + response"
                       + (f" / sequence parallel size {sp})" if sp > 1 else ")"))
        elif budget is None:
            for bigger in (2, 4, 8):
                if bigger <= sp or s.world_size % bigger:
                    continue
                at = largest_budget(est, name, gpu_bytes, math.ceil(longest / bigger))
                if at is not None:
                    out.append(f"set actor_rollout_ref.actor.ulysses_sequence_parallel_size={bigger} with "
                               f"{p.setting} at most {at} (>= {math.ceil(longest / bigger)})")
                    break
    if out:
        return out
    helps = []
    if not s.optimizer_offload and _fits_with(est, name, gpu_bytes, optimizer_offload=True):
        helps.append("set actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")
    elif not (s.param_offload and s.optimizer_offload) and _fits_with(est, name, gpu_bytes, param_offload=True,
                                                                      optimizer_offload=True):
        helps.append("set actor_rollout_ref.actor.fsdp_config.param_offload=true and optimizer_offload=true")
    world = _more_gpus(est, name, gpu_bytes, gpus_per_node)
    if world is not None:
        helps.append(f"use at least {world} GPUs (trainer.nnodes x trainer.n_gpus_per_node; NNODES and "
                     "GPUS_PER_NODE in the run scripts) to shard the actor's state further")
    if not helps:
        return ["no single change fits this pass by the estimate: use more GPUs, offload, a smaller model or "
                "shorter sequences"]
    return ["only offload or more GPUs make it fit: " + " or ".join(helps)]


def problems(est: Estimate, gpu_bytes: float, longest: int, sp: int = 1,
             gpus_per_node: int = 8) -> list[tuple[str, str, str, str]]:
    """``(pass, setting, problem, fix)`` for every pass whose estimated peak plus its margin exceeds
    ``gpu_bytes``: the problem names the pass's largest components, the fix the changes that make it
    fit (:func:`fixes`)."""
    out = []
    for p in est.passes:
        if fits(p, gpu_bytes):
            continue
        top = sorted(p.components.items(), key=lambda kv: -kv[1])[:3]
        where = (f"more than the {gib(gpu_bytes)} GiB of the target GPU" if p.total > gpu_bytes else
                 f"within the {gib(gpu_bytes)} GiB of the target GPU but not with the estimate's margin of "
                 f"{gib(margin_bytes(p))} GiB")
        problem = (f"needs about {gib(p.total)} GiB per GPU, {where} (largest: "
                   + ", ".join(f"{k} {gib(v)}" for k, v in top) + ")")
        fix = "; or ".join(fixes(est, p.name, gpu_bytes, longest, sp, gpus_per_node))
        out.append((p.name, p.setting, problem, fix))
    return out


def table(est: Estimate, gpu_bytes: float) -> str:
    """The estimate as text: one row per pass (its total, its margin, its largest components) and the verdict."""
    s = est.shape
    lines = [f"GPU memory per GPU (estimate, GiB; target {gib(gpu_bytes)} GiB as CUDA reports it; model "
             f"{s.params / 1e9:.2f}B params, {s.num_layers} layers, hidden {s.hidden_size}, vocab {s.vocab_size}; "
             f"from {s.source or 'config'}):"]
    width = max(len(p.name) for p in est.passes)
    for p in est.passes:
        share = p.total / gpu_bytes
        tokens = f" at {p.tokens} tokens" if p.tokens is not None else ""
        top = sorted(p.components.items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"  {p.name:<{width}}  {gib(p.total):>6} +{gib(margin_bytes(p)):>4}  {share:5.0%}  "
                     f"{verdict(p, gpu_bytes):<12}{tokens}: " + ", ".join(f"{k} {gib(v)}" for k, v in top))
    peak = est.peak
    lines.append(f"  peak: {peak.name}, {gib(peak.total)} GiB ({peak.total / gpu_bytes:.0%} of the GPU; a pass must "
                 "leave its margin, the second number, free)")
    return "\n".join(lines)
