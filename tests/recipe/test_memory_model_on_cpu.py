"""The GPU memory model (``recipe.stapo.memory_model``): parameter counts against the models
``transformers`` builds, the passes' arithmetic, the budget it suggests, verl's own Qwen3-8B examples
(known to run on 80 GB GPUs) and the paper's configs. Its logits-side numbers are checked against a
measurement in tests/benchmarks/test_bench_logits_memory_on_cpu.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from recipe.stapo import memory_model as mm
from recipe.stapo.config_utils import compose
from tests.helpers.cluster_files import QWEN3_CONFIGS

GPU80 = 80 * mm.GIB


def _transformers_params(config: dict) -> int:
    """Parameters of the model transformers builds from ``config`` (on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter


@pytest.mark.parametrize("name", sorted(QWEN3_CONFIGS))
def test_parameter_count_matches_the_model_transformers_builds(name):
    shape = mm.shape_from_hf_config(QWEN3_CONFIGS[name])
    assert shape.params == _transformers_params(QWEN3_CONFIGS[name])
    # the built-in shape (for a folder the launching machine cannot read) is the same architecture
    assert replace(mm.builtin_shape(f"/models/{name}"), source="") == shape


@pytest.mark.parametrize("config", [
    {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
     "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 1000, "tie_word_embeddings": False},
    {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
     "num_key_value_heads": 8, "intermediate_size": 80, "vocab_size": 500, "tie_word_embeddings": True},
    {"model_type": "qwen3", "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
     "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300, "tie_word_embeddings": True},
])
def test_parameter_count_of_other_decoder_families(config):
    assert mm.shape_from_hf_config(config).params == _transformers_params(config)


def test_builtin_shapes_are_found_by_folder_name_only():
    assert mm.builtin_shape("/shared/models/Qwen3-8B-Base").num_layers == 36
    assert mm.builtin_shape("Qwen/Qwen3-14B-Base").hidden_size == 5120
    assert mm.builtin_shape("/shared/models/Qwen3-1.7B/").tie_word_embeddings
    assert mm.builtin_shape("/shared/models/Llama-3-8B") is None


def _settings(**kw) -> mm.Settings:
    base = dict(world_size=64, gpu_memory_utilization=0.7, log_prob_tokens=49152, update_tokens=32768,
                current_tokens=49152)
    return mm.Settings(**{**base, **kw})


def _pass(est: mm.Estimate, name: str) -> mm.Pass:
    (p,) = [p for p in est.passes if p.name == name]
    return p


def test_token_dependent_passes_grow_by_their_bytes_per_token():
    """What the suggested budget relies on: above a chunk of rows, a pass is affine in its tokens."""
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    a = mm.estimate(shape, _settings(log_prob_tokens=8192, update_tokens=8192, current_tokens=8192), GPU80)
    b = mm.estimate(shape, _settings(log_prob_tokens=40960, update_tokens=40960, current_tokens=40960), GPU80)
    for name in ("log_prob", "current", "update"):
        pa, pb = _pass(a, name), _pass(b, name)
        assert pb.total - pa.total == pytest.approx(pa.bytes_per_token * (40960 - 8192), rel=1e-9)
        assert pa.bytes_per_token == pb.bytes_per_token > 0


def test_resident_state_is_sharded_over_the_world_and_offload_frees_the_rollout():
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    p = shape.params
    one = mm.estimate(shape, _settings(world_size=8), GPU80)
    rollout = _pass(one, "rollout").components
    assert rollout["parameters (fp32, sharded)"] == 4 * p / 8 and rollout["optimizer (AdamW, fp32, sharded)"] == 8 * p / 8
    assert _pass(one, "update").components["gradients (fp32, sharded)"] == 4 * p / 8
    offload = mm.estimate(shape, _settings(world_size=8, param_offload=True, optimizer_offload=True), GPU80)
    assert _pass(one, "rollout").total - _pass(offload, "rollout").total == pytest.approx(12 * p / 8)
    # the update loads everything back: offload does not lower it
    assert _pass(offload, "update").total == pytest.approx(_pass(one, "update").total)


def test_unchunked_sum_of_squared_probabilities_is_what_breaks_the_8b_log_prob_pass():
    """The issue's case: Qwen3-8B, 49,152 log-prob tokens per GPU, verl's unchunked sum of squared
    probabilities (about 10 bytes per logit under autocast) does not fit on 80 GB; chunked it does."""
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    verl = _pass(mm.estimate(shape, _settings(sum_pi_squared_chunk=None), GPU80), "log_prob")
    chunked = _pass(mm.estimate(shape, _settings(), GPU80), "log_prob")
    assert verl.components["sum_pi^2 temporaries"] == 49152 * 151936 * (2 + 4 + 4)
    assert verl.total > GPU80 > chunked.total
    assert chunked.components["entropy temporaries"] == 12 * 2048 * 151936  # the chunk, whatever the tokens
    (name, setting, problem, fix), = mm.problems(mm.estimate(shape, _settings(sum_pi_squared_chunk=None), GPU80),
                                                 GPU80, longest=16384)
    assert (name, setting) == ("log_prob", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    assert "sum_pi^2 temporaries" in problem and "lower actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu" in fix


@pytest.mark.parametrize("example, settings", [
    # verl examples/otb_trainer/run_qwen3_8b_fsdp.sh: calculate_sum_pi_squared=True, 24576 tokens per GPU
    # for the update and the log-prob pass, vLLM TP 2 at 0.75, one node of 8 GPUs, no offload
    ("otb_trainer/run_qwen3_8b_fsdp.sh", dict(world_size=8, gpu_memory_utilization=0.75, log_prob_tokens=24576,
                                             update_tokens=24576, current_tokens=None, sum_pi_squared_chunk=None)),
    # verl examples/gpg_trainer/run_qwen3_8b_fsdp.sh: the same budgets, vLLM at 0.6, no sum of squares
    ("gpg_trainer/run_qwen3_8b_fsdp.sh", dict(world_size=8, gpu_memory_utilization=0.6, log_prob_tokens=24576,
                                             update_tokens=24576, current_tokens=None, calculate_sum_pi_squared=False)),
])
def test_verls_own_qwen3_8b_examples_fit_an_80gb_gpu(example, settings):
    """verl's examples run as published (unpatched verl: its own unchunked sum of squares)."""
    est = mm.estimate(mm.BUILTIN_SHAPES["qwen3-8b"], mm.Settings(**settings), GPU80)
    assert mm.problems(est, GPU80, longest=3072) == [], mm.table(est, GPU80)


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b", "qwen3_14b"])
@pytest.mark.parametrize("method", ["grpo", "stapo"])
def test_paper_configs_fit_an_80gb_gpu_with_margin(model, method):
    """The paper's 64-GPU runs, every pass at most 80% of an 80 GB GPU by the estimate (GRPO adds the
    reference pass, STAPO the current-policy forward)."""
    config = compose([f"method={method}", f"model={model}", "trainer.nnodes=8", "trainer.n_gpus_per_node=8"])
    size = {"qwen3_1_7b": "qwen3-1.7b", "qwen3_8b": "qwen3-8b", "qwen3_14b": "qwen3-14b"}[model]
    settings = mm.settings_from_config(config)
    est = mm.estimate(mm.BUILTIN_SHAPES[size], settings, GPU80)
    assert {p.name for p in est.passes} >= ({"reference"} if method == "grpo" else {"current"})
    assert settings.sum_pi_squared_chunk == mm.SUM_PI_SQUARED_CHUNK_ROWS and settings.calculate_sum_pi_squared
    assert est.peak.total <= 0.8 * GPU80, mm.table(est, GPU80)


def test_suggested_budget_fits_and_the_next_one_does_not():
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    est = mm.estimate(shape, _settings(update_tokens=262144), GPU80)
    (name, setting, _, fix), = [x for x in mm.problems(est, GPU80, longest=16384) if x[0] == "update"]
    budget = int(fix.split("at most ")[1].split()[0])
    assert budget % 1024 == 0 and budget >= 16384
    assert _pass(mm.estimate(shape, _settings(update_tokens=budget), GPU80), "update").total <= GPU80
    assert _pass(mm.estimate(shape, _settings(update_tokens=budget + 1024), GPU80), "update").total > GPU80


def test_rollout_that_does_not_fit_suggests_a_utilisation_that_does():
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    est = mm.estimate(shape, _settings(world_size=8, gpu_memory_utilization=0.9), GPU80)
    (fix,) = [f for n, _, _, f in mm.problems(est, GPU80, longest=16384) if n == "rollout"]
    utilisation = float(fix.split("at most ")[1])
    assert 0.3 <= utilisation < 0.9
    assert _pass(mm.estimate(shape, _settings(world_size=8, gpu_memory_utilization=utilisation), GPU80),
                 "rollout").total <= GPU80
