"""The GPU memory model (``stapo_memory.shape``, ``terms``, ``model``, ``advice``): the config.json
read whole, parameter counts against the models ``transformers`` builds, the passes' terms, the advice it proposes, verl's own
Qwen3-8B examples (known to run on 80 GB GPUs) and the paper's configs. Each pass's activation terms
are checked against a tensor-by-tensor trace of the real model code in
tests/stapo_memory/test_count_on_cpu.py."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from recipe.stapo.driver import compose, ensure_loss_statistics
from recipe.stapo.preflight.context import UNUSABLE, model_config_json
from stapo_memory import advice
from stapo_memory import model as mm
from stapo_memory.shape import BUILTIN_SHAPES, NotEstimated, ShapeError, builtin_shape, shape_from_hf_config
from stapo_memory.terms import (ENTROPY_CHUNK_ROWS, GIB, OVERHEAD_BYTES, SUM_PI_SQUARED_CHUNK_ROWS,
                                layer_backward_bytes_per_token, layer_inputs_bytes_per_token,
                                layer_saved_bytes_per_token, no_grad_layer_bytes_per_token, norm_saved_bytes)
from tests.helpers.cluster_files import QWEN3_CONFIGS
from tests.helpers.paths import REPO

GPU80 = mm.DEFAULT_GPU_MEM_GIB * GIB  # an 80 GB card as CUDA reports it
GPU40 = mm.GPU_CAPACITY_GIB["A100 40GB"] * GIB


def _transformers_params(config: dict) -> int:
    """Parameters of the model transformers builds from ``config`` (on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter


# ------------------------------------------------------------------------------------------------
# the model's shape, read whole
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(QWEN3_CONFIGS))
def test_parameter_count_matches_the_model_transformers_builds(name):
    shape = shape_from_hf_config(QWEN3_CONFIGS[name])
    assert shape.params == _transformers_params(QWEN3_CONFIGS[name])
    # the built-in shape (for a folder the launching machine cannot read) is the same architecture
    assert replace(builtin_shape(f"/models/{name}"), source="") == replace(shape, source="")
    assert shape.max_position_embeddings == 32768


@pytest.mark.parametrize("config", [
    {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
     "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 1000, "tie_word_embeddings": False},
    {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
     "num_key_value_heads": 8, "intermediate_size": 80, "vocab_size": 500, "tie_word_embeddings": True},
    {"model_type": "qwen3", "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
     "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300, "tie_word_embeddings": True},
])
def test_parameter_count_of_other_decoder_families(config):
    assert shape_from_hf_config(config).params == _transformers_params(config)


def test_builtin_shapes_are_found_by_folder_name_only():
    assert builtin_shape("/shared/models/Qwen3-8B-Base").num_layers == 36
    assert builtin_shape("Qwen/Qwen3-14B-Base").hidden_size == 5120
    assert builtin_shape("/shared/models/Qwen3-1.7B/").tie_word_embeddings
    assert builtin_shape("/shared/models/Llama-3-8B") is None


_8B = QWEN3_CONFIGS["Qwen3-8B-Base"]


@pytest.mark.parametrize("change, field, phrase", [
    ({"num_key_value_heads": 5}, "num_key_value_heads", "5 does not divide num_attention_heads=32"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", "0 must be at least 1"),
    ({"vocab_size": 1}, "vocab_size", "1 must be at least 2"),
    ({"hidden_size": -4096}, "hidden_size", "-4096 must be at least 1"),
    ({"hidden_size": 4096.5}, "hidden_size", "4096.5 is not a whole number"),
    ({"intermediate_size": "12288"}, "intermediate_size", "'12288' is not a whole number"),
    ({"num_attention_heads": True}, "num_attention_heads", "True is not a whole number"),
    ({"head_dim": 0}, "head_dim", "0 must be at least 1"),
    ({"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 3}, "head_dim",
     "hidden_size=4096 is not a multiple of num_attention_heads=3"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", "0 must be at least 1"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings", "'no' is not true or false"),
    ({"vocab_size": None}, "vocab_size", "missing"),
])
def test_every_shape_field_is_checked_and_named(change, field, phrase):
    config = {k: v for k, v in {**_8B, **change}.items() if v is not None}
    with pytest.raises(ShapeError) as info:
        shape_from_hf_config(config, source="/m/config.json")
    assert info.value.field == field and phrase in info.value.problem
    assert str(info.value).startswith(f"/m/config.json: {field}: ")


def test_a_nested_text_config_is_read_and_checked():
    assert shape_from_hf_config({"model_type": "x_vl", "text_config": _8B}).params == \
        BUILTIN_SHAPES["qwen3-8b"].params
    with pytest.raises(ShapeError, match="num_hidden_layers"):
        shape_from_hf_config({"text_config": {**_8B, "num_hidden_layers": -1}})


#: Qwen3-30B-A3B's published config.json (the fields that matter here)
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
             "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960}


def test_a_mixture_of_experts_config_is_refused_as_not_estimated_never_as_dense():
    with pytest.raises(NotEstimated) as info:
        shape_from_hf_config(QWEN3_MOE, source="/m/config.json")
    assert info.value.field == "num_experts" and "Mixture-of-Experts" in str(info.value)
    # it names the parameters with its experts: about 30.5B, 15x the dense model of its width
    assert "about 30.5B parameters" in str(info.value)
    # the dense model of the same width would be estimated at about a ninth of that
    dense = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "num_experts_per_tok",
                                                              "moe_intermediate_size")}
    assert shape_from_hf_config({**dense, "model_type": "qwen3"}).params < 30.5e9 / 8
    # the model type alone is enough to say so
    with pytest.raises(NotEstimated) as info:
        shape_from_hf_config(dense)
    assert info.value.field == "model_type"


def test_an_unreadable_file_is_told_from_one_not_json_and_from_a_bad_field(tmp_path):
    """The preflight's reader of the model's config.json (which the memory check reads the shape from)."""
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(tmp_path / "missing")}}})
    raw, why = model_config_json(config)
    assert raw is None and why.startswith(f"{tmp_path / 'missing' / 'config.json'}: ")
    (tmp_path / "config.json").write_text("{not json")
    config.actor_rollout_ref.model.path = str(tmp_path)
    raw, source = model_config_json(config)
    assert source == str(tmp_path / "config.json") and raw[UNUSABLE].startswith("not JSON")
    (tmp_path / "config.json").write_text(json.dumps({**_8B, "num_key_value_heads": 7}))
    with pytest.raises(ShapeError) as info:
        shape_from_hf_config(*model_config_json(config))
    assert info.value.field == "num_key_value_heads"


# ------------------------------------------------------------------------------------------------
# the passes
# ------------------------------------------------------------------------------------------------


def _settings(**kw) -> mm.Settings:
    base = dict(world_size=64, gpu_memory_utilization=0.7, log_prob_tokens=49152, update_tokens=32768,
                current_tokens=49152, longest=16384, rollout_tp=2)
    return mm.Settings(**{**base, **kw})


def _pass(est: mm.Estimate, name: str) -> mm.Pass:
    (p,) = [p for p in est.passes if p.name == name]
    return p


def test_token_dependent_passes_grow_by_their_bytes_per_token():
    """What the suggested budget relies on: above a chunk of rows, a pass is affine in its tokens."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    a = mm.estimate(shape, _settings(log_prob_tokens=8192, update_tokens=8192, current_tokens=8192), GPU80)
    b = mm.estimate(shape, _settings(log_prob_tokens=40960, update_tokens=40960, current_tokens=40960), GPU80)
    for name in ("log_prob", "current", "update"):
        pa, pb = _pass(a, name), _pass(b, name)
        assert pa.phase == pb.phase
        assert pb.total - pa.total == pytest.approx(pa.bytes_per_token * (40960 - 8192), rel=1e-9)
        assert pa.bytes_per_token == pb.bytes_per_token > 0


def test_resident_state_is_sharded_over_the_world_and_offload_frees_the_rollout():
    shape = BUILTIN_SHAPES["qwen3-8b"]
    p = shape.params
    one = mm.estimate(shape, _settings(world_size=8), GPU80)
    rollout = _pass(one, "rollout").components
    assert rollout["parameters (fp32, sharded)"] == 4 * p / 8 and rollout["optimizer (AdamW, fp32, sharded)"] == 8 * p / 8
    assert _pass(one, "update").components["gradients (fp32, sharded)"] == 4 * p / 8
    offload = mm.estimate(shape, _settings(world_size=8, param_offload=True, optimizer_offload=True), GPU80)
    assert _pass(one, "rollout").total - _pass(offload, "rollout").total == pytest.approx(12 * p / 8)
    # the update and the optimizer step load everything back: offload does not lower them
    for name in ("update", "optimizer_step"):
        assert _pass(offload, name).total == pytest.approx(_pass(one, name).total)
    # AdamW's foreach step: parameters, gradients, moments and one float32 temporary, 20 bytes per parameter
    assert _pass(one, "optimizer_step").total - OVERHEAD_BYTES == pytest.approx(20 * p / 8)


def test_the_logits_are_freed_before_the_recomputed_layer_backward():
    """verl's update: flash-attn's cross entropy releases the logits in its backward and forward_step
    keeps none, so the last layer's recomputed backward runs without them: the update is the largest
    of its moments, not their sum. Qwen3-8B at 64 GPUs: about 30.1 GiB (40.8 summed); 38.0 with the
    update's entropy, at the cross entropy's backward (logits and their gradient)."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    update = _pass(mm.estimate(shape, _settings(), GPU80), "update")
    assert update.phase == "LM head backward" and "layer recompute + backward" not in update.components
    assert round(update.total / GIB, 1) == 30.1
    phases = update.phases
    assert phases["layer backward"] < update.total and phases["forward end"] < update.total
    # both moments hold the checkpointed layer inputs; neither holds the other's largest term
    logits = 32768 * 151936 * 2
    layer = 32768 * layer_backward_bytes_per_token(shape, 2)
    assert update.total < phases["layer backward"] + logits and update.total < phases["LM head backward"] + layer
    with_entropy = _pass(mm.estimate(shape, _settings(update_entropy=True, current_tokens=None), GPU80), "update")
    assert with_entropy.phase == "logits backward" and round(with_entropy.total / GIB, 1) == 38.0
    assert with_entropy.components["logits gradient (not in place)"] == logits


def test_unchunked_sum_of_squared_probabilities_is_what_breaks_the_8b_log_prob_pass():
    """Qwen3-8B, 49,152 log-prob tokens per GPU, verl's unchunked sum of squared probabilities
    (about 10 bytes per logit under autocast) does not fit on 80 GB; chunked it does."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    verl = _pass(mm.estimate(shape, _settings(sum_pi_squared_chunk=None), GPU80), "log_prob")
    chunked = _pass(mm.estimate(shape, _settings(), GPU80), "log_prob")
    assert verl.components["sum_pi^2 chunk"] == 49152 * 151936 * (2 + 4 + 4)
    assert verl.total > GPU80 and mm.fits(chunked, GPU80)
    assert chunked.components["entropy chunk"] == 12 * 2048 * 151936  # the chunk, whatever the tokens
    (name, setting, problem), = mm.problems(mm.estimate(shape, _settings(sum_pi_squared_chunk=None), GPU80), GPU80)
    assert (name, setting) == ("log_prob", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    assert "sum_pi^2 chunk" in problem


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
    est = mm.estimate(BUILTIN_SHAPES["qwen3-8b"], mm.Settings(**settings, longest=3072, rollout_tp=2), GPU80)
    assert mm.problems(est, GPU80) == [], mm.table(est, GPU80)


@functools.lru_cache(maxsize=None)  # composing costs a second; the tests only read the configs
def _paper(model: str, method: str, *overrides: str, nnodes: int = 8):
    config = compose([f"method={method}", f"model={model}", f"trainer.nnodes={nnodes}", "trainer.n_gpus_per_node=8",
                      *overrides])
    ensure_loss_statistics(config, log=lambda _: None)
    return config


_SIZES = {"qwen3_1_7b": "qwen3-1.7b", "qwen3_8b": "qwen3-8b", "qwen3_14b": "qwen3-14b"}


def _estimate(model: str, method: str, *overrides: str, nnodes: int = 8, gpu: float = GPU80) -> mm.Estimate:
    return mm.estimate(BUILTIN_SHAPES[_SIZES[model]],
                       mm.settings_from_config(_paper(model, method, *overrides, nnodes=nnodes)), gpu)


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b", "qwen3_14b"])
@pytest.mark.parametrize("method", ["grpo", "stapo"])
def test_paper_configs_fit_an_80gb_gpu_with_margin(model, method):
    """The paper's 64-GPU runs, every pass within an 80 GB card's capacity with the estimate's margin
    (GRPO adds the reference pass, STAPO the current-policy forward)."""
    est = _estimate(model, method)
    assert {p.name for p in est.passes} >= ({"reference"} if method == "grpo" else {"current"})
    assert est.settings.sum_pi_squared_chunk == SUM_PI_SQUARED_CHUNK_ROWS and est.settings.calculate_sum_pi_squared
    assert mm.problems(est, GPU80) == [], mm.table(est, GPU80)


@pytest.mark.parametrize("model", sorted(_SIZES))
@pytest.mark.parametrize("nnodes", [8, 1])
def test_grpo_rollout_exceeds_justrls_by_the_reference_root_unit(model, nnodes):
    """GRPO's reference model keeps its unsharded root unit (FSDP1, fsdp_size=-1) through every later
    pass, the rollout (both runs' peak) included: 0.6 / 2.3 / 2.9 GiB for 1.7B / 8B / 14B. In its own
    pass the actor's root unit, left unsharded by the log-prob pass, sits beside the reference's."""
    grpo, justrl = _estimate(model, "grpo", nnodes=nnodes), _estimate(model, "justrl", nnodes=nnodes)
    shape = grpo.shape
    root = mm.reference_root_bytes(shape, grpo.settings)
    assert root == 2 * shape.embedding_params
    assert round(root / GIB, 1) == {"qwen3_1_7b": 0.6, "qwen3_8b": 2.3, "qwen3_14b": 2.9}[model]
    assert grpo.peak.name == justrl.peak.name == "rollout"
    assert grpo.peak.total - justrl.peak.total == pytest.approx(root)
    for p in grpo.passes:
        if p.name == "reference":
            assert p.components["actor root unit (unsharded since the log-prob pass)"] == root
            assert "reference root unit (unsharded)" not in p.components  # its own root is gathered here
        else:
            assert p.components["reference root unit (unsharded)"] == root, p.name


def test_reference_root_is_resharded_when_verl_reshards_it():
    """verl's eval context reshards the root itself when fsdp_size > 1; FSDP2 is not this term."""
    for override in ("actor_rollout_ref.ref.fsdp_config.fsdp_size=8", "actor_rollout_ref.ref.strategy=fsdp2"):
        settings = mm.settings_from_config(_paper("qwen3_8b", "grpo", override))
        assert settings.ref_tokens is not None and not settings.reference_root_resident, override
        est = mm.estimate(BUILTIN_SHAPES["qwen3-8b"], settings, GPU80)
        assert all("reference root unit (unsharded)" not in p.components for p in est.passes)


def test_entropy_in_the_update_writes_the_logits_gradient_beside_the_logits():
    """20-Entropy's authors' code reading (micro-batch scope, current statistics) needs the update's
    entropy: verl then calls its log-prob kernel with inplace_backward=False, +T V b (9.3 GiB at
    32,768) at the cross entropy's backward; the entropy itself runs without grad (the recipe's patch)."""
    est = _estimate("qwen3_8b", "entropy20", "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code")
    assert est.settings.update_entropy and not est.settings.update_entropy_grad
    update = _pass(est, "update")
    assert update.components["logits gradient (not in place)"] == 32768 * 151936 * 2
    assert round(update.components["logits gradient (not in place)"] / GIB, 1) == 9.3
    plain = _pass(mm.estimate(est.shape, replace(est.settings, update_entropy=False), GPU80), "update")
    assert "logits gradient (not in place)" not in plain.components
    assert update.total - plain.total == pytest.approx(32768 * 151936 * 2 - 32768 * (4096 * 2) - 151936 * 4096 * 2)


def test_no_sync_gradient_accumulation_keeps_the_unsharded_gradients_and_the_plan_turns_it_off():
    """use_no_sync_for_gradient_accumulation=true: every layer's bf16 gradient stays unsharded across
    micro-batches, +2 P bytes (15 GiB for 8B); the plan turns it off when that is needed."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    key = "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation"
    off = mm.settings_from_config(_paper("qwen3_8b", "justrl", nnodes=1))
    on = mm.settings_from_config(_paper("qwen3_8b", "justrl", f"{key}=true", nnodes=1))
    assert on.no_sync_gradients and not off.no_sync_gradients
    a, b = mm.estimate(shape, off, GPU80), mm.estimate(shape, on, GPU80)
    for name in ("update", "update_end"):
        assert _pass(b, name).total - _pass(a, name).total == pytest.approx(2 * shape.params)
    assert round(2 * shape.params / GIB) == 15
    without = _pass(a, "update")
    small = without.total + mm.margin_bytes(without) + 1 * GIB  # fits without the 15 GiB, not with them
    plan, overrides = advice.settings_plan(shape, on, small)
    assert overrides[key] is False and not plan.no_sync_gradients
    assert mm.all_fit(mm.estimate(shape, plan, small), small)
    assert plan.update_tokens == on.update_tokens  # turning it off is enough for the update


def test_no_grad_passes_count_the_logits_side_not_the_freed_layer_activations():
    """The layers' tensors are freed before the LM head, and the final hidden states when the model's
    forward returns: a log-prob pass's peak is the logits with their temporaries."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    p = _pass(mm.estimate(shape, _settings(), GPU80), "log_prob")
    assert p.phase == "logits" and "final hidden states" not in p.components
    assert p.components["logits"] == 49152 * 151936 * 2
    # a tiny vocabulary: the layers' working set is the larger, and only it is counted
    q = _pass(mm.estimate(replace(shape, vocab_size=1000), _settings(), GPU80), "log_prob")
    assert q.phase == "layers" and "logits" not in q.components
    assert q.components["layer working set (no grad)"] == 49152 * no_grad_layer_bytes_per_token(shape, 2)


def test_update_counts_the_saved_tensors_flash_attention_and_the_norms_keep():
    """One recomputed Qwen3-8B layer keeps 16h + 10q + 10kv + 8I bytes per token (bf16) for its backward:
    the norms' float32 copies, flash-attn's q, k, v, out; its MLP backward adds 2h + 4I."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    attention, mlp = layer_saved_bytes_per_token(shape, 2)
    h, q, kv, i = 4096, 4096, 1024, 12288
    assert attention + mlp == 16 * h + 10 * q + 10 * kv + 8 * i + 4 * 32
    assert layer_backward_bytes_per_token(shape, 2) == 18 * h + 10 * q + 10 * kv + 12 * i + 4 * 32
    # what the update keeps from its forward's end to the final norm's backward: the layer inputs, the
    # final norm's saved tensors and its output (the LM head's saved input)
    assert layer_inputs_bytes_per_token(shape, 2) + norm_saved_bytes(h, 2) + h * 2 == 36 * h * 2 + 8 * h
    # the layer's gradient and its reduce-scatter: 6 bytes per parameter (1.1 GiB for 8B)
    assert round(mm._reduce_scatter_bytes(shape.layer_params, _settings()) / GIB, 1) == 1.1


def test_monitor_and_update_effect_forwards_come_from_the_policy_loss_dataclass():
    monitored = mm.settings_from_config(_paper("qwen3_8b", "justrl", "actor_rollout_ref.actor.policy_loss.stats_from=current"))
    assert monitored.current_tokens == monitored.log_prob_tokens == 49152
    assert not monitored.sequence_parallel_allowed
    plain = mm.settings_from_config(_paper("qwen3_8b", "justrl"))
    assert plain.current_tokens is None and plain.update_effect_tokens is None and plain.sequence_parallel_allowed
    effect = mm.settings_from_config(_paper("qwen3_8b", "stapo", "actor_rollout_ref.actor.policy_loss.update_effect_responses=2"))
    assert effect.update_effect_tokens == 2 * 16384
    assert "update_effect" in {p.name for p in mm.estimate(BUILTIN_SHAPES["qwen3-8b"], effect, GPU80).passes}


def test_chunk_sizes_are_the_ones_the_code_uses():
    """The model's chunk sizes are copies: of the recipe's sum of squares and of verl's entropy
    (its function's default and its config's)."""
    import inspect

    from verl.utils.torch_functional import entropy_from_logits_with_chunking

    from verl_patches import sum_pi_squared

    assert SUM_PI_SQUARED_CHUNK_ROWS == sum_pi_squared.CHUNK_ROWS
    assert ENTROPY_CHUNK_ROWS == inspect.signature(entropy_from_logits_with_chunking).parameters["chunk_size"].default
    config = _paper("qwen3_8b", "stapo")
    assert config.actor_rollout_ref.actor.entropy_from_logits_chunk_size == ENTROPY_CHUNK_ROWS
    assert mm.settings_from_config(config).entropy_chunk == ENTROPY_CHUNK_ROWS


def test_vllm_share_must_hold_its_weights_and_one_sequence():
    """vLLM refuses to start when its share cannot hold its weights and one max_model_len sequence's
    KV cache: Qwen3-14B with vLLM on one GPU (tensor parallel 1) at 0.3 of a 40 GB card."""
    shape = BUILTIN_SHAPES["qwen3-14b"]
    s = _settings(world_size=64, gpu_memory_utilization=0.3, rollout_tp=1)
    est = mm.estimate(shape, s, GPU40)
    floor = mm.vllm_floor_bytes(shape, s)
    assert floor == 2 * shape.params + 2 * 40 * 8 * 128 * 2 * 16384 + mm.VLLM_RUNTIME_BYTES
    assert not mm.vllm_share_fits(est, GPU40)
    (problem,) = [p for n, _, p in mm.problems(est, GPU40) if "vLLM's share" in p]
    assert "vLLM would refuse to start" in problem
    # 29.5 GiB of weights beside the state: no utilisation fits both
    assert advice.settings_plan(shape, s, GPU40) is None


# ------------------------------------------------------------------------------------------------
# capacity, margin and advice
# ------------------------------------------------------------------------------------------------


def test_capacity_is_what_cuda_reports_and_the_margin_refuses_a_pass_at_the_limit(monkeypatch):
    monkeypatch.delenv("GPU_MEM_GB", raising=False)
    assert float(_paper.__wrapped__("qwen3_8b", "stapo").recipe.gpu_mem_gb) == mm.DEFAULT_GPU_MEM_GIB == 79.1
    assert mm.GPU_CAPACITY_GIB["A100 / A800 / H100 / H800 80GB"] == mm.DEFAULT_GPU_MEM_GIB
    est = _estimate("qwen3_14b", "justrl", nnodes=1)
    rollout = _pass(est, "rollout")
    at_limit = rollout.total + 0.5 * mm.margin_bytes(rollout)
    est_at_limit = mm.estimate(est.shape, est.settings, at_limit)
    assert mm.verdict(_pass(est_at_limit, "rollout"), at_limit) in ("TIGHT", "DOES NOT FIT")
    assert "rollout" in [n for n, *_ in mm.problems(est_at_limit, at_limit)]


@pytest.mark.parametrize("method, expected", [("justrl", 0.60), ("grpo", 0.55)])
def test_14b_on_one_node_is_refused_and_the_suggested_utilisation_fits(method, expected):
    est = _estimate("qwen3_14b", method, nnodes=1)
    assert [n for n, *_ in mm.problems(est, GPU80)] == ["rollout"]
    plan, overrides = advice.settings_plan(est.shape, est.settings, GPU80)
    assert overrides == {"actor_rollout_ref.rollout.gpu_memory_utilization": expected}
    assert mm.problems(mm.estimate(est.shape, plan, GPU80), GPU80) == []
    # the next step up does not fit: the largest that does
    assert not mm.all_fit(mm.estimate(est.shape, replace(plan, gpu_memory_utilization=expected + 0.05), GPU80), GPU80)
    # a card taken for 79.6 or even 80 GiB does not let the default through either
    for gib in (79.6, 80.0):
        assert "rollout" in [n for n, *_ in mm.problems(mm.estimate(est.shape, est.settings, gib * GIB), gib * GIB)]


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b"])
@pytest.mark.parametrize("method", ["grpo", "justrl", "stapo", "entropy20"])
def test_1_7b_and_8b_fit_one_node_as_shipped(model, method):
    est = _estimate(model, method, nnodes=1)
    assert mm.problems(est, GPU80) == [], mm.table(est, GPU80)


@pytest.mark.parametrize("method", ["stapo", "justrl"])
def test_8b_on_one_node_of_40gb_cards_has_a_plan_without_sequence_parallelism(method):
    """The case with no passing path before: one node of 40 GB cards. Sequence parallelism is refused
    with STAPO's current-policy statistics, so the plan lowers vLLM's share and the budgets instead,
    never below one 16,384-token sequence; every pass then fits."""
    est = _estimate("qwen3_8b", method, nnodes=1, gpu=GPU40)
    assert mm.problems(est, GPU40)
    plan, overrides = advice.settings_plan(est.shape, est.settings, GPU40)
    assert not any("ulysses" in k for k in overrides)
    assert overrides["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.5
    assert all(v >= 16384 for k, v in overrides.items() if k.endswith("max_token_len_per_gpu"))
    assert mm.all_fit(mm.estimate(est.shape, plan, GPU40), GPU40)
    # the budgets are the largest that fit: one step more does not
    update = overrides["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
    assert not mm.all_fit(mm.estimate(est.shape, replace(plan, update_tokens=update + advice.BUDGET_STEP), GPU40), GPU40)


def test_sequence_parallelism_is_proposed_only_where_the_recipe_allows_it():
    """JustRL (no current-policy forward) may get a larger sequence parallel size when no budget of one
    sequence fits (Qwen3-14B on two nodes of 40 GB cards); STAPO never does: its plan is more GPUs."""
    shape = BUILTIN_SHAPES["qwen3-14b"]
    justrl = mm.settings_from_config(_paper("qwen3_14b", "justrl", nnodes=2))
    plan, overrides = advice.settings_plan(shape, justrl, GPU40)
    assert overrides["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == 2
    assert 16384 // 2 <= overrides["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] < 16384
    assert mm.all_fit(mm.estimate(shape, plan, GPU40), GPU40)
    stapo = mm.settings_from_config(_paper("qwen3_14b", "stapo", nnodes=2))
    assert advice.settings_plan(shape, stapo, GPU40) is None
    kinds = [(p.kind, p.overrides) for p in advice.plans(shape, stapo, GPU40)]
    assert kinds[0][0] == "gpus" and not any("ulysses" in k for _, o in kinds for k in o)


def test_when_no_budget_fits_only_offload_or_more_gpus_is_proposed_and_it_fits():
    """14B on one GPU with offload: the update's token-independent part alone exceeds the GPU, so no
    budget or sequence parallel size helps; the plans are more GPUs, each re-estimated."""
    shape = BUILTIN_SHAPES["qwen3-14b"]
    settings = _settings(world_size=1, param_offload=True, optimizer_offload=True, update_tokens=16384,
                         log_prob_tokens=32768, current_tokens=None, rollout_tp=1)
    est = mm.estimate(shape, settings, GPU80)
    update = _pass(est, "update")
    assert update.total - update.bytes_per_token * update.tokens > GPU80
    assert advice.settings_plan(shape, settings, GPU80) is None
    first = next(advice.plans(shape, settings, GPU80, gpus_per_node=1))
    assert first.kind == "gpus" and mm.all_fit(first.estimate, GPU80)
    world = first.estimate.settings.world_size
    assert first.overrides == {"trainer.n_gpus_per_node": world} and world in (2, 4, 8)
    # the GPU counts before it do not fit, whatever the settings
    for fewer in (g for g in (1, 2, 4) if g < world):
        assert advice.settings_plan(shape, replace(settings, world_size=fewer), GPU80) is None


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "run_scripts").glob("qwen3_*_*.sh")))
def test_the_one_node_settings_each_run_script_names_fit(script):
    """Each paper run script names its one-node settings; the model accepts them, and needs them
    (the 14B without its lower utilisation is refused)."""
    import re

    text = (REPO / "run_scripts" / script).read_text()
    (line,) = re.findall(r"^#   NNODES=1(.*)$", text, flags=re.M)
    overrides = re.findall(r"(actor_rollout_ref\.\S+=\S+)", line)
    method, model = re.search(r'common\.sh" (\w+) (qwen3_\w+)', text).groups()
    est = _estimate(model, method, *overrides, nnodes=1)
    assert mm.problems(est, GPU80) == [], mm.table(est, GPU80)
    if overrides:
        assert mm.problems(_estimate(model, method, nnodes=1), GPU80) != []


def test_every_component_names_the_code_it_follows():
    """docs/memory.md writes each pass out with the code each component follows: every component any
    pass can have is in COMPONENT_SOURCES (a new term must say where it comes from)."""
    shape = BUILTIN_SHAPES["qwen3-8b"]
    variants = [dict(), dict(update_entropy=True), dict(update_entropy=True, update_entropy_grad=True),
                dict(unit_temperature=False), dict(no_sync_gradients=True), dict(ref_tokens=49152,
                                                                              reference_root_resident=True),
                dict(update_effect_tokens=16384), dict(param_offload=True, optimizer_offload=True)]
    seen = set()
    for variant in variants:
        for tokens in (1024, 32768):
            est = mm.estimate(shape, _settings(update_tokens=tokens, **variant), GPU80)
            for p in est.passes:
                seen |= set(p.components)
            for terms in mm.update_activation_phases(shape, est.settings).values():
                seen |= {t[0] for t in terms}
    small = replace(shape, vocab_size=1000, tie_word_embeddings=True)
    for p in mm.estimate(small, _settings(), GPU80).passes:
        seen |= set(p.components)
    assert seen <= set(mm.COMPONENT_SOURCES), seen - set(mm.COMPONENT_SOURCES)
    assert all(source.strip() for source in mm.COMPONENT_SOURCES.values())
