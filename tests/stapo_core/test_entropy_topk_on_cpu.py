"""stapo_core.entropy_topk: how many tokens 20-Entropy keeps, exact ceiling or the authors' rounding."""

from __future__ import annotations

import pytest
import torch

from stapo_core.entropy_topk import entropy_topk_mask, top_count


@pytest.mark.parametrize("n, ratio, ceil, authors", [
    (15, 0.2, 3, 3),          # 0.2 * 15 = 3.0000000000000004: neither adds a token
    (16, 0.2, 4, 4),          # 3.2 -> 4
    (3, 0.2, 1, 1),           # 0.6 -> 1
    (0, 0.2, 0, 0),
    (10000, 0.30005, 3001, 3001),  # 3000.5 -> 3001 both
    (20000, 0.1500000025, 3001, 3000),  # 3000.00005: a fraction in (0, 1e-4] is dropped by the authors' + 0.9999
    (7, 1.0, 7, 7),
])
def test_top_count(n, ratio, ceil, authors):
    assert top_count(n, ratio) == ceil
    assert top_count(n, ratio, "authors_code") == authors


def test_authors_rounding_equals_their_formula_wherever_it_can_be_reached():
    for n in range(1, 400):
        for ratio in (0.2, 0.05, 0.37, 0.5, 0.99):
            assert top_count(n, ratio, "authors_code") == min(n, max(1, int(n * ratio + 0.9999)))


def test_the_mask_keeps_top_count_tokens():
    entropy = torch.arange(40, dtype=torch.float32).reshape(2, 20) / 7
    mask = torch.ones(2, 20)
    for rounding in ("ceil", "authors_code"):
        keep = entropy_topk_mask(entropy, mask, ratio=0.1500005, rounding=rounding)  # 40 * ratio = 6.00002
        assert keep.sum() == {"ceil": 7, "authors_code": 6}[rounding]
        assert keep.flatten()[-int(keep.sum()):].all()  # the highest entropies


def test_bad_rounding_is_named():
    with pytest.raises(ValueError, match="rounding='floor'"):
        top_count(10, 0.2, "floor")
    with pytest.raises(ValueError, match="rounding='floor'"):
        entropy_topk_mask(torch.zeros(1, 3), torch.ones(1, 3), rounding="floor")
