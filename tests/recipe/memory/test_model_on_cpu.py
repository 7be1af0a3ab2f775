"""The GPU memory model (``recipe.stapo.memory.model``): parameter counts against the models
``transformers`` builds, the passes' arithmetic, the budget it suggests, verl's own Qwen3-8B examples
(known to run on 80 GB GPUs) and the paper's configs. Its logits-side numbers are checked against a
measurement in tests/benchmarks/test_bench_logits_memory_on_cpu.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from recipe.stapo.memory import model as mm
from recipe.stapo.driver import compose
from tests.helpers.cluster_files import QWEN3_CONFIGS
from tests.helpers.paths import REPO

GPU80 = mm.DEFAULT_GPU_MEM_GIB * mm.GIB  # an 80 GB card as CUDA reports it


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
    assert verl.total > GPU80 and mm.fits(chunked, GPU80)
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
    """The paper's 64-GPU runs, every pass within an 80 GB card's capacity with the estimate's margin
    (GRPO adds the reference pass, STAPO the current-policy forward)."""
    config = compose([f"method={method}", f"model={model}", "trainer.nnodes=8", "trainer.n_gpus_per_node=8"])
    size = {"qwen3_1_7b": "qwen3-1.7b", "qwen3_8b": "qwen3-8b", "qwen3_14b": "qwen3-14b"}[model]
    settings = mm.settings_from_config(config)
    est = mm.estimate(mm.BUILTIN_SHAPES[size], settings, GPU80)
    assert {p.name for p in est.passes} >= ({"reference"} if method == "grpo" else {"current"})
    assert settings.sum_pi_squared_chunk == mm.SUM_PI_SQUARED_CHUNK_ROWS and settings.calculate_sum_pi_squared
    assert mm.problems(est, GPU80, longest=16384) == [], mm.table(est, GPU80)


def test_suggested_budget_fits_and_the_next_one_does_not():
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    est = mm.estimate(shape, _settings(update_tokens=262144), GPU80)
    (name, setting, _, fix), = [x for x in mm.problems(est, GPU80, longest=16384) if x[0] == "update"]
    budget = int(fix.split("at most ")[1].split()[0])
    assert budget % 1024 == 0 and budget >= 16384
    assert mm.fits(_pass(mm.estimate(shape, _settings(update_tokens=budget), GPU80), "update"), GPU80)
    assert not mm.fits(_pass(mm.estimate(shape, _settings(update_tokens=budget + 1024), GPU80), "update"), GPU80)


def test_rollout_that_does_not_fit_suggests_a_utilisation_that_does():
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    est = mm.estimate(shape, _settings(world_size=8, gpu_memory_utilization=0.9), GPU80)
    (fix,) = [f for n, _, _, f in mm.problems(est, GPU80, longest=16384) if n == "rollout"]
    utilisation = float(fix.split("at most ")[1])
    assert 0.3 <= utilisation < 0.9
    assert mm.fits(_pass(mm.estimate(shape, _settings(world_size=8, gpu_memory_utilization=utilisation), GPU80),
                         "rollout"), GPU80)
    # the next step up (0.05) does not: the largest that fits
    assert not mm.fits(_pass(mm.estimate(shape, _settings(world_size=8, gpu_memory_utilization=utilisation + 0.05),
                                         GPU80), "rollout"), GPU80)


# ------------------------------------------------------------------------------------------------
# the terms verl 0.9.1 allocates (docs/memory.md cites the code of each)
# ------------------------------------------------------------------------------------------------


def _paper(model: str, method: str, *overrides: str, nnodes: int = 8):
    return compose([f"method={method}", f"model={model}", f"trainer.nnodes={nnodes}", "trainer.n_gpus_per_node=8",
                    *overrides])


_SIZES = {"qwen3_1_7b": "qwen3-1.7b", "qwen3_8b": "qwen3-8b", "qwen3_14b": "qwen3-14b"}


@pytest.mark.parametrize("model", sorted(_SIZES))
@pytest.mark.parametrize("nnodes", [8, 1])
def test_grpo_peak_exceeds_justrls_by_the_reference_root_unit(model, nnodes):
    """GRPO's reference model keeps its unsharded root unit (FSDP1, fsdp_size=-1) through every later
    pass, the rollout (both runs' peak) included: 0.6 / 2.3 / 2.9 GiB for 1.7B / 8B / 14B."""
    shape = mm.BUILTIN_SHAPES[_SIZES[model]]
    grpo = mm.estimate(shape, mm.settings_from_config(_paper(model, "grpo", nnodes=nnodes)), GPU80)
    justrl = mm.estimate(shape, mm.settings_from_config(_paper(model, "justrl", nnodes=nnodes)), GPU80)
    root = mm.reference_root_bytes(shape, grpo.settings)
    assert root == 2 * shape.embedding_params
    assert round(root / mm.GIB, 1) == {"qwen3_1_7b": 0.6, "qwen3_8b": 2.3, "qwen3_14b": 2.9}[model]
    assert grpo.peak.name == justrl.peak.name == "rollout"
    assert grpo.peak.total - justrl.peak.total == pytest.approx(root)
    for p in grpo.passes:
        assert p.components["reference root unit (unsharded)"] == root, p.name


def test_reference_root_is_resharded_when_verl_reshards_it():
    """verl's eval context reshards the root itself when fsdp_size > 1; FSDP2 is not this term."""
    for override in ("actor_rollout_ref.ref.fsdp_config.fsdp_size=8", "actor_rollout_ref.ref.strategy=fsdp2"):
        settings = mm.settings_from_config(_paper("qwen3_8b", "grpo", override))
        assert settings.ref_tokens is not None and not settings.reference_root_resident, override
        est = mm.estimate(mm.BUILTIN_SHAPES["qwen3-8b"], settings, GPU80)
        assert all("reference root unit (unsharded)" not in p.components for p in est.passes)


def test_entropy_in_the_update_writes_the_logits_gradient_beside_the_logits():
    """20-Entropy's authors' code reading (micro-batch scope, current statistics) needs the update's
    entropy: verl then calls its log-prob kernel with inplace_backward=False, +T V b (9.3 GiB at 32,768)."""
    config = _paper("qwen3_8b", "entropy20", "actor_rollout_ref.actor.policy_loss.entropy_topk_reading=authors_code")
    settings = mm.settings_from_config(config)
    assert settings.update_entropy and not settings.update_entropy_grad
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    update = _pass(mm.estimate(shape, settings, GPU80), "update")
    assert update.components["logits gradient (not in place)"] == 32768 * 151936 * 2
    assert round(update.components["logits gradient (not in place)"] / mm.GIB, 1) == 9.3
    plain = _pass(mm.estimate(shape, replace(settings, update_entropy=False), GPU80), "update")
    assert "logits gradient (not in place)" not in plain.components
    assert update.total - plain.total == pytest.approx(32768 * 151936 * 2 + 12 * 2048 * 151936)


def test_no_sync_gradient_accumulation_keeps_the_unsharded_gradients_and_the_fix_names_it():
    """use_no_sync_for_gradient_accumulation=true: every layer's bf16 gradient stays unsharded across
    micro-batches, +2 P bytes (15 GiB for 8B); the preflight's fix turns it off when that fits."""
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    off = mm.settings_from_config(_paper("qwen3_8b", "justrl", nnodes=1))
    on = mm.settings_from_config(_paper("qwen3_8b", "justrl",
                                        "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=true",
                                        nnodes=1))
    assert on.no_sync_gradients and not off.no_sync_gradients
    a, b = mm.estimate(shape, off, GPU80), mm.estimate(shape, on, GPU80)
    for name in ("update", "update_end"):
        assert _pass(b, name).total - _pass(a, name).total == pytest.approx(2 * shape.params)
    assert round(2 * shape.params / mm.GIB) == 15
    without = _pass(a, "update")
    small = without.total + mm.margin_bytes(without) + 1 * mm.GIB  # fits without the 15 GiB, not with them
    est = mm.estimate(shape, on, small)
    (fix,) = [f for n, _, _, f in mm.problems(est, small, longest=16384) if n == "update"]
    assert "use_no_sync_for_gradient_accumulation=false" in fix
    assert mm.fits(_pass(mm.estimate(shape, replace(est.settings, no_sync_gradients=False), small), "update"), small)


def test_no_grad_passes_count_the_logits_side_not_the_freed_layer_activations():
    """The layers' tensors are freed before the LM head: a log-prob pass's peak is the logits side
    (final hidden states, logits, outputs, temporaries), not that plus the activations."""
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    p = _pass(mm.estimate(shape, _settings(), GPU80), "log_prob")
    assert "activations (no grad)" not in p.components
    assert p.components["final hidden states"] == 49152 * 4096 * 2
    # a tiny vocabulary: the layers' working set is the larger, and only it is counted
    small_vocab = replace(shape, vocab_size=1000)
    q = _pass(mm.estimate(small_vocab, _settings(), GPU80), "log_prob")
    assert q.components["activations (no grad)"] == 49152 * (4 * 4096 + 3 * 12288) * 2
    assert "logits" not in q.components


def test_update_counts_layer_gradient_buffers_and_the_final_norms_float32_copy():
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    update = _pass(mm.estimate(shape, _settings(update_tokens=32768), GPU80), "update").components
    # one layer's bf16 gradient and its float32 copy for the reduce-scatter: 1.1 GiB for 8B
    assert update["layer gradients (unsharded + fp32 copy)"] == 6 * shape.layer_params
    assert round(6 * shape.layer_params / mm.GIB, 1) == 1.1
    # checkpointed inputs: L h b, the final norm's input and output (2 h b) and its float32 copy (4 h)
    assert update["checkpointed layer inputs, final norm"] == 32768 * (36 * 4096 * 2 + 2 * 4096 * 2 + 4 * 4096)
    per_layer = (2 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 12288) * 2
    assert update["layer recompute + backward"] == pytest.approx(32768 * mm.LAYER_BACKWARD_FACTOR * per_layer)


def test_monitor_and_update_effect_forwards_come_from_the_policy_loss_dataclass():
    """The decisions are the policy-loss dataclass's: the S2T monitor's current-policy forward in a
    JustRL run, the update effect's forward of its measured responses."""
    monitored = mm.settings_from_config(_paper("qwen3_8b", "justrl", "actor_rollout_ref.actor.policy_loss.stats_from=current"))
    assert monitored.current_tokens == monitored.log_prob_tokens == 49152
    plain = mm.settings_from_config(_paper("qwen3_8b", "justrl"))
    assert plain.current_tokens is None and plain.update_effect_tokens is None
    effect = mm.settings_from_config(_paper("qwen3_8b", "stapo", "actor_rollout_ref.actor.policy_loss.update_effect_responses=2"))
    assert effect.update_effect_tokens == 2 * 16384
    assert "update_effect" in {p.name for p in mm.estimate(mm.BUILTIN_SHAPES["qwen3-8b"], effect, GPU80).passes}


def test_chunk_sizes_are_the_ones_the_code_uses():
    """The model's chunk sizes are copies: of the recipe's sum of squares and of verl's entropy
    (its function's default and its config's)."""
    import inspect

    from verl.utils.torch_functional import entropy_from_logits_with_chunking

    from verl_patches import sum_pi_squared

    assert mm.SUM_PI_SQUARED_CHUNK_ROWS == sum_pi_squared.CHUNK_ROWS
    assert mm.ENTROPY_CHUNK_ROWS == inspect.signature(entropy_from_logits_with_chunking).parameters["chunk_size"].default
    config = _paper("qwen3_8b", "stapo")
    assert config.actor_rollout_ref.actor.entropy_from_logits_chunk_size == mm.ENTROPY_CHUNK_ROWS
    assert mm.settings_from_config(config).entropy_chunk == mm.ENTROPY_CHUNK_ROWS


# ------------------------------------------------------------------------------------------------
# capacity, margin and advice
# ------------------------------------------------------------------------------------------------


def test_capacity_is_what_cuda_reports_and_the_margin_refuses_a_pass_at_the_limit(monkeypatch):
    monkeypatch.delenv("GPU_MEM_GB", raising=False)
    assert float(_paper("qwen3_8b", "stapo").recipe.gpu_mem_gb) == mm.DEFAULT_GPU_MEM_GIB == 79.1
    assert mm.GPU_CAPACITY_GIB["A100 / A800 / H100 / H800 80GB"] == mm.DEFAULT_GPU_MEM_GIB
    # a pass within the capacity but inside its margin is TIGHT, and a problem
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    est = mm.estimate(shape, mm.settings_from_config(_paper("qwen3_14b", "justrl", nnodes=1)), GPU80)
    rollout = _pass(est, "rollout")
    at_limit = rollout.total + 0.5 * mm.margin_bytes(rollout)
    est_at_limit = mm.estimate(shape, est.settings, at_limit)
    assert mm.verdict(_pass(est_at_limit, "rollout"), at_limit) in ("TIGHT", "DOES NOT FIT")
    assert "rollout" in [n for n, *_ in mm.problems(est_at_limit, at_limit, longest=16384)]


@pytest.mark.parametrize("method, expected", [("justrl", 0.60), ("grpo", 0.55)])
def test_14b_on_one_node_is_refused_and_the_suggested_utilisation_fits(method, expected):
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    est = mm.estimate(shape, mm.settings_from_config(_paper("qwen3_14b", method, nnodes=1)), GPU80)
    (name, setting, _, fix), = mm.problems(est, GPU80, longest=16384)
    assert (name, setting) == ("rollout", "actor_rollout_ref.rollout.gpu_memory_utilization")
    suggested = float(fix.split("at most ")[1].split()[0])
    assert suggested == expected
    fixed = mm.estimate(shape, replace(est.settings, gpu_memory_utilization=suggested), GPU80)
    assert mm.problems(fixed, GPU80, longest=16384) == []
    # a card taken for 79.6 or even 80 GiB does not let the default through either
    for gib in (79.6, 80.0):
        assert "rollout" in [n for n, *_ in mm.problems(mm.estimate(shape, est.settings, gib * mm.GIB), gib * mm.GIB,
                                                        longest=16384)]


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b"])
@pytest.mark.parametrize("method", ["grpo", "justrl", "stapo", "entropy20"])
def test_1_7b_and_8b_fit_one_node_as_shipped(model, method):
    est = mm.estimate(mm.BUILTIN_SHAPES[_SIZES[model]], mm.settings_from_config(_paper(model, method, nnodes=1)), GPU80)
    assert mm.problems(est, GPU80, longest=16384) == [], mm.table(est, GPU80)


def test_when_no_budget_fits_only_offload_or_more_gpus_is_suggested_and_it_fits():
    """14B on one GPU with offload: the update's token-independent part alone exceeds the GPU, so no
    budget or sequence parallel size helps; the fix says so first and names a node count that fits."""
    shape = mm.BUILTIN_SHAPES["qwen3-14b"]
    settings = _settings(world_size=1, param_offload=True, optimizer_offload=True, update_tokens=16384,
                         log_prob_tokens=32768, current_tokens=None)
    est = mm.estimate(shape, settings, GPU80)
    update = _pass(est, "update")
    fixed_part = update.total - update.bytes_per_token * update.tokens
    assert fixed_part > GPU80
    (fix,) = [f for n, _, _, f in mm.problems(est, GPU80, longest=16384, gpus_per_node=8) if n == "update"]
    assert fix.startswith("only offload or more GPUs make it fit") and "ulysses" not in fix and "lower" not in fix
    world = int(fix.split("use at least ")[1].split()[0])
    assert mm.fits(_pass(mm.estimate(shape, replace(settings, world_size=world), GPU80), "update"), GPU80)
    assert not mm.fits(_pass(mm.estimate(shape, replace(settings, world_size=world // 2), GPU80), "update"), GPU80)


def test_every_budget_fix_is_re_estimated_before_it_is_suggested():
    """A budget the pass cannot fit even at its floor (the longest sequence) is not suggested; a larger
    sequence parallel size is, with a budget that fits."""
    shape = mm.BUILTIN_SHAPES["qwen3-8b"]
    est = mm.estimate(shape, _settings(world_size=8, log_prob_tokens=131072, current_tokens=None), 40 * mm.GIB)
    (fix,) = [f for n, _, _, f in mm.problems(est, 40 * mm.GIB, longest=65536) if n == "log_prob"]
    assert "ulysses_sequence_parallel_size=" in fix and not fix.startswith("lower")
    sp = int(fix.split("ulysses_sequence_parallel_size=")[1].split()[0])
    budget = int(fix.split("at most ")[1].split()[0])
    assert budget >= 65536 // sp
    assert mm.fits(_pass(mm.estimate(shape, replace(est.settings, log_prob_tokens=budget), 40 * mm.GIB),
                         "log_prob"), 40 * mm.GIB)


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "run_scripts").glob("qwen3_*_*.sh")))
def test_the_one_node_settings_each_run_script_names_fit(script):
    """Each paper run script names its one-node settings; the model accepts them, and needs them
    (the 14B without its lower utilisation is refused)."""
    import re

    text = (REPO / "run_scripts" / script).read_text()
    (line,) = re.findall(r"^#   NNODES=1(.*)$", text, flags=re.M)
    overrides = re.findall(r"(actor_rollout_ref\.\S+=\S+)", line)
    method, model = re.search(r'common\.sh" (\w+) (qwen3_\w+)', text).groups()
    shape = mm.BUILTIN_SHAPES[_SIZES[model]]
    est = mm.estimate(shape, mm.settings_from_config(_paper(model, method, *overrides, nnodes=1)), GPU80)
    assert mm.problems(est, GPU80, longest=16384) == [], mm.table(est, GPU80)
    if overrides:
        bare = mm.estimate(shape, mm.settings_from_config(_paper(model, method, nnodes=1)), GPU80)
        assert mm.problems(bare, GPU80, longest=16384) != []
