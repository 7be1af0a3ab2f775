"""verl's per-token fields, the recipe's names for those it adds, and verl's two layouts: padded
``(batch, resp_len)`` (legacy trainer) and jagged nested tensors (TransferQueue trainer). The recipe
computes on padded tensors and writes back in the field's own layout."""

from __future__ import annotations

from typing import Optional

import torch

#: the batch field that carries the rollout-time (old-policy) entropy to the actor (verl's own name
#: in the TransferQueue trainer; the legacy trainer's copy gets the same name)
ROLLOUT_ENTROPY_FIELD = "entropy"
#: verl's field of sum_n pi_n^2 per token (rollout time, with actor.calculate_sum_pi_squared=true)
SUM_PI_SQUARED_FIELD = "sum_pi_squared"
#: the recipe's field holding the response mask before the fold, for losses whose sequence-level ratio
#: is taken over every response token (``sequence_ratio=all_tokens``)
UNSELECTED_MASK_FIELD = "stapo_unselected_response_mask"


def to_padded(t: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
    """``(batch, resp_len)``, zero-padded to at least ``width`` when ``t`` is jagged."""
    if not t.is_nested:
        return t
    padded = t.to_padded_tensor(0.0)
    if width is not None and padded.shape[1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[1]))
    return padded


def padded_float(t: torch.Tensor, width: int, device=None) -> torch.Tensor:
    """float32 ``(batch, width)``: ``t`` padded (:func:`to_padded`) and cut to ``width``, on ``device``
    (None: where it is)."""
    t = to_padded(t, width)[:, :width]
    return (t if device is None else t.to(device)).float()


def multiply_like(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``mask * keep`` in ``mask``'s layout (padded or jagged nested) and dtype."""
    if not mask.is_nested:
        return (mask.to(keep.dtype) * keep[:, : mask.shape[1]]).to(mask.dtype)
    offsets = mask.offsets()
    lengths = offsets.diff().tolist()
    values = torch.cat([keep[i, :n] for i, n in enumerate(lengths)]) if lengths else keep.new_zeros(0)
    new_values = (mask.values().to(keep.dtype) * values).to(mask.dtype)
    return torch.nested.nested_tensor_from_jagged(new_values, offsets)


def add_per_row(t: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """``t + per_row[i]`` on every entry of row ``i``, in ``t``'s layout (padded or jagged nested) and dtype."""
    if not t.is_nested:
        return (t + per_row.to(t.device, t.dtype)[:, None]).to(t.dtype)
    lengths = t.offsets().diff()
    shift = torch.repeat_interleave(per_row.to(t.values().device, t.dtype), lengths.to(t.values().device))
    return torch.nested.nested_tensor_from_jagged(t.values() + shift, t.offsets())


def response_lengths(data) -> list[int]:
    """Response tokens of each sequence of verl's TensorDict ``data`` (the slice verl's
    ``no_padding_2_padding`` takes)."""
    responses = data["responses"]
    if responses.is_nested:
        return responses.offsets().diff().tolist()
    return data["attention_mask"][:, data["prompts"].shape[1]:].sum(-1).tolist()
