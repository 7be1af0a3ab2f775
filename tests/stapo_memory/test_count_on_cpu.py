"""The memory model against a count of what verl 0.9.1's code allocates, for every shipped run: each
paper run script and every run of ``run_scripts/ablations.sh`` (its sweeps on each model config),
composed from their command lines, on one node and on eight.

The count is the model's resident, FSDP and vLLM terms (read from FSDP's and verl's code, written out
in docs/memory.md) with its activation terms replaced by a trace of the real model code: the whole
transformers model at the run's token budgets on the meta device, every tensor accounted for by its
size (``stapo_memory.bench_layer_memory``: the trace itself is checked against the resident memory of
the same code on CPU in tests/stapo_memory/test_bench_layer_memory_on_cpu.py). Each pass must be within
5% of it; the update is the pass the model counted 10-38% too high before."""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess

import pytest
from omegaconf import OmegaConf, open_dict

from recipe.stapo.driver import compose, ensure_loss_statistics
from stapo_memory import model as mm
from stapo_memory.bench_layer_memory import compare, counted_totals
from stapo_memory.shape import BUILTIN_SHAPES, ModelShape, builtin_shape
from stapo_memory.terms import GIB
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow

TOLERANCE = 0.05
GPU80 = mm.DEFAULT_GPU_MEM_GIB * GIB


def _dry_run(script: str, *args: str, **env) -> list[list[str]]:
    """The Hydra overrides of every run a script starts (its ``STAPO_DRY_RUN=1`` command lines)."""
    environ = {**os.environ, "STAPO_DRY_RUN": "1", "LOGGER": "console", **env}
    out = subprocess.run(["bash", str(REPO / "run_scripts" / script), *args], env=environ, capture_output=True,
                         text=True, check=True).stdout
    return [shlex.split(line)[3:] for line in out.strip().splitlines()]


def _shipped_runs() -> list[tuple[str, list[str]]]:
    runs = []
    for script in sorted(p.name for p in (REPO / "run_scripts").glob("qwen3_*_*.sh")):
        runs += [(script, o) for o in _dry_run(script)]
    for model in ("qwen3_1_7b", "qwen3_8b", "qwen3_14b"):
        runs += [(f"ablations.sh all ({model})", o) for o in _dry_run("ablations.sh", "all", MODEL_CONFIG=model)]
    runs += [("ablations.sh compose", o) for o in _dry_run("ablations.sh", "compose")]
    return runs


RUNS = _shipped_runs()


def test_the_runs_cover_every_script_and_ablation():
    scripts = {name for name, _ in RUNS}
    assert len([s for s in scripts if s.startswith("qwen3_")]) == 12
    names = [next(o for o in overrides if o.startswith("trainer.experiment_name=")) for _, overrides in RUNS]
    text = (REPO / "run_scripts" / "ablations.sh").read_text()
    strategies = re.search(r"for s in ([\w ]+); do", text).group(1).split()
    assert all(any(f"strategy_{s}" in n for n in names) for s in strategies)
    assert any("stapo_gspo" in n for n in names) and any("stapo_cispo" in n for n in names)
    assert len(RUNS) == 12 + 3 * 9 + 2


@pytest.fixture(scope="module")
def composed():
    """Each shipped run's config, composed once (composing costs a second); a test sets its node count
    on a copy."""
    return [(name, compose(overrides)) for name, overrides in RUNS]


@pytest.mark.parametrize("nnodes", [8, 1])
def test_every_pass_of_every_shipped_run_is_within_5_percent_of_the_count(composed, nnodes):
    worst = {}
    for name, shipped in composed:
        config = copy.deepcopy(shipped)
        with open_dict(config):
            OmegaConf.update(config, "trainer.nnodes", nnodes)
        ensure_loss_statistics(config, log=lambda _: None)
        shape = builtin_shape(str(config.actor_rollout_ref.model.path))
        est = mm.estimate(shape, mm.settings_from_config(config), GPU80)
        counted = counted_totals(est)
        for p in est.passes:
            error = p.total / counted[p.name] - 1
            assert abs(error) <= TOLERANCE, (name, p.name, p.total / GIB, counted[p.name] / GIB)
            worst[p.name] = max(worst.get(p.name, 0.0), abs(error))
    assert {"rollout", "log_prob", "current", "reference", "update", "update_end", "optimizer_step"} <= set(worst)


CASES = [dict(), dict(entropy=True), dict(entropy=True, entropy_grad=True), dict(unit_temperature=False),
         dict(forward=True, entropy=True), dict(forward=True, sum_pi_squared=False),
         dict(forward=True, entropy=True, unit_temperature=False)]


@pytest.mark.parametrize("shape_name, case", [("qwen3-8b", case) for case in CASES] + [
    (name, case) for name in ("qwen3-1.7b", "qwen3-14b") for case in (CASES[0], CASES[4])])
def test_each_moment_of_a_micro_batch_is_the_traced_one(shape_name, case):
    """Every moment the model counts against the trace of the same moments, beyond the shipped runs:
    the update's entropy with and without grad, a temperature other than 1, each no-grad pass's
    temporaries (on Qwen3-8B; the other paper shapes, one tied, with an update and a log-prob pass):
    within 1%."""
    for row in compare(BUILTIN_SHAPES[shape_name], 16384, **case):
        assert abs(row["ratio"] - 1) <= 0.01, row


@pytest.mark.parametrize("shape", [
    ModelShape(hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=512,
                  vocab_size=151936, tie_word_embeddings=False, qk_norm=True, source="a narrow MLP"),
    ModelShape(hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=32, head_dim=128,
                  intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                  source="multi-head attention"),
    ModelShape(hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                  vocab_size=1000, tie_word_embeddings=False, qk_norm=True, source="a small vocabulary"),
    ModelShape(hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                  vocab_size=128256, tie_word_embeddings=False, model_type="llama", source="Llama"),
    ModelShape(hidden_size=3584, num_layers=4, num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
                  vocab_size=152064, tie_word_embeddings=False, qkv_bias=True, model_type="qwen2", source="Qwen2"),
], ids=lambda s: s.source)
def test_other_shapes_peak_where_the_model_says(shape):
    """Shapes whose peak is elsewhere than Qwen3's: the attention's or a norm's backward (a narrow MLP),
    no grouped-query attention, the layers rather than the logits (a small vocabulary), no q/k norms."""
    for case in (dict(), dict(forward=True, entropy=True)):
        for row in compare(shape, 16384, **case):
            assert abs(row["ratio"] - 1) <= 0.01, row
