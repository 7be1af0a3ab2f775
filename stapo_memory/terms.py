"""The memory model's terms: the fixed overhead per GPU and the bytes one micro-batch's computations
allocate, as functions of the model's shape and the token count, each following the code that
allocates them (docs/memory.md writes each out): the logits side (checked against a measurement:
``python -m stapo_memory.bench_logits_memory``) and the activations per token (checked against a
trace of the real model code: ``python -m stapo_memory.bench_layer_memory``)."""

from __future__ import annotations

from typing import Optional

from .shape import ModelShape

GIB = 1024**3
#: bytes of the dtypes involved
FP32, BF16 = 4, 2
#: per GPU, outside PyTorch's allocator: CUDA contexts, NCCL, vLLM's residue asleep; the model's largest
#: unmeasured term (docs/memory.md gives its public range and the calibration run that pins it)
OVERHEAD_BYTES = 4.5 * GIB
#: the chunk (rows of logits) of the recipe's sum of squared probabilities: a copy of
#: ``verl_patches.sum_pi_squared.CHUNK_ROWS`` (no torch import here; a test ties the two)
SUM_PI_SQUARED_CHUNK_ROWS = 2048
#: the chunk of verl's ``entropy_from_logits_with_chunking``: a copy of its ``chunk_size`` default and of
#: ``actor.entropy_from_logits_chunk_size``'s (a test ties them)
ENTROPY_CHUNK_ROWS = 2048


def logits_bytes(tokens: int, vocab: int, dtype_bytes: int = BF16) -> float:
    """The logits of ``tokens`` positions: ``tokens x vocab`` in the compute dtype."""
    return float(tokens) * vocab * dtype_bytes


def sum_pi_squared_extra_bytes(tokens: int, vocab: int, logits_dtype_bytes: int = BF16,
                               chunk: Optional[int] = None) -> float:
    """Peak bytes ``sum_n pi_n^2`` allocates beside the logits: verl's unchunked computation
    ``tokens x vocab x (b + 4 + 4)`` for logits of ``b`` bytes (float32 logits need no cast), the
    recipe's chunked one ``12 x chunk x vocab`` (docs/memory.md)."""
    if chunk is not None:
        return 3.0 * FP32 * min(chunk, tokens) * vocab
    cast = FP32 if logits_dtype_bytes < FP32 else 0  # CUDA autocast's float32 copy
    return float(tokens) * vocab * (logits_dtype_bytes + cast + FP32)


def entropy_extra_bytes(tokens: int, vocab: int, chunk: Optional[int] = 2048) -> float:
    """Peak bytes verl's entropy allocates beside the logits, without autograd: ``12 x rows x vocab``
    (rows: the chunk, or every token unchunked; docs/memory.md); an upper bound under ``torch.compile``."""
    rows = tokens if chunk is None else min(chunk, tokens)
    return 3.0 * FP32 * rows * vocab


def entropy_with_grad_bytes(tokens: int, vocab: int, chunk: Optional[int] = 2048, backward: bool = False) -> float:
    """What verl's chunked entropy with grad (an entropy bonus) holds: ``8 x tokens x vocab`` kept for the
    backward, plus one chunk's float32 product (forward) or two of its gradients (``backward``)."""
    rows = tokens if chunk is None else min(chunk, tokens)
    return 2.0 * FP32 * tokens * vocab + (2 if backward else 1) * FP32 * rows * vocab


#: float32 temporaries of an RMSNorm's backward (``Qwen3RMSNorm.forward`` differentiated), each of its
#: width: the gradient cast to float32, the two products' gradients, the mean's and the square's
NORM_BACKWARD_TEMPORARIES = 5


def norm_saved_bytes(width: int, b: int) -> float:
    """An RMSNorm with grad (``Qwen3RMSNorm.forward``) keeps the float32 copy of its input and the
    normalised tensor in the input dtype: ``(4 + b) x width``."""
    return (FP32 + b) * width


def layer_inputs_bytes_per_token(shape: ModelShape, b: int) -> float:
    """What gradient checkpointing keeps through the whole backward: each decoder layer's input
    (``L x h x b``: the embedding's output and every layer's output but the last)."""
    return shape.num_layers * shape.hidden_size * b


def layer_saved_bytes_per_token(shape: ModelShape, b: int) -> tuple[float, float]:
    """(attention's, MLP's) tensors one recomputed decoder layer keeps for its backward, each listed
    in docs/memory.md."""
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    attention = norm_saved_bytes(h, b) + h * b
    if shape.qk_norm:
        attention += norm_saved_bytes(q, b) + norm_saved_bytes(kv, b)
    attention += b * (q + 2 * kv) + b * q + FP32 * shape.num_heads
    mlp = norm_saved_bytes(h, b) + h * b + 4 * b * i
    return attention, mlp


def layer_backward_bytes_per_token(shape: ModelShape, b: int) -> float:
    """One recomputed layer's peak in its backward, per token: what it saved plus the gradients alive
    at the largest of three moments: the MLP's backward (the peak for Qwen3), the second norm's and
    the attention's (docs/memory.md)."""
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    attention, mlp = layer_saved_bytes_per_token(shape, b)
    in_mlp = attention + mlp + h * b + 2 * b * i
    in_norm = attention + FP32 * h + h * b + NORM_BACKWARD_TEMPORARIES * FP32 * h
    flash_backward = b * (q + 2 * kv) + FP32 * q + FP32 * shape.num_heads
    if shape.num_kv_heads != shape.num_heads:
        flash_backward += 2 * b * q
    in_attention = attention + h * b + b * q + flash_backward
    return float(max(in_mlp, in_norm, in_attention))


def layer_forward_bytes_per_token(shape: ModelShape, b: int) -> float:
    """A decoder layer's tensors while it runs without keeping any (no grad, or the first forward of a
    checkpointed layer), beside its input: the larger of the MLP's moment and the attention's
    (docs/memory.md)."""
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    rotary = 2 * b * shape.head_dim
    mlp = 2 * h * b + 3 * i * b
    attention = h * b + (b + 2 * FP32) * q + 2 * kv * b
    return float(max(mlp, attention) + rotary)


def no_grad_layer_bytes_per_token(shape: ModelShape, b: int) -> float:
    """A decoder layer without grad, per token: its working set (:func:`layer_forward_bytes_per_token`)
    beside the layer's input and the embedding's output (``Qwen3Model.forward`` keeps
    ``inputs_embeds`` until it returns)."""
    return layer_forward_bytes_per_token(shape, b) + 2 * shape.hidden_size * b
