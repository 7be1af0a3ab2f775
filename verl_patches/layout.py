"""verl's per-token fields in both of its layouts: padded ``(batch, resp_len)`` (legacy trainer) and
jagged nested tensors (TransferQueue trainer). The recipe computes on padded tensors and writes
back in the field's own layout."""

from __future__ import annotations

from typing import Optional

import torch


def to_padded(t: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
    """``(batch, resp_len)``, zero-padded to at least ``width`` when ``t`` is jagged."""
    if not t.is_nested:
        return t
    padded = t.to_padded_tensor(0.0)
    if width is not None and padded.shape[1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[1]))
    return padded


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
