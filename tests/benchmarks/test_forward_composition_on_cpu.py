"""Batch composition and S2T's selection: the same sequences forwarded alone, in the full padded
batch, and in a batch of only the positive-advantage ones (what ``current_forward=positive_advantage``
does) give log-probs that differ by float noise, and the selections differ at most on tokens within
that noise of a threshold. The counts are what docs/method.md quotes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_forward_composition as bench
from benchmarks.bench_forward_composition import silenced_set_difference


def test_silenced_set_difference_counts_tokens_silenced_by_exactly_one_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    a = torch.tensor([[0, 1, 0, 1], [1, 0, 1, 1]])  # silenced: (0,0), (0,2), (1,1)
    b = torch.tensor([[0, 0, 1, 0], [1, 0, 1, 1]])  # silenced: (0,0), (0,1), (1,1); (0,3) is padding
    assert silenced_set_difference(a, b, mask) == 2
    assert silenced_set_difference(a, a, mask) == 0
    with pytest.raises(ValueError, match=r"shapes differ.*keep_b \(2, 3\)"):
        silenced_set_difference(a, b[:, :3], mask)


@pytest.mark.slow
def test_batch_composition_moves_statistics_by_float_noise_and_flips_only_near_thresholds(assets):
    results = bench.run(str(assets / "model"), n=12, length=160, taus=(0.002, 0.05), seed=1)
    by = {(r.dtype, r.tau_p): r for r in results}
    fp32, bf16 = by["float32", 0.002], by["bfloat16", 0.002]
    # the composition matters, in float noise: a sequence alone vs padded beside others
    assert 0 < fp32.max_dlogp_full_vs_alone < 1e-4
    assert bf16.max_dlogp_full_vs_alone > 10 * fp32.max_dlogp_full_vs_alone
    # the positive-advantage batch is narrower than the full one (its longest sequence is negative):
    # at most float noise (on CPU often none: the kernels can give the same bits for both widths)
    assert fp32.max_dlogp_full_vs_positive < 1e-4 and bf16.max_dlogp_full_vs_positive < 0.1
    for r in results:
        assert r.candidates > 0 and r.silenced > 0, r  # the selection has something to disagree on
        assert r.flips_near_threshold == r.flips_full_vs_positive, r  # every flip is float noise at a threshold
        assert r.flips_full_vs_positive <= r.candidates
    print("\n" + bench.table(results))
