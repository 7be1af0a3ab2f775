"""The sum of squared probabilities ``sum_n pi_n^2`` per position, in chunks of rows.

verl 0.9.1 computes it (``actor.calculate_sum_pi_squared=true``, for the closed-form gradient-norm
metrics ``actor/s2t/grad_norm_*``) as ``exp(logsumexp(2 x) - 2 logsumexp(x))`` over a micro-batch's whole
``(tokens, vocab)`` logits at once, and under CUDA autocast each ``logsumexp`` makes float32 copies of
its input: about 75 GB beside the logits at the log-prob pass's 49,152-token budget and Qwen3's
151,936-token vocabulary (docs/memory.md). :func:`sum_pi_squared_chunked` computes the same formula
``CHUNK_ROWS`` rows at a time in float32 (also more exactly than verl's bfloat16 ``2 x``), with a peak
of about ``12 x CHUNK_ROWS x vocab`` bytes whatever the number of tokens.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

#: rows of logits per chunk (as verl's default entropy chunk: the two share the pass's peak)
CHUNK_ROWS = 2048


def _sum_pi_squared_rows(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return torch.exp(torch.logsumexp(2.0 * x, dim=-1) - 2.0 * torch.logsumexp(x, dim=-1))


def sum_pi_squared_chunked(logits: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``sum_n softmax(logits)_n^2``, ``chunk_rows`` rows of logits at a time; with autograd (verl's
    log-prob pass runs without) each chunk is recomputed in the backward instead of kept.

    Args:
        logits: ``(..., vocab)``, any float dtype. chunk_rows: rows per chunk (>= 1).

    Returns:
        float32 ``(...)``.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    flat = logits.reshape(-1, logits.shape[-1])
    grad = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, flat.shape[0], chunk_rows):
        rows = flat[start:start + chunk_rows]
        pieces.append(checkpoint(_sum_pi_squared_rows, rows, use_reentrant=False) if grad
                      else _sum_pi_squared_rows(rows))
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def wrap_calculate_sum_pi_squared(original):
    """verl's ``calculate_sum_pi_squared_from_logits`` replaced by :func:`sum_pi_squared_chunked`
    (same signature and result, in float32; ``original`` is kept by the patch table)."""

    @functools.wraps(original)
    def calculate_sum_pi_squared_from_logits(logits: torch.Tensor):
        return sum_pi_squared_chunked(logits)

    return calculate_sum_pi_squared_from_logits
