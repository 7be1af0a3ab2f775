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
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"{func}: advantages must be a tensor, got {type(advantages).__name__}")
    batch, resp_len = mask.shape
    if advantages.shape == (batch,):
        advantages = advantages.reshape(batch, 1).expand(batch, resp_len)
    elif advantages.shape != mask.shape:
        raise ValueError(
            f"{func}: shape mismatch: advantages has shape {tuple(advantages.shape)}, expected "
            f"{(batch, resp_len)} (like {mask_name}) or {(batch,)}"
        )
    if advantages.device != mask.device:
        raise ValueError(f"{func}: advantages is on {advantages.device}, {mask_name} on {mask.device}")
    return advantages


def raise_if_nonfinite(func: str, counts: dict) -> None:
    """ValueError listing every tensor with non-finite values inside the response mask
    (``counts``: ``{tensor name: number of non-finite values}``)."""
    bad = {name: int(n) for name, n in counts.items() if n}
    if bad:
        listing = ", ".join(f"{name} ({n} value(s))" for name, n in bad.items())
        raise ValueError(f"{func}: non-finite values inside response_mask in {listing}")
