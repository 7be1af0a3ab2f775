"""The memory model's activation terms against a CPU measurement (stapo_memory/bench_layer_memory.py),
each in a fresh process, with the commands docs/memory.md shows: a micro-batch traced tensor by tensor
at the full size on the meta device; the trace's accounting against the resident memory of the same
code on real CPU tensors; one recomputed decoder layer's resident memory per token (Qwen3-8B's layer
at 1/8 width, scaled back); the logits' gradient when verl's log-prob kernel does not write it in
place; FSDP1 leaving the root unit's parameters unsharded after a forward without grad (two gloo
processes), the reference model's resident root. A few minutes of CPU: slow."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from stapo_memory.shape import BUILTIN_SHAPES
from stapo_memory.terms import BF16, GIB, layer_backward_bytes_per_token, logits_bytes
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow


def _bench(tmp_path, *args) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "stapo_memory.bench_layer_memory", *args, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _documented(subcommand: str) -> list[str]:
    """The ``bench_layer_memory <subcommand>`` commands docs/memory.md shows, as written."""
    text = (REPO / "docs" / "memory.md").read_text()
    return re.findall(rf"python -m stapo_memory\.bench_layer_memory {subcommand}[^`\n]*", text)


def test_the_documented_traces_agree_with_the_model_phase_by_phase():
    commands = _documented("pass")
    assert len(commands) == 3
    for command in commands:
        proc = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
        assert rows, proc.stdout
        for phase, traced, model, ratio in rows:
            assert float(traced) > 0 and abs(float(ratio) - 1) <= 0.01, (command, phase, traced, model)


def test_the_accounting_sees_what_the_process_holds(tmp_path):
    """Real CPU tensors, a model of the 8B's shape at 1/16 width, in float32 (what is checked is that
    the accounting sees every allocation; float32 matmuls are ten times faster than bfloat16 ones on a
    CPU without native bfloat16): the accounted peak is the resident one, and both are the model's
    update, the largest of its moments; counting the logits together with the recomputed layer's
    backward (as the model did before) would be a third too high: the logits are freed before the
    layer is recomputed."""
    (command,) = _documented("accounting")
    result = _bench(tmp_path, *shlex.split(command)[3:])
    assert (result["scale"], result["tokens"], result["dtype"]) == (16, 1024, "float32")
    assert result["resident_bytes"] > 40 * 2**20
    # the resident peak less the kernels' workspace (a float32 copy of the LM head's weight for a
    # bfloat16 matmul on a CPU without native bfloat16, none in float32): never more than that weight
    shape, tensors = BUILTIN_SHAPES["qwen3-8b"], result["resident_bytes"] - result["workspace_bytes"]
    assert 0 <= result["workspace_bytes"] <= 1.05 * 4 * (shape.vocab_size // 16) * (shape.hidden_size // 16), result
    assert abs(result["ratio"] - 1) <= 0.05, result
    assert abs(result["model_bytes"] / tensors - 1) <= 0.05, result
    assert tensors < 0.75 * result["summed_bytes"], result


def test_layer_backward_per_token_matches_the_model(tmp_path):
    (command,) = _documented("layer")
    result = _bench(tmp_path, *shlex.split(command)[3:])
    # the measured part grows with the tokens: the slope is the per-token cost
    assert result["peak_bytes"][1] > 2 * result["peak_bytes"][0]
    # within 2% of the model's 18h + 10q + 10kv + 12I bytes per token
    assert abs(result["ratio"] - 1) <= 0.02, result
    assert result["model_bytes_per_token_8b"] == layer_backward_bytes_per_token(BUILTIN_SHAPES["qwen3-8b"], 2)


def test_the_logits_gradient_not_written_in_place_is_one_more_logits_tensor(tmp_path):
    """verl's log-probs with inplace_backward=False (the update computing the entropy): the backward
    allocates the logits' gradient, tokens x vocab in bfloat16, the model's term (9.3 GiB at 32,768
    tokens for Qwen3's vocabulary)."""
    (command,) = _documented("logits-grad")  # 2048 tokens
    result = _bench(tmp_path, *shlex.split(command.split("#")[0])[3:])
    assert result["grad_dtype"] == "torch.bfloat16"
    assert abs(result["ratio"] - 1) <= 0.05, result
    assert round(logits_bytes(32768, 151936, BF16) / GIB, 1) == 9.3


def test_fsdp1_leaves_the_root_unit_unsharded_after_a_forward_without_grad(tmp_path):
    (command,) = _documented("fsdp-root")
    result = _bench(tmp_path, *shlex.split(command.split("#")[0])[3:])
    assert result["world_size"] == 2
    # the decoder layers' units free their unsharded parameters after the forward ...
    assert result["layer_unsharded_bytes"] == [0, 0]
    # ... the root's stay, whole (not a 1/world shard), in the compute dtype: the model's term
    assert result["root_unsharded_bytes"] == BF16 * result["root_params"]
    # verl's eval context frees them only when fsdp_size > 1
    assert result["root_after_reshard_bytes"] == 0


def test_the_command_names_itself():
    proc = subprocess.run([sys.executable, "-m", "stapo_memory.bench_layer_memory", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m stapo_memory.bench_layer_memory ")
