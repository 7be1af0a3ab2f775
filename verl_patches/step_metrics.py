"""Per-step token statistics logged for every method (so baselines can be compared to STAPO).

``actor/entropy_p50``, ``actor/entropy_p80``, ``actor/entropy_p95``: quantiles of the rollout-time
entropy over all response tokens of the step (verl itself logs only the mean, ``actor/entropy``).
Computed on the driver, exactly (sorting, no 16M-element limit), from the entropy the trainer
already has, just before the actor update.
"""

from __future__ import annotations

import torch

from stapo_core import quantile_sorted_padded

ENTROPY_QUANTILES = (0.5, 0.8, 0.95)


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor, qs=ENTROPY_QUANTILES) -> list[float]:
    """``torch.quantile(values[mask != 0], q)`` for each ``q`` (NaN when the mask is empty), exactly.

    Args:
        values, mask: ``(batch, resp_len)``, any dtype (values compared in float32). qs: quantiles in [0, 1].
    """
    selected = values.float()[mask != 0]
    ordered = selected.sort().values
    count = torch.tensor(ordered.numel())
    return [float(quantile_sorted_padded(ordered, count, q)) for q in qs]


def entropy_quantile_metrics(entropy: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """``{actor/entropy_p<q>: value}`` of the step's response tokens (``(batch, resp_len)`` each)."""
    values = masked_quantiles(entropy, response_mask)
    return {f"actor/entropy_p{round(q * 100)}": v for q, v in zip(ENTROPY_QUANTILES, values)}
