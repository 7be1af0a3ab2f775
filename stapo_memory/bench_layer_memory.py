"""The memory model's activation terms measured on CPU (``stapo_memory/terms.py``, docs/memory.md).

    python -m stapo_memory.bench_layer_memory pass --model qwen3-8b --tokens 32768             # an update micro-batch
    python -m stapo_memory.bench_layer_memory pass --model qwen3-8b --tokens 49152 --forward   # a log-prob micro-batch
    python -m stapo_memory.bench_layer_memory pass --model qwen3-8b --tokens 32768 --entropy   # update with the entropy
    python -m stapo_memory.bench_layer_memory accounting --scale 8 --tokens 2048   # the trace against the resident set
    python -m stapo_memory.bench_layer_memory layer --scale 8 --tokens 1024,3072   # one layer, resident set
    python -m stapo_memory.bench_layer_memory logits-grad    # the logits' gradient, 2048 x 151,936
    python -m stapo_memory.bench_layer_memory fsdp-root      # FSDP1 on gloo, two processes

``pass`` traces one micro-batch of verl's FSDP actor tensor by tensor on the meta device
(:class:`LiveTensors`: the full model at the full budget costs no memory) beside the memory model's
terms of the same moments; the other subcommands measure resident-set peaks on CPU. docs/memory.md
("Checked against the model code", "Checked against a measurement") says what each covers and its numbers.
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

from .bench_logits_memory import mmap_large_allocations, peak_extra_bytes
from .model import Estimate, Settings, forward_activation_phases, update_activation_phases
from .shape import BUILTIN_SHAPES, ModelShape
from .terms import BF16, ENTROPY_CHUNK_ROWS, GIB, layer_backward_bytes_per_token, logits_bytes

QWEN3_8B = BUILTIN_SHAPES["qwen3-8b"]


class LiveTensors(TorchDispatchMode):
    """Counts the bytes of every storage an operation returns (a view or an in-place result shares
    its input's and is not counted again) until the storage is freed, on any device (the meta device
    included). ``mark(phase)`` starts a phase; ``peaks``: each phase's largest live total."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.phase = "start"
        self.peaks: dict[str, int] = {}

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.peaks[phase] = max(self.current, self.peaks.get(phase, 0))

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._live or key in inputs:
                continue
            self._live[key] = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self.current += self._live[key]
            self.mark(self.phase)
        return out


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


def build_model(shape: ModelShape, device: str = "meta", train: bool = True, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16):
    """The transformers model of ``shape`` in ``dtype`` on ``device`` with the flash-attn stand-in;
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
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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
    """One update micro-batch of ``tokens``, as ``forward_step`` and ``forward_backward_batch`` run it
    (the entropy without grad as the recipe's patch computes it, or with grad for an entropy bonus).
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
        bonus = None
        if entropy and entropy_grad:
            bonus = verl_F.entropy_from_logits_with_chunking(logits, chunk_size=chunk).mean()
        elif entropy:
            with torch.no_grad():
                verl_F.entropy_from_logits_with_chunking(logits, chunk_size=chunk)
        log_probs, _ = FlashCrossEntropy.apply(logits, labels, not entropy)
        loss = (-log_probs).sum() / tokens
        return loss if bonus is None else loss - 0.001 * bonus

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


#: the model's phases (``stapo_memory.model``) and the traced phases that span the same moments
UPDATE_PHASES = {("layer forward", "forward end"): ("forward", "logits"),
                 ("logits backward", "LM head backward", "final norm backward"): ("LM head backward",),
                 ("layer backward", "embedding backward"): ("layer backward",)}
FORWARD_PHASES = {("layers", "LM head"): ("forward",), ("logits",): ("logits",)}


def _terms_total(terms, tokens: int) -> float:
    return sum(fixed + per_token * tokens for _, fixed, per_token in terms)


@functools.lru_cache(maxsize=None)
def _traced_peaks(shape: ModelShape, tokens: int, forward: bool, entropy: bool, entropy_grad: bool,
                  sum_pi_squared: bool, unit_temperature: bool, chunk: int) -> dict[str, int]:
    if forward:
        return dict(trace_forward(shape, tokens, entropy=entropy, sum_pi_squared=sum_pi_squared,
                                  unit_temperature=unit_temperature, chunk=chunk).peaks)
    return dict(trace_update(shape, tokens, entropy=entropy, entropy_grad=entropy_grad,
                             unit_temperature=unit_temperature, chunk=chunk).peaks)


def paired_phases(shape: ModelShape, s: Settings, tokens: int, *, forward: bool, entropy: bool = False,
                  sum_pi_squared: bool = False) -> tuple[dict[str, float], dict[tuple[str, ...], int]]:
    """One micro-batch of ``tokens`` (a no-grad pass with ``entropy`` and ``sum_pi_squared``, else an
    update as ``s`` sets it): the model's activation total of each of its phases, and for each group
    of them the trace's peak over the same moments."""
    if forward:
        model = forward_activation_phases(shape, s, tokens, entropy=entropy, sum_pi_squared=sum_pi_squared)
        groups = FORWARD_PHASES
    else:
        model = update_activation_phases(shape, s)
        entropy, sum_pi_squared, groups = s.update_entropy, False, UPDATE_PHASES
    traced = _traced_peaks(shape, tokens, forward, entropy, s.update_entropy_grad, sum_pi_squared,
                           s.unit_temperature, s.entropy_chunk)
    return ({phase: _terms_total(terms, tokens) for phase, terms in model.items()},
            {names: max(traced.get(n, 0) for n in traced_names) for names, traced_names in groups.items()})


def compare(shape: ModelShape, tokens: int, *, forward: bool = False, entropy: bool = False,
            entropy_grad: bool = False, sum_pi_squared: bool = True, unit_temperature: bool = True) -> list[dict]:
    """Rows ``phase, traced_bytes, model_bytes, ratio`` (model / trace) of one micro-batch."""
    settings = Settings(world_size=8, gpu_memory_utilization=0.5, log_prob_tokens=tokens, update_tokens=tokens,
                        update_entropy=entropy, update_entropy_grad=entropy_grad, unit_temperature=unit_temperature)
    model, traced = paired_phases(shape, settings, tokens, forward=forward, entropy=entropy,
                                  sum_pi_squared=sum_pi_squared)
    rows = []
    for names, peak in traced.items():
        total = max(model[n] for n in names)
        rows.append({"phase": " / ".join(names), "traced_bytes": peak, "model_bytes": total, "ratio": total / peak,
                     "model": shape.source, "tokens": tokens})
    return rows


def counted_totals(est: Estimate) -> dict[str, float]:
    """Each pass of ``est`` as counted with the traced activations: per phase, the trace's peak of the
    same moments in place of the model's activation terms, beside the model's other components. Passes
    without token-dependent activations (rollout, update end, optimizer step) are the model's own count."""
    s = est.settings
    if s.entropy_chunk is None or (s.calculate_sum_pi_squared and s.sum_pi_squared_chunk is None):
        raise ValueError("the trace covers the chunked entropy and sum of squares only")
    out = {}
    for p in est.passes:
        if not p.phases:
            out[p.name] = p.total
            continue
        model, traced = paired_phases(est.shape, s, p.tokens, forward=p.name != "update",
                                      entropy=p.name in ("log_prob", "current"),
                                      sum_pi_squared=p.name == "log_prob" and s.calculate_sum_pi_squared)
        counted = []
        for phase, total in p.phases.items():
            group = next((g for g in traced if phase in g), None)
            # a phase of FSDP's buffers only (a layer's gradient reduce-scatter) is the model's own count
            counted.append(total if group is None else total - model[phase] + traced[group])
        out[p.name] = max(counted)
    return out


def lm_head_workspace_bytes(shape: ModelShape, dtype: torch.dtype, tokens: int = 256) -> float:
    """Resident bytes the LM head's matmuls in ``dtype`` take beyond their inputs, output and gradients:
    the kernels' workspace, which no tensor holds and the trace cannot see (docs/memory.md)."""
    x = torch.randn(tokens, shape.hidden_size, dtype=dtype, requires_grad=True)
    weight = torch.randn(shape.vocab_size, shape.hidden_size, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, shape.vocab_size, dtype=dtype)

    def forward_backward():
        torch.nn.functional.linear(x, weight).backward(grad)
        x.grad = weight.grad = None

    forward_backward()  # warm-up: lazy allocations
    tensors = (grad.numel() + x.numel() + weight.numel()) * grad.element_size()  # the output, the inputs' gradients
    return max(0.0, peak_extra_bytes(forward_backward, "cpu") - tensors)


def measure_accounting(scale: int, tokens: int, entropy: bool = False, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The update trace on real CPU tensors in ``dtype`` of the 8B's shape at 1/``scale`` width (4
    layers): the accounted peak against the resident-set peak less :func:`lm_head_workspace_bytes`,
    beside the model's update and (``summed_bytes``) the LM head's moment plus the layer's recompute."""
    mmap_large_allocations()
    shape = replace(scaled_shape(scale), num_layers=4, vocab_size=QWEN3_8B.vocab_size // scale)
    model = build_model(shape, "cpu", dtype=dtype)
    # warm-up at the same size: the kernels' lazy allocations, some sized by their inputs
    trace_update(shape, tokens, entropy=entropy, device="cpu", model=model)
    result = {}

    def run():
        result["live"] = trace_update(shape, tokens, entropy=entropy, device="cpu", model=model)

    resident = peak_extra_bytes(run, "cpu")
    workspace = lm_head_workspace_bytes(shape, dtype)
    accounted = max(result["live"].peaks.values())
    b = dtype.itemsize
    settings = Settings(world_size=8, gpu_memory_utilization=0.5, log_prob_tokens=tokens, update_tokens=tokens,
                        update_entropy=entropy, compute_bytes=b)
    phases = {name: _terms_total(terms, tokens) for name, terms in update_activation_phases(shape, settings).items()}
    layer = tokens * layer_backward_bytes_per_token(shape, b)
    return {"scale": scale, "tokens": tokens, "dtype": str(dtype).replace("torch.", ""),
            "accounted_bytes": accounted, "resident_bytes": resident,
            "workspace_bytes": workspace, "ratio": accounted / (resident - workspace),
            "model_bytes": max(phases.values()),
            "summed_bytes": max(phases["LM head backward"], phases["logits backward"]) + layer}


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
    mmap_large_allocations()
    shape = scaled_shape(scale)
    model = build_model(shape, "cpu", train=False, seed=seed)
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    peaks = {}
    for tokens in [min(token_counts)] + list(token_counts):  # the first run warms up lazy allocations
        hidden = torch.randn(1, tokens, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(tokens).unsqueeze(0)
        cos, sin = rotary(hidden, positions)
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
    modelled = layer_backward_bytes_per_token(QWEN3_8B, BF16)
    return {"scale": scale, "tokens": counts, "peak_bytes": [peaks[t] for t in counts],
            "bytes_per_token_scaled": slope, "bytes_per_token_8b": full, "model_bytes_per_token_8b": modelled,
            "ratio": full / modelled}


def measure_logits_grad(tokens: int, vocab: int, seed: int = 0) -> dict:
    """Peak bytes of the log-probs' backward beyond the forward (the logits' gradient and the
    fallback's temporaries), against the model's gradient term."""
    import verl_patches.activate  # the recipe's patches, as in every verl process  # noqa: F401
    from verl.utils import torch_functional as verl_F

    mmap_large_allocations()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=torch.bfloat16).normal_(0.0, 3.0, generator=gen).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    log_probs = verl_F.logprobs_from_logits(logits, labels, inplace_backward=False)
    measured = peak_extra_bytes(lambda: log_probs.sum().backward(), "cpu")
    model = logits_bytes(tokens, vocab, BF16)
    return {"tokens": tokens, "vocab": vocab, "measured_bytes": measured, "model_bytes": model,
            "ratio": measured / model, "grad_dtype": str(logits.grad.dtype)}


#: the fsdp-root model's vocabulary and width
TINY_VOCAB, TINY_WIDTH = 1000, 64


def _fsdp_root_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist  # FSDP in the fsdp-root subcommand's workers only
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    # embedding, two decoder stand-ins (each its own FSDP unit), final norm, untied LM head
    layers = [torch.nn.Linear(TINY_WIDTH, TINY_WIDTH) for _ in range(2)]
    model = torch.nn.Sequential(torch.nn.Embedding(TINY_VOCAB, TINY_WIDTH), *layers, torch.nn.LayerNorm(
        TINY_WIDTH, bias=False), torch.nn.Linear(TINY_WIDTH, TINY_VOCAB, bias=False))
    fsdp = FSDP(model, auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m in layers),
                device_id=torch.device("cpu"), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))

    def unsharded(unit) -> int:
        return unit._handle._get_padded_unsharded_flat_param().untyped_storage().size()

    with torch.no_grad():
        fsdp(torch.randint(0, TINY_VOCAB, (2, 8)))
    units = [unsharded(m) for m in fsdp.modules() if isinstance(m, FSDP) and m is not fsdp]
    root = unsharded(fsdp)
    fsdp._handle.reshard(True)  # what verl's eval context does when fsdp_size > 1
    if rank == 0:
        atomic_write(out, json.dumps({"root_unsharded_bytes": root, "layer_unsharded_bytes": units,
                                      "root_after_reshard_bytes": unsharded(fsdp),
                                      "root_params": 2 * TINY_VOCAB * TINY_WIDTH + TINY_WIDTH, "world_size": world}))
    dist.destroy_process_group()


def measure_fsdp_root(port: int = 29533) -> dict:
    import torch.multiprocessing as mp  # only the fsdp-root subcommand spawns processes

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "root.json")
        mp.spawn(_fsdp_root_worker, args=(2, port, out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stapo_memory.bench_layer_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("pass", "accounting", "layer", "logits-grad", "fsdp-root"))
    p.add_argument("--model", default="qwen3-8b", choices=sorted(BUILTIN_SHAPES), help="pass: the model's shape")
    p.add_argument("--forward", action="store_true", help="pass: a no-grad micro-batch (else an update's)")
    p.add_argument("--entropy", action="store_true", help="pass: the entropy (update: without grad; forward: chunked)")
    p.add_argument("--entropy-grad", action="store_true", help="pass: the update's entropy with grad (a bonus)")
    p.add_argument("--no-sum-pi-squared", action="store_true", help="pass --forward: without the sum of squares")
    p.add_argument("--scale", type=int, default=8)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="accounting: the model's dtype")
    p.add_argument("--tokens", default="2048,4096")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--vocab", type=int, default=151936, help="logits-grad: the vocabulary")
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tokens = [int(t) for t in args.tokens.split(",")]
    measure = {"pass": lambda: compare(BUILTIN_SHAPES[args.model], tokens[0], forward=args.forward,
                                       entropy=args.entropy or args.entropy_grad, entropy_grad=args.entropy_grad,
                                       sum_pi_squared=not args.no_sum_pi_squared),
               "accounting": lambda: measure_accounting(args.scale, tokens[0], entropy=args.entropy,
                                                        dtype=getattr(torch, args.dtype)),
               "layer": lambda: measure_layer(args.scale, tokens),
               "logits-grad": lambda: measure_logits_grad(tokens[0], args.vocab),
               "fsdp-root": lambda: measure_fsdp_root(args.port)}
    result = measure[args.what]()
    if args.what == "pass":
        print("| phase | traced GiB | model GiB | model / traced |\n|---|---|---|---|")
        for r in result:
            print(f"| {r['phase']} | {r['traced_bytes'] / GIB:.2f} | {r['model_bytes'] / GIB:.2f} | {r['ratio']:.3f} |")
    else:
        print(json.dumps(result, indent=1))
    if args.json:
        atomic_write(args.json, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
