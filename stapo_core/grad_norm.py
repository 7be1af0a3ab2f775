"""Entropy and the logit-gradient norm of log pi_k, with the STAPO paper's bounds (Section 3).

For logits a over a vocabulary V, pi = softmax(a), target token k and weight w = r A:

    d log pi_k / d a_n = [n == k] - pi_n
    ||d (w log pi_k) / d a||^2 = w^2 (1 - 2 pi_k + sum_n pi_n^2)                        (exact)
    w^2 (1 - 2 pi_k + exp(-H)) <= ||.||^2 <= w^2 (2 - 2 pi_k - C_V H^2),
    C_V = (|V| - 1) / (|V| (ln |V|)^2),  H = -sum_n pi_n ln pi_n (nats).

Both per-position functions work on ``(..., V)`` logits chunked over the flattened leading
positions (``chunk_size`` rows at a time, each chunk upcast to float32 on its own), so a
151,936-token vocabulary over thousands of positions fits in memory.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def _check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} is invalid: expected None or a positive integer")


def _check_logits(func: str, logits) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] < 1:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{func}: logits must be a (..., V) tensor with V >= 1, got {got}")
    if not logits.is_floating_point():
        raise ValueError(f"{func}: logits must be floating point, got {logits.dtype}")


def _chunked_rows(fn: Callable, rows: list, chunk_size: Optional[int]) -> torch.Tensor:
    """``fn`` applied to consecutive row chunks of the 2-D tensors ``rows`` (same first dim), concatenated."""
    n = rows[0].shape[0]
    step = n if chunk_size is None else chunk_size
    if n == 0:
        return fn(*rows)
    return torch.cat([fn(*(r[start : start + step] for r in rows)) for start in range(0, n, step)])


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """(P, V) any float -> (P,) float32: H = logsumexp(a) - sum softmax(a) a.

    Computed on ``a - max(a)``, where both ``logsumexp`` and ``-sum softmax(a) a`` are non-negative,
    so the two terms add instead of cancelling (float32 stays accurate for peaked distributions over
    large vocabularies). ``-inf`` logits (tokens masked out of the vocabulary) have pi = 0 and
    contribute 0 to the sum (instead of 0 * -inf = NaN), in the value and in the gradient.
    """
    a = logits.float()
    a = a - a.max(-1, keepdim=True).values.detach()  # H is shift-invariant; the shift carries no gradient
    a_finite = torch.where(torch.isneginf(a), torch.zeros_like(a), a)
    return torch.logsumexp(a, -1) - (torch.softmax(a, -1) * a_finite).sum(-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits) over the last dim.

    Args:
        logits: ``(..., V)`` float (any float dtype; upcast to float32 chunk by chunk).
        chunk_size: positions (flattened leading rows) per chunk, or None for all at once.

    Returns:
        ``(...)`` float32, H = logsumexp(a) - sum_n softmax(a)_n a_n (differentiable).
    """
    _check_logits("entropy_from_logits", logits)
    _check_chunk_size(chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    return _chunked_rows(_entropy_rows, [flat], chunk_size).reshape(logits.shape[:-1])


def _grad_norm_rows(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(P, V), (P, 1) long -> (P,) float32 sqrt(1 - 2 pi_k + sum pi^2).

    Written as (sum_{n!=k} pi_n)^2 + sum_{n!=k} pi_n^2 (the same quantity, since 1 - pi_k =
    sum_{n!=k} pi_n) to avoid cancellation when pi_k is close to 1.
    """
    p = torch.softmax(logits.float(), -1)
    others = p.scatter(-1, target, 0.0)  # pi with the target entry zeroed
    squared = others.sum(-1) ** 2 + (others * others).sum(-1)
    return torch.sqrt(squared.clamp(min=0.0))


def logit_grad_norm(logits: torch.Tensor, target: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """||d log pi_k / d a||_2 = sqrt(1 - 2 pi_k + sum_n pi_n^2), per position.

    Args:
        logits: ``(..., V)`` float (upcast to float32 chunk by chunk).
        target: ``(...)`` integer token ids in [0, V).
        chunk_size: positions per chunk, or None.

    Returns:
        ``(...)`` float32. Multiply by |w| for the norm of d(w log pi_k)/da.

    Raises:
        ValueError: shape mismatch, non-integer ``target`` or ids outside [0, V) (one host read).
    """
    _check_logits("logit_grad_norm", logits)
    _check_chunk_size(chunk_size)
    if not isinstance(target, torch.Tensor) or target.shape != logits.shape[:-1]:
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(
            f"logit_grad_norm: target must have shape {tuple(logits.shape[:-1])} (logits without V), got {got}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"logit_grad_norm: target must hold integer token ids, got {target.dtype}")
    vocab = logits.shape[-1]
    if target.numel() and bool(((target < 0) | (target >= vocab)).any()):
        raise ValueError(f"logit_grad_norm: target holds token ids outside [0, {vocab})")
    flat = logits.reshape(-1, vocab)
    ids = target.reshape(-1, 1).long()
    return _chunked_rows(_grad_norm_rows, [flat, ids], chunk_size).reshape(target.shape)


def grad_norm_bounds(entropy: torch.Tensor, prob: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on the SQUARED logit-gradient norm per unit weight, ||d log pi_k / d a||^2.

        lower = 1 - 2 p_k + exp(-H)
        upper = 2 - 2 p_k - C_V H^2,   C_V = (|V| - 1) / (|V| (ln |V|)^2)

    Args:
        entropy: ``(...)`` float, H in nats, 0 <= H <= ln |V|.
        prob: ``(...)`` float, p_k = pi(target), broadcastable with ``entropy``.
        vocab_size: |V| >= 2.

    Returns:
        ``(lower, upper)``, float32 tensors of the broadcast shape. Multiply by w^2 for weight w.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid: expected an integer >= 2")
    h = torch.as_tensor(entropy).float()
    p = torch.as_tensor(prob).float()
    c_v = (vocab_size - 1) / (vocab_size * math.log(vocab_size) ** 2)
    lower = 1.0 - 2.0 * p + torch.exp(-h)
    upper = 2.0 - 2.0 * p - c_v * h * h
    return lower, upper


__all__ = ["entropy_from_logits", "grad_norm_bounds", "logit_grad_norm"]
