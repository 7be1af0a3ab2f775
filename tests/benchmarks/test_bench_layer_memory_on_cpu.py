"""Three memory-model terms against a CPU measurement (benchmarks/bench_layer_memory.py), each in a
fresh process: one recomputed decoder layer's backward per token (Qwen3-8B's layer at 1/8 width,
scaled back), the logits' gradient when verl's log-prob kernel does not write it in place, and FSDP1
leaving the root unit's parameters unsharded after a forward without grad (two gloo processes), the
reference model's resident root. About two minutes of CPU: slow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recipe.stapo.memory import model as mm
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow


def _bench(tmp_path, *args) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_layer_memory", *args, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_layer_backward_per_token_matches_the_model(tmp_path):
    result = _bench(tmp_path, "layer", "--scale", "8", "--tokens", "1024,3072")
    # the measured part grows with the tokens: the slope is the per-token cost
    assert result["peak_bytes"][1] > 2 * result["peak_bytes"][0]
    # within 5% of the model
    assert abs(result["ratio"] - 1) <= 0.05, result
    # the model before the measurement (1.5x the saved set, 218 kB per token for 8B) was 20% low
    assert result["bytes_per_token_8b"] > 1.2 * 1.5 * (2 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 12288) * 2


def test_the_logits_gradient_not_written_in_place_is_one_more_logits_tensor(tmp_path):
    """verl's log-probs with inplace_backward=False (the update computing the entropy): the backward
    allocates the logits' gradient, tokens x vocab in bfloat16, the model's term (9.3 GiB at 32,768
    tokens for Qwen3's vocabulary)."""
    result = _bench(tmp_path, "logits-grad", "--tokens", "2048")
    assert result["grad_dtype"] == "torch.bfloat16"
    assert abs(result["ratio"] - 1) <= 0.05, result
    assert round(mm.logits_bytes(32768, 151936, mm.BF16) / mm.GIB, 1) == 9.3


def test_fsdp1_leaves_the_root_unit_unsharded_after_a_forward_without_grad(tmp_path):
    result = _bench(tmp_path, "fsdp-root", "--port", "29541")
    assert result["world_size"] == 2
    # the decoder layers' units free their unsharded parameters after the forward ...
    assert result["layer_unsharded_bytes"] == [0, 0]
    # ... the root's stay, whole (not a 1/world shard), in the compute dtype: the model's term
    assert result["root_unsharded_bytes"] == mm.BF16 * result["root_params"]
    # verl's eval context frees them only when fsdp_size > 1
    assert result["root_after_reshard_bytes"] == 0
