"""Argument checks shared by stapo_core's functions; :func:`is_number` also by the layers above.

Every check raises ``ValueError`` whose message starts with the calling function's name (``func``)
and names the argument at fault.
"""

from __future__ import annotations

import math

import torch


def is_number(x) -> bool:
    """A finite int or float (not a bool): what every numeric setting of the recipe must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_fraction(name: str, value, *, include_one: bool = False) -> float:
    """``value`` as a float if it lies in (0, 1) (or (0, 1] with ``include_one``), else ValueError
    naming ``name``."""
    if not is_number(value) or not (value > 0.0 and (value <= 1.0 if include_one else value < 1.0)):
        interval = "(0, 1]" if include_one else "(0, 1)"
        raise ValueError(f"{name}={value!r} is invalid: expected a number in {interval}")
    return float(value)


def check_token_tensors(func: str, mask, mask_name: str = "response_mask", **tensors) -> None:
    """``mask`` must be a 2-D ``(batch, resp_len)`` tensor and each of ``tensors`` a tensor of its
    shape on its device; the messages call the mask ``mask_name`` and each tensor by its keyword."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{func}: {mask_name} must be a (batch, resp_len) tensor, got {got}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{func}: {name} must be a tensor, got {type(t).__name__}")
        if t.shape != mask.shape:
            raise ValueError(
                f"{func}: shape mismatch: {name} has shape {tuple(t.shape)}, "
                f"{mask_name} has shape {tuple(mask.shape)}"
            )
        if t.device != mask.device:
            raise ValueError(f"{func}: {name} is on {t.device}, {mask_name} on {mask.device}")


def token_advantages(func: str, advantages, mask: torch.Tensor, mask_name: str = "response_mask") -> torch.Tensor:
    """Advantages per token, ``(batch, resp_len)`` like the (already checked) ``mask``: a ``(batch,)``
    tensor, one advantage per response, becomes an expanded view (no copy); dtype unchanged."""
    batch, resp_len = mask.shape
    if isinstance(advantages, torch.Tensor) and advantages.shape == (batch,):
        advantages = advantages.reshape(batch, 1).expand(batch, resp_len)
    check_token_tensors(func, mask, mask_name, advantages=advantages)
    return advantages


def raise_if_nonfinite(func: str, counts: dict) -> None:
    """ValueError listing every tensor with non-finite values inside the response mask
    (``counts``: ``{tensor name: number of non-finite values}``)."""
    bad = {name: int(n) for name, n in counts.items() if n}
    if bad:
        listing = ", ".join(f"{name} ({n} value(s))" for name, n in bad.items())
        raise ValueError(f"{func}: non-finite values inside response_mask in {listing}")


def rounding_tolerance(dtype: torch.dtype) -> float:
    """How far float rounding alone can put a log-probability above 0 or an entropy below 0, for values
    of ``dtype``: 1e-3, or 16 machine epsilons of a coarser type (bfloat16: 0.125, float16: 0.0156).
    A value beyond it is not rounding but the wrong quantity (probabilities for log-probabilities,
    a negated entropy)."""
    return max(1e-3, 16 * torch.finfo(dtype).eps)


def raise_if_not_log_probs(func: str, positive: int, negative: int, above_one: int, tolerance: float) -> None:
    """ValueError when ``log_prob`` holds values above ``tolerance`` inside the response mask
    (``positive`` of them; ``negative``: values < 0; ``above_one``: values > 1 + ``tolerance``): a
    log-probability is <= 0. Values in [0, 1] with none negative are the probability mistake, named as
    such (S2T would find no candidate, p = exp(p) >= 1 > tau_p, and silence nothing)."""
    if not positive:
        return
    if not negative and not above_one:
        reason = ("every value lies in [0, 1] and none is negative: these are probabilities p, not log p (S2T's "
                  "test exp(log_prob) < tau_p would find no candidate); pass their log, torch.log(p), or the "
                  "log-probabilities themselves")
    else:
        reason = ("a log-probability is <= 0; pass log pi(y_t), the log-softmax of the logits at the sampled "
                  "tokens")
    raise ValueError(f"{func}: log_prob has {positive} value(s) above {tolerance:g} inside response_mask: {reason}")


def raise_if_negative_entropy(func: str, negative: int, tolerance: float) -> None:
    """ValueError when ``entropy`` holds ``negative`` values below ``-tolerance`` inside the response
    mask: an entropy is >= 0, beyond float rounding."""
    if negative:
        raise ValueError(f"{func}: entropy has {negative} value(s) below -{tolerance:g} inside response_mask: an "
                         "entropy H = -sum_v p_v log p_v is >= 0 (beyond float rounding); pass the entropy of each "
                         "position's next-token distribution in nats, not its negative or a log-probability")
