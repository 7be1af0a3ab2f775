"""The recipe's sum of squared probabilities (``verl_patches.sum_pi_squared``): the same numbers as the
closed form in float64, at every chunk size, with and without autograd; installed in place of verl's
own function, where verl's FSDP engine looks it up."""

from __future__ import annotations

import inspect

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patch table)
from verl.utils import torch_functional as verl_F
from verl_patches.registry import MARKER, original_of
from verl_patches.sum_pi_squared import CHUNK_ROWS, sum_pi_squared_chunked


def reference(logits: torch.Tensor) -> torch.Tensor:
    """sum_n softmax(x)_n^2, straight from the definition, in float64."""
    return (torch.softmax(logits.double(), dim=-1) ** 2).sum(-1)


def _logits(*shape, scale=4.0, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 16, 100])
@pytest.mark.parametrize("shape", [(16, 50), (2, 5, 37), (1, 1000)])
def test_equals_the_definition_at_every_chunk_size(shape, chunk_rows):
    x = _logits(*shape)
    out = sum_pi_squared_chunked(x, chunk_rows=chunk_rows)
    assert out.shape == shape[:-1] and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x), rtol=2e-6, atol=1e-9)


def test_equals_verls_formula_on_float32_and_is_closer_than_it_on_bfloat16():
    x = _logits(64, 4096, scale=6.0)
    verl = original_of(verl_F.calculate_sum_pi_squared_from_logits)
    torch.testing.assert_close(sum_pi_squared_chunked(x, chunk_rows=5), verl(x), rtol=1e-5, atol=1e-8)
    xb = x.bfloat16()
    exact = reference(xb)  # the bfloat16 logits' own value
    assert (sum_pi_squared_chunked(xb).double() - exact).abs().max() < (verl(xb).double() - exact).abs().max()


def test_peaked_and_flat_distributions_reach_their_limits():
    peaked = torch.full((2, 1000), -1e4)
    peaked[:, 3] = 0.0
    flat = torch.zeros(2, 1000)
    torch.testing.assert_close(sum_pi_squared_chunked(peaked), torch.ones(2))
    torch.testing.assert_close(sum_pi_squared_chunked(flat), torch.full((2,), 1e-3))


def test_no_rows_give_an_empty_result():
    assert sum_pi_squared_chunked(torch.zeros(0, 10)).shape == (0,)


def test_gradient_matches_autograd_of_the_definition():
    x = _logits(9, 30, seed=1).requires_grad_(True)
    weights = torch.randn(9, generator=torch.Generator().manual_seed(2))
    (sum_pi_squared_chunked(x, chunk_rows=4) * weights).sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    (reference(x64) * weights.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-7)


def test_installed_where_verls_engine_looks_it_up():
    patched = verl_F.calculate_sum_pi_squared_from_logits
    assert getattr(patched, MARKER, None) == "chunked_sum_pi_squared"
    x = _logits(CHUNK_ROWS + 3, 11)
    torch.testing.assert_close(patched(x).double(), reference(x), rtol=2e-6, atol=1e-9)
    # the engine calls it through the module attribute at each call, so the patch reaches it
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    source = inspect.getsource(FSDPEngineWithLMHead.prepare_model_outputs)
    assert "verl_F.calculate_sum_pi_squared_from_logits(" in source


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        sum_pi_squared_chunked(torch.zeros(2, 3), chunk_rows=0)
