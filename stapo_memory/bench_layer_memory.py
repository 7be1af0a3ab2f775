"""The memory model's activation terms measured on CPU (``stapo_memory/terms.py``, docs/memory.md).

    python -m stapo_memory.bench_layer_memory pass --model qwen3-8b --tokens 32768             # an update micro-batch
    python -m stapo_memory.bench_layer_memory pass --model qwen3-8b --tokens 49152 --forward   # a log-prob micro-batch
    python -m stapo_memory.bench_layer_memory pass --model qwen3-8b --tokens 32768 --entropy   # update with the entropy
    python -m stapo_memory.bench_layer_memory accounting --scale 8 --tokens 2048   # the trace against the resident set
    python -m stapo_memory.bench_layer_memory layer --scale 8 --tokens 1024,3072   # one layer, resident set
    python -m stapo_memory.bench_layer_memory logits-grad    # the logits' gradient, 2048 x 151,936
    python -m stapo_memory.bench_layer_memory fsdp-root      # FSDP1 on gloo, two processes

``pass``: one micro-batch of verl 0.9.1's FSDP actor traced tensor by tensor. The real model code runs
(transformers' ``Qwen3ForCausalLM``, or Qwen2 / Llama, with gradient checkpointing as verl enables it,
``use_reentrant=False``), then what ``FSDPEngineWithLMHead.prepare_model_outputs`` and
``forward_step`` run on the logits (verl's chunked entropy, the recipe's chunked sum of squared
probabilities, the log-probs) and, for the update, ``loss.backward()``. The two GPU kernels are
stand-ins that allocate exactly what their code allocates: flash-attn's variable-length attention
(``FlashAttnVarlenFunc``: out, the float32 log-sum-exp, saved q, k, v; backward ``dq, dk, dv``, the
float32 ``dq_accum`` and ``softmax_d`` of ``mha_varlen_bwd`` and, with grouped-query attention, dk and
dv expanded to every head) called as transformers' ``_flash_attention_forward`` calls it for packed
sequences, and flash-attn's Triton cross entropy (``CrossEntropyLoss``: losses, log-sum-exp, z-losses;
it keeps the logits and writes their gradient into them with ``inplace_backward=True``, else into a
new tensor). Everything runs on the meta device: the full model at the full token budget costs no
memory, and every tensor is accounted for by its size (:class:`LiveTensors`: each new storage an
operation returns counts until it is freed). The peak of each phase (the forward, the logits'
computations, the LM head's backward, the layers' backward; for a no-grad pass the model's forward
and the logits' computations) is printed beside the memory model's activation terms of the same
phase. FSDP's buffers (gathered parameters, gradient buffers, reduce-scatter copies) are not traced:
the model counts them from FSDP's code. Layer parameters' gradients are freed as soon as they are
accumulated (FSDP reduce-scatters each unit's); the root unit's (embedding, LM head, final norm)
are kept to the end, as FSDP does.

``accounting``: the same trace on real CPU tensors of a model of the 8B's shape at 1/``scale`` width,
with the process's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
measured around it: the two peaks agree when the accounting sees every allocation.

``layer``: the bytes per token one recomputed decoder layer's forward with grad and its backward
allocate, measured as resident memory (``VmHWM``, as stapo_memory/bench_logits_memory.py): a Qwen3 layer
of the 8B's shape divided in width by ``--scale`` (heads of 128, as the real one), bfloat16, the
flash-attn stand-in, one packed sequence per token count. The slope over the token counts is the
per-token part, which scales with the width, so ``slope x scale`` is the 8B layer's, compared with the
model's ``layer_backward_bytes_per_token``.

``logits-grad``: the backward of verl's ``logprobs_from_logits`` on ``(tokens, vocab)`` bfloat16 logits
with ``inplace_backward=False`` (what verl passes when the update computes the entropy): the peak
bytes beyond the forward, against the model's ``tokens x vocab x 2`` for the logits' gradient. On CPU
verl's row-wise fallback runs (flash-attn's in-place kernel is GPU-only), so the flag changes nothing
here; the measurement is the gradient tensor the model adds.

``fsdp-root``: FSDP1 with one unit per decoder layer and the root holding the embedding and the
LM head, compute in bfloat16, on two gloo processes: after a forward without grad the decoder
layers' unsharded parameters are freed and the root's are not, until ``reshard`` (what verl's eval
context calls only when ``fsdp_size > 1``). Prints the bytes of each unit's unsharded storage.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import weakref
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from stapo_core.fileio import atomic_write
from verl_patches.sum_pi_squared import sum_pi_squared_chunked

from .bench_logits_memory import _mmap_large_allocations, peak_extra_bytes
from .model import Estimate, Settings, forward_activation_phases, update_activation_phases
from .shape import BUILTIN_SHAPES, ModelShape
from .terms import BF16, ENTROPY_CHUNK_ROWS, GIB, layer_backward_bytes_per_token, logits_bytes

QWEN3_8B = BUILTIN_SHAPES["qwen3-8b"]


# ------------------------------------------------------------------------------------------------
# tensor-size accounting
# ------------------------------------------------------------------------------------------------


class LiveTensors(TorchDispatchMode):
    """Counts the bytes of every storage an operation returns (a view or an in-place result shares
    its input's and is not counted again) until the storage is freed, on any device (the meta device
    included). ``mark(phase)`` starts a phase; ``peaks``: each phase's largest live total;
    ``at_peak``: the live storages at that moment, by the operation and shape that made them."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self._labels: dict[int, str] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, dict[str, int]] = {}

    def mark(self, phase: str) -> None:
        self.phase = phase
        self._note()

    def _note(self) -> None:
        if self.current > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.current
            live: dict[str, int] = {}
            for key, size in self._live.items():
                live[self._labels[key]] = live.get(self._labels[key], 0) + size
            self.at_peak[self.phase] = live

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._labels.pop(key, None)
        self._refs.pop(key, None)

    def _add(self, tensor: torch.Tensor, func, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live or key in inputs:
            return
        self._live[key] = storage.nbytes()
        self._labels[key] = f"{func.__name__} {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self.current += self._live[key]
        self._note()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, func, inputs)
        return out


# ------------------------------------------------------------------------------------------------
# flash-attn's kernels, as allocations
# ------------------------------------------------------------------------------------------------


class FlashVarlenAttention(torch.autograd.Function):
    """flash-attn 2's ``FlashAttnVarlenFunc`` as memory: forward ``out`` and the float32 ``softmax_lse``
    (heads x tokens), saving q, k, v, out, lse; backward ``dq, dk, dv`` (``torch.empty_like``) and the
    C++ ``mha_varlen_bwd`` buffers: ``softmax_d`` and ``dq_accum`` in float32 (tokens + 128 per sequence)
    and, when there are fewer key-value heads than heads, dk and dv for every head, summed into dk, dv.
    No values are computed (the stand-in is for memory only)."""

    @staticmethod
    def forward(ctx, q, k, v):
        tokens, heads, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(heads, tokens, dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        softmax_d = torch.empty(heads, tokens + 128, dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(tokens + 128, heads, dim, dtype=torch.float32, device=q.device)
        if kv_heads != heads:
            dk_expanded = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
            dv_expanded = torch.empty_like(dk_expanded)
            torch.sum(dk_expanded.view(tokens, kv_heads, heads // kv_heads, dim), 2, out=dk)
            torch.sum(dv_expanded.view(tokens, kv_heads, heads // kv_heads, dim), 2, out=dv)
            del dk_expanded, dv_expanded
        del softmax_d, dq_accum
        return dq, dk, dv


def flash_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``flash_attention_forward`` with packed sequences (verl passes position ids and no
    mask): (batch, heads, tokens, dim) transposed back, made contiguous and flattened
    (``_prepare_from_posids``), then the varlen kernel."""
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    q = query.contiguous().view(-1, query.size(-2), query.size(-1))
    k = key.contiguous().view(-1, key.size(-2), key.size(-1))
    v = value.contiguous().view(-1, value.size(-2), value.size(-1))
    out = FlashVarlenAttention.apply(q, k, v)
    return out.view(query.size(0), -1, out.size(-2), out.size(-1)), None


class FlashCrossEntropy(torch.autograd.Function):
    """flash-attn's Triton ``CrossEntropyLoss`` as memory: float32 losses, lse and z-losses per row;
    it saves the logits; its backward writes the logits' gradient into them (``inplace_backward``) or
    into ``torch.empty_like(logits)``."""

    @staticmethod
    def forward(ctx, logits, labels, inplace_backward):
        rows = logits.shape[0]
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        z_losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        ctx.save_for_backward(logits, lse, labels)
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(z_losses)
        return losses, z_losses

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):
        logits, _, _ = ctx.saved_tensors
        return (logits if ctx.inplace_backward else torch.empty_like(logits)), None, None


ATTENTION = "stapo_memory_count"


def build_model(shape: ModelShape, device: str = "meta", train: bool = True, seed: int = 0):
    """The transformers model of ``shape`` in bfloat16 on ``device`` with the flash-attn stand-in;
    for training, gradient checkpointing as verl enables it and the parameters' gradients as FSDP
    leaves them (a layer's freed once accumulated, the root unit's kept)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # transformers where a subcommand builds a model
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, flash_attention_forward)
    kwargs = dict(hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                  tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=1 << 20)
    model_type = shape.model_type or "qwen3"
    if model_type == "llama":
        kwargs["attention_bias"] = shape.qkv_bias
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config._attn_implementation = ATTENTION
    if train:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for layer in model.model.layers:
            for p in layer.parameters():
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    else:
        model.eval()
    return model


def _inputs(tokens: int, device: str):
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).unsqueeze(0)
    labels = torch.zeros(tokens, dtype=torch.long, device=device)
    return ids, positions, labels


def trace_update(shape: ModelShape, tokens: int, *, entropy: bool = False, entropy_grad: bool = False,
                 unit_temperature: bool = True, chunk: int = ENTROPY_CHUNK_ROWS, device: str = "meta",
                 model=None) -> LiveTensors:
    """One update micro-batch of ``tokens``, as ``forward_step`` and ``forward_backward_batch`` run it:
    the model's forward, the logits' computations (temperature, the entropy: without grad as the
    recipe's patch computes it, or with grad for an entropy bonus; the log-probs with
    ``inplace_backward`` unless the entropy is computed), a loss over the log-probs, then its backward.
    Phases: ``forward``, ``logits``, ``LM head backward``, ``layer backward``."""
    from verl.utils import torch_functional as verl_F  # verl where a subcommand runs its code

    model = model if model is not None else build_model(shape, device)
    ids, positions, labels = _inputs(tokens, device)
    live = LiveTensors()

    def last_layer_output(module, args, output):
        if torch.is_grad_enabled() and live.phase == "forward" and output.requires_grad:
            output.register_hook(lambda grad: live.mark("layer backward"))

    hook = model.model.layers[-1].register_forward_hook(last_layer_output)

    def forward_step():
        output, logits = _logits(model, ids, positions, live, unit_temperature)
        loss_terms = []
        if entropy:
            if entropy_grad:
                loss_terms.append(verl_F.entropy_from_logits_with_chunking(logits, chunk_size=chunk).mean())
            else:
                with torch.no_grad():
                    verl_F.entropy_from_logits_with_chunking(logits, chunk_size=chunk)
        log_probs, _ = FlashCrossEntropy.apply(logits, labels, not entropy)
        loss = (-log_probs).sum() / tokens
        for term in loss_terms:
            loss = loss - 0.001 * term
        return loss

    try:
        with live:
            live.mark("forward")
            loss = forward_step()
            live.mark("LM head backward")
            loss.backward()
            del loss
    finally:
        hook.remove()
    return live


def _logits(model, ids, positions, live: LiveTensors, unit_temperature: bool):
    """The model's forward of one micro-batch: its output and the ``(tokens, vocab)`` logits, divided
    by the rollout temperature (0.7) as verl's actor does unless it is 1; marks the ``logits`` phase."""
    output = model(input_ids=ids, position_ids=positions, use_cache=False)
    logits = output.logits.squeeze(0)
    live.mark("logits")
    if not unit_temperature:
        logits = logits / torch.full((logits.shape[0], 1), 0.7, device=logits.device).to(logits.dtype)
    return output, logits


def trace_forward(shape: ModelShape, tokens: int, *, entropy: bool = True, sum_pi_squared: bool = True,
                  unit_temperature: bool = True, chunk: int = ENTROPY_CHUNK_ROWS, device: str = "meta",
                  model=None) -> LiveTensors:
    """One no-grad micro-batch (the log-prob, reference, current-policy passes): the model's forward,
    then the recipe's chunked sum of squared probabilities, verl's chunked entropy and the log-probs.
    Phases: ``forward`` (the layers and the LM head) and ``logits``."""
    from verl.utils import torch_functional as verl_F  # verl where a subcommand runs its code

    model = model if model is not None else build_model(shape, device, train=False)
    ids, positions, labels = _inputs(tokens, device)
    live = LiveTensors()
    with live, torch.no_grad():
        live.mark("forward")
        output, logits = _logits(model, ids, positions, live, unit_temperature)  # output kept, as forward_step keeps it
        outputs = []
        if sum_pi_squared:
            outputs.append(sum_pi_squared_chunked(logits, chunk_rows=chunk))
        if entropy:
            outputs.append(verl_F.entropy_from_logits_with_chunking(logits, chunk_size=chunk))
        outputs.append(FlashCrossEntropy.apply(logits, labels, True)[0])
        del outputs, logits, output
    return live


# ------------------------------------------------------------------------------------------------
# the model's phases beside the trace's
# ------------------------------------------------------------------------------------------------

#: the model's phases (``stapo_memory.model``) and the traced phases that span the same moments
UPDATE_PHASES = {("layer forward", "forward end"): ("forward", "logits"),
                 ("logits backward", "LM head backward", "final norm backward"): ("LM head backward",),
                 ("layer backward", "embedding backward"): ("layer backward",)}
FORWARD_PHASES = {("layers", "LM head"): ("forward",), ("logits",): ("logits",)}


def _terms_total(terms, tokens: int) -> float:
    return sum(fixed + per_token * tokens for _, fixed, per_token in terms)


def compare(shape: ModelShape, tokens: int, *, forward: bool = False, entropy: bool = False,
            entropy_grad: bool = False, sum_pi_squared: bool = True, unit_temperature: bool = True) -> list[dict]:
    """Rows ``phase, traced_bytes, model_bytes, ratio`` (model / trace) of one micro-batch."""
    settings = Settings(world_size=8, gpu_memory_utilization=0.5, log_prob_tokens=tokens, update_tokens=tokens,
                           update_entropy=entropy, update_entropy_grad=entropy_grad, unit_temperature=unit_temperature)
    rows = []
    if forward:
        live = trace_forward(shape, tokens, entropy=entropy, sum_pi_squared=sum_pi_squared,
                             unit_temperature=unit_temperature)
        phases = forward_activation_phases(shape, settings, tokens, entropy=entropy, sum_pi_squared=sum_pi_squared)
        groups = FORWARD_PHASES
    else:
        live = trace_update(shape, tokens, entropy=entropy, entropy_grad=entropy_grad,
                            unit_temperature=unit_temperature)
        phases = update_activation_phases(shape, settings)
        groups = UPDATE_PHASES
    for model_names, traced_names in groups.items():
        model = max(_terms_total(phases[n], tokens) for n in model_names)
        traced = max(live.peaks.get(n, 0) for n in traced_names)
        rows.append({"phase": " / ".join(model_names), "traced_bytes": traced, "model_bytes": model,
                     "ratio": model / traced})
    for row in rows:
        row.update(model=shape.source, tokens=tokens)
    return rows


@functools.lru_cache(maxsize=None)
def _update_peaks(shape: ModelShape, tokens: int, entropy: bool, entropy_grad: bool,
                  unit_temperature: bool, chunk: int) -> dict[str, int]:
    return dict(trace_update(shape, tokens, entropy=entropy, entropy_grad=entropy_grad,
                             unit_temperature=unit_temperature, chunk=chunk).peaks)


@functools.lru_cache(maxsize=None)
def _forward_peaks(shape: ModelShape, tokens: int, entropy: bool, sum_pi_squared: bool,
                   unit_temperature: bool, chunk: int) -> dict[str, int]:
    return dict(trace_forward(shape, tokens, entropy=entropy, sum_pi_squared=sum_pi_squared,
                              unit_temperature=unit_temperature, chunk=chunk).peaks)


def counted_totals(est: Estimate) -> dict[str, float]:
    """Each pass of ``est`` as counted with the traced activations: the model's components that are
    not the model code's (resident state, gathered parameters, FSDP's gradient buffers, vLLM's share,
    the overhead) plus, per phase, the trace's peak of the same moments in place of the model's
    activation terms. Passes without token-dependent activations (rollout, update end, optimizer step)
    are the model's own count."""
    s, shape = est.settings, est.shape
    if s.entropy_chunk is None or (s.calculate_sum_pi_squared and s.sum_pi_squared_chunk is None):
        raise ValueError("the trace covers the chunked entropy and sum of squares only")
    out = {}
    for p in est.passes:
        if not p.phases:
            out[p.name] = p.total
            continue
        if p.name == "update":
            model = update_activation_phases(shape, s)
            traced = _update_peaks(shape, p.tokens, s.update_entropy, s.update_entropy_grad, s.unit_temperature,
                                   s.entropy_chunk)
            groups = UPDATE_PHASES
        else:
            entropy = p.name in ("log_prob", "current")
            spp = p.name == "log_prob" and s.calculate_sum_pi_squared
            model = forward_activation_phases(shape, s, p.tokens, entropy=entropy, sum_pi_squared=spp)
            traced = _forward_peaks(shape, p.tokens, entropy, spp, s.unit_temperature, s.entropy_chunk)
            groups = FORWARD_PHASES
        activation = {phase: _terms_total(terms, p.tokens) for phase, terms in model.items()}
        counted = {}
        for phase, total in p.phases.items():
            group = next((g for g in groups if phase in g), None)
            if group is None:  # FSDP's buffers only (a layer's gradient reduce-scatter)
                counted[phase] = total
                continue
            traced_peak = max(traced.get(name, 0) for name in groups[group])
            counted[phase] = total - activation[phase] + traced_peak
        out[p.name] = max(counted.values())
    return out


def lm_head_workspace_bytes(shape: ModelShape, tokens: int = 256) -> float:
    """Resident bytes the LM head's bfloat16 matmuls take beyond their inputs, output and gradients:
    the kernels' workspace, which no tensor holds (a CPU without native bfloat16 converts the
    ``(vocab, hidden)`` weight to float32, 38.9 MB at 1/8 of the 8B's width, whatever the tokens;
    near 0 where the CPU computes in bfloat16). The trace sees no workspace, as it sees no cuBLAS one."""
    x = torch.randn(tokens, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(shape.vocab_size, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, shape.vocab_size, dtype=torch.bfloat16)

    def forward_backward():
        torch.nn.functional.linear(x, weight).backward(grad)
        x.grad = weight.grad = None

    forward_backward()  # warm-up: lazy allocations
    tensors = (grad.numel() + x.numel() + weight.numel()) * BF16  # the output, the inputs' gradients
    return max(0.0, peak_extra_bytes(forward_backward, "cpu") - tensors)


def measure_accounting(scale: int, tokens: int, entropy: bool = False) -> dict:
    """The update trace on real CPU tensors of the 8B's shape at 1/``scale`` width (4 layers): the
    accounted peak against the resident-set peak around the same call less the LM head kernels'
    workspace (:func:`lm_head_workspace_bytes`), beside the model's update (the largest of its
    moments) and what counting the logits with the recomputed layer's backward would give
    (``summed_bytes``: the LM head's moment plus the layer's recompute term)."""
    _mmap_large_allocations()
    shape = replace(scaled_shape(scale), num_layers=4, vocab_size=QWEN3_8B.vocab_size // scale)
    model = build_model(shape, "cpu")
    trace_update(shape, 256, entropy=entropy, device="cpu", model=model)  # warm-up: lazy allocations
    result = {}

    def run():
        result["live"] = trace_update(shape, tokens, entropy=entropy, device="cpu", model=model)

    resident = peak_extra_bytes(run, "cpu")
    workspace = lm_head_workspace_bytes(shape)
    accounted = max(result["live"].peaks.values())
    settings = Settings(world_size=8, gpu_memory_utilization=0.5, log_prob_tokens=tokens, update_tokens=tokens,
                           update_entropy=entropy)
    phases = {name: _terms_total(terms, tokens) for name, terms in update_activation_phases(shape, settings).items()}
    layer = tokens * layer_backward_bytes_per_token(shape, BF16)
    return {"scale": scale, "tokens": tokens, "accounted_bytes": accounted, "resident_bytes": resident,
            "workspace_bytes": workspace, "ratio": accounted / (resident - workspace),
            "model_bytes": max(phases.values()),
            "summed_bytes": max(phases["LM head backward"], phases["logits backward"]) + layer}


# ------------------------------------------------------------------------------------------------
# one layer, resident memory
# ------------------------------------------------------------------------------------------------


def scaled_shape(scale: int) -> ModelShape:
    """The 8B's shape at 1/``scale`` width: heads (and key-value heads) divided, head size kept."""
    s = QWEN3_8B
    return ModelShape(hidden_size=s.hidden_size // scale, num_layers=1, num_heads=s.num_heads // scale,
                         num_kv_heads=max(1, s.num_kv_heads // scale), head_dim=s.head_dim,
                         intermediate_size=s.intermediate_size // scale, vocab_size=1024,
                         tie_word_embeddings=True, qk_norm=True, source=f"Qwen3-8B at 1/{scale} width")


def measure_layer(scale: int, token_counts: list[int], seed: int = 0) -> dict:
    """Peak resident bytes of one layer's forward with grad and backward at each token count, the
    slope per token, and that slope scaled to the full width."""
    from transformers import Qwen3Config  # transformers where a subcommand builds a model
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    _mmap_large_allocations()
    AttentionInterface.register(ATTENTION, flash_attention_forward)
    shape = scaled_shape(scale)
    config = Qwen3Config(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, num_hidden_layers=1, vocab_size=shape.vocab_size)
    config._attn_implementation = ATTENTION
    torch.manual_seed(seed)
    layer = Qwen3DecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    rotary = Qwen3RotaryEmbedding(config)
    peaks = {}
    for tokens in [min(token_counts)] + list(token_counts):  # the first run warms up lazy allocations
        hidden = torch.randn(1, tokens, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(tokens).unsqueeze(0)
        cos, sin = rotary(hidden, positions)
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
        layer.zero_grad(set_to_none=True)

        def step():
            out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))

        # parameter gradients exist from the second call on (kept, not per token)
        step()
        layer.zero_grad(set_to_none=False)
        hidden.grad = None
        peaks[tokens] = peak_extra_bytes(step, "cpu")
        hidden.grad = None
    counts = sorted(token_counts)
    slope = (peaks[counts[-1]] - peaks[counts[0]]) / (counts[-1] - counts[0])
    full = slope * scale
    model = layer_backward_bytes_per_token(QWEN3_8B, BF16)
    return {"scale": scale, "tokens": counts, "peak_bytes": [peaks[t] for t in counts],
            "bytes_per_token_scaled": slope, "bytes_per_token_8b": full, "model_bytes_per_token_8b": model,
            "ratio": full / model}


def measure_logits_grad(tokens: int, vocab: int, seed: int = 0) -> dict:
    """Peak bytes of the log-probs' backward beyond the forward (the logits' gradient and the
    fallback's temporaries), against the model's gradient term."""
    import verl_patches.activate  # the recipe's patches, as in every verl process  # noqa: F401
    from verl.utils import torch_functional as verl_F

    _mmap_large_allocations()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=torch.bfloat16).normal_(0.0, 3.0, generator=gen).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    log_probs = verl_F.logprobs_from_logits(logits, labels, inplace_backward=False)
    measured = peak_extra_bytes(lambda: log_probs.sum().backward(), "cpu")
    model = logits_bytes(tokens, vocab, BF16)
    return {"tokens": tokens, "vocab": vocab, "measured_bytes": measured, "model_bytes": model,
            "ratio": measured / model, "grad_dtype": str(logits.grad.dtype)}


# ------------------------------------------------------------------------------------------------
# FSDP1's root unit
# ------------------------------------------------------------------------------------------------


def _fsdp_root_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist  # FSDP in the fsdp-root subcommand's workers only
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    fsdp = FSDP(_TinyLM(), auto_wrap_policy=ModuleWrapPolicy({_Layer}), device_id=torch.device("cpu"),
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))

    def unsharded(unit) -> int:
        return unit._handle._get_padded_unsharded_flat_param().untyped_storage().size()

    with torch.no_grad():
        fsdp(torch.randint(0, _TinyLM.VOCAB, (2, 8)))
    layers = [unsharded(m) for m in fsdp.modules() if isinstance(m, FSDP) and m is not fsdp]
    root = unsharded(fsdp)
    fsdp._handle.reshard(True)  # what verl's eval context does when fsdp_size > 1
    after = unsharded(fsdp)
    if rank == 0:
        atomic_write(out, json.dumps({"root_unsharded_bytes": root, "layer_unsharded_bytes": layers,
                                      "root_after_reshard_bytes": after, "root_params": _TinyLM.root_params(),
                                      "world_size": world}))
    dist.destroy_process_group()


class _Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)


class _TinyLM(torch.nn.Module):
    """Embedding, two decoder stand-ins (each its own FSDP unit), final norm, untied LM head."""

    VOCAB, WIDTH = 1000, 64

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(self.VOCAB, self.WIDTH)
        self.layers = torch.nn.ModuleList([_Layer(self.WIDTH), _Layer(self.WIDTH)])
        self.norm = torch.nn.LayerNorm(self.WIDTH, bias=False)
        self.head = torch.nn.Linear(self.WIDTH, self.VOCAB, bias=False)

    @classmethod
    def root_params(cls) -> int:
        return 2 * cls.VOCAB * cls.WIDTH + cls.WIDTH

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def measure_fsdp_root(port: int = 29533) -> dict:
    import torch.multiprocessing as mp  # only the fsdp-root subcommand spawns processes

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "root.json")
        mp.spawn(_fsdp_root_worker, args=(2, port, out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def _print_rows(rows: list[dict]) -> None:
    print("| phase | traced GiB | model GiB | model / traced |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['traced_bytes'] / GIB:.2f} | {r['model_bytes'] / GIB:.2f} | {r['ratio']:.3f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stapo_memory.bench_layer_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("pass", "accounting", "layer", "logits-grad", "fsdp-root"))
    p.add_argument("--model", default="qwen3-8b", choices=sorted(BUILTIN_SHAPES), help="pass: the model's shape")
    p.add_argument("--forward", action="store_true", help="pass: a no-grad micro-batch (else an update's)")
    p.add_argument("--entropy", action="store_true", help="pass: the entropy (update: without grad; forward: chunked)")
    p.add_argument("--entropy-grad", action="store_true", help="pass: the update's entropy with grad (a bonus)")
    p.add_argument("--no-sum-pi-squared", action="store_true", help="pass --forward: without the sum of squares")
    p.add_argument("--scale", type=int, default=8)
    p.add_argument("--tokens", default="2048,4096")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--vocab", type=int, default=151936, help="logits-grad: the vocabulary")
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.what == "pass":
        result = compare(BUILTIN_SHAPES[args.model], tokens[0], forward=args.forward,
                         entropy=args.entropy or args.entropy_grad, entropy_grad=args.entropy_grad,
                         sum_pi_squared=not args.no_sum_pi_squared)
        _print_rows(result)
    elif args.what == "accounting":
        result = measure_accounting(args.scale, tokens[0], entropy=args.entropy)
        print(json.dumps(result, indent=1))
    elif args.what == "layer":
        result = measure_layer(args.scale, tokens)
        print(json.dumps(result, indent=1))
    elif args.what == "logits-grad":
        result = measure_logits_grad(tokens[0], args.vocab)
        print(json.dumps(result, indent=1))
    else:
        result = measure_fsdp_root(args.port)
        print(json.dumps(result, indent=1))
    if args.json:
        atomic_write(args.json, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
