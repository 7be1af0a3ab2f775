"""Per-step entropy quantiles logged for every method: exact against torch.quantile."""

import torch

from verl_patches.step_metrics import entropy_quantile_metrics, masked_quantiles


def test_masked_quantiles_equal_torch_quantile_over_response_tokens():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(7, 33, generator=g) * 5
    mask = (torch.rand(7, 33, generator=g) < 0.6).long()
    entropy[mask == 0] = 1e6  # padding must never leak into the quantiles
    expected = [torch.quantile(entropy[mask == 1], q).item() for q in (0.5, 0.8, 0.95)]
    assert masked_quantiles(entropy, mask) == expected
    metrics = entropy_quantile_metrics(entropy, mask)
    assert list(metrics) == ["actor/entropy_p50", "actor/entropy_p80", "actor/entropy_p95"]
    assert list(metrics.values()) == expected


def test_masked_quantiles_beyond_torch_quantile_size_limit_and_empty():
    values = torch.arange(2**24 + 5, dtype=torch.float32).flip(0)  # torch.quantile refuses > 2**24
    (median,) = masked_quantiles(values, torch.ones_like(values), qs=(0.5,))
    assert median == (2**24 + 4) / 2
    assert all(v != v for v in masked_quantiles(torch.ones(3, 4), torch.zeros(3, 4)))  # NaN, no error
