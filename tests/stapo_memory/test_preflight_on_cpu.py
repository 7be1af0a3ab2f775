"""The preflight's memory check (``stapo_memory.preflight``) and context check
(``recipe.stapo.preflight.context``) through the whole driver, on a stand-in for the cluster's
storage: the model's config.json read whole (a bad field refused by its name, a Mixture-of-Experts
model refused as not estimated), prompt + response within the context vLLM serves, and memory advice
that the preflight itself accepts."""

from __future__ import annotations

import functools
import json
import re

import pytest

from recipe.stapo.driver import compose, ensure_loss_statistics, prepare
from recipe.stapo.preflight import PreflightError
from recipe.stapo.preflight.context import model_path
from stapo_memory import advice
from stapo_memory import model as mm
from stapo_memory import preflight as memory_check
from stapo_memory.shape import builtin_shape
from tests.helpers.cluster_files import QWEN3_CONFIGS, use_fake_cluster, write_model
from tests.helpers.paths import REPO

ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
PL = f"{ACTOR}.policy_loss"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    folders = use_fake_cluster(tmp_path / "shared", monkeypatch)
    monkeypatch.chdir(tmp_path)
    return folders


def run(cluster, *overrides: str, method: str = "stapo", model: str = "qwen3_8b", nnodes: int = 8):
    config = compose([f"method={method}", f"model={model}", f"trainer.nnodes={nnodes}", "trainer.n_gpus_per_node=8",
                      "trainer.logger=[console]", f"trainer.default_local_dir={cluster['ckpt']}/{model}_{method}",
                      *overrides])
    logged = []
    prepare(config, log=logged.append, environ={})
    return "\n".join(logged)


def refused(cluster, *overrides: str, **kw) -> PreflightError:
    with pytest.raises(PreflightError) as info:
        run(cluster, *overrides, **kw)
    return info.value


def _model(cluster, name: str, config: dict) -> str:
    return str(write_model(cluster["models"] / name, config))


# ------------------------------------------------------------------------------------------------
# config.json, read whole
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, phrase", [
    ("num_key_value_heads", 5, "5 does not divide num_attention_heads=32"),
    ("num_hidden_layers", 0, "0 must be at least 1"),
    ("vocab_size", 1, "1 must be at least 2"),
    ("hidden_size", -4096, "-4096 must be at least 1"),
    ("intermediate_size", 12288.5, "12288.5 is not a whole number"),
])
def test_a_bad_shape_field_is_refused_by_its_name(cluster, field, value, phrase):
    path = _model(cluster, "Bad-8B", {**QWEN3_CONFIGS["Qwen3-8B-Base"], field: value})
    err = refused(cluster, f"actor_rollout_ref.model.path={path}")
    (problem,) = [str(p) for p in err.problems if field in p.key]
    assert problem.startswith(f"{path}/config.json: {field}: {phrase}") and "Fix: " in problem
    assert "no readable config.json" not in str(err)


def test_a_mixture_of_experts_model_is_refused_as_not_estimated_and_warn_lets_it_run(cluster):
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
           "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960}
    path = _model(cluster, "Qwen3-30B-A3B-Base", moe)
    err = refused(cluster, f"actor_rollout_ref.model.path={path}")
    (problem,) = [str(p) for p in err.problems if p.key.startswith("GPU memory")]
    assert "not estimated: num_experts=128: a Mixture-of-Experts model (about 30.5B parameters" in problem
    assert "recipe.memory_check=warn" in problem and "GPU memory per GPU" not in str(err)
    logged = run(cluster, f"actor_rollout_ref.model.path={path}", "recipe.memory_check=warn")
    assert "GPU memory not estimated" in logged and "num_experts=128" in logged


# ------------------------------------------------------------------------------------------------
# the context vLLM serves
# ------------------------------------------------------------------------------------------------


def test_prompt_and_response_beyond_max_position_embeddings_are_refused(cluster):
    path = _model(cluster, "Short-8B", {**QWEN3_CONFIGS["Qwen3-8B-Base"], "max_position_embeddings": 8192})
    err = refused(cluster, f"actor_rollout_ref.model.path={path}", "recipe.memory_check=off")
    (problem,) = [str(p) for p in err.problems if p.key == "data.max_response_length"]
    assert "1024 + 15360 = 16384 tokens exceed the model's max_position_embeddings=8192" in problem
    assert "set data.max_response_length to at most 7168" in problem
    run(cluster, f"actor_rollout_ref.model.path={path}", "data.max_response_length=7168",
        f"{ACTOR}.ppo_max_token_len_per_gpu=16384")
    err = refused(cluster, f"actor_rollout_ref.model.path={path}", "recipe.memory_check=off",
                  "data.max_prompt_length=8192")  # the prompt alone fills the context: no response length fits
    (problem,) = [str(p) for p in err.problems if p.key == "data.max_response_length"]
    assert "set data.max_prompt_length below 8192, leaving room for the responses" in problem
    assert "at most -" not in problem and "at most 0" not in problem


def test_rollout_max_model_len_is_checked_against_the_model_and_the_lengths(cluster):
    err = refused(cluster, f"{ROLLOUT}.max_model_len=65536")
    (problem,) = [str(p) for p in err.problems if p.key == f"{ROLLOUT}.max_model_len"]
    assert "above the model's max_position_embeddings=32768" in problem
    err = refused(cluster, f"{ROLLOUT}.max_model_len=12000")
    (problem,) = [str(p) for p in err.problems if p.key == "data.max_response_length"]
    assert f"exceed {ROLLOUT}.max_model_len=12000" in problem
    run(cluster, f"{ROLLOUT}.max_model_len=16384")


def test_a_config_without_max_position_embeddings_is_refused(cluster):
    config = {k: v for k, v in QWEN3_CONFIGS["Qwen3-8B-Base"].items() if k != "max_position_embeddings"}
    path = _model(cluster, "NoContext-8B", config)
    err = refused(cluster, f"actor_rollout_ref.model.path={path}")
    assert any(p.key == f"{path}/config.json: max_position_embeddings" for p in err.problems), str(err)


def test_verl_validates_with_the_rollouts_one_response_length():
    """What the trainer YAML says of the validation length, read from verl 0.9.1's code: val_kwargs
    has no length; the agent loop builds validation's sampling parameters from val_kwargs' temperature,
    top-p and top-k only; the vLLM server gives a request without max_tokens the rollout's
    response_length (data.max_response_length) and never more than max_model_len minus the prompt; the
    single-turn agent loop cuts every response to response_length."""
    import dataclasses
    import inspect

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.workers.config.rollout import SamplingConfig
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    assert {f.name for f in dataclasses.fields(SamplingConfig)} == {"_target_", "temperature", "top_k", "top_p",
                                                                   "do_sample", "n"}
    sampling = inspect.getsource(AgentLoopWorker.generate_sequences)
    validation = sampling.split("if validate:", 1)[1].split("\n\n", 1)[0]
    assert "val_kwargs.temperature" in validation and "max_tokens" not in sampling
    server = inspect.getsource(vLLMHttpServer.generate)
    assert "self.config.response_length" in server and "max_possible_tokens = self.config.max_model_len" in server
    assert "response_ids[: self.response_length]" in inspect.getsource(SingleTurnAgentLoop.run)


def test_the_override_that_gives_justrls_validation_length_passes_as_the_yaml_states(cluster):
    """``data.max_response_length=31744``: 1024 + 31744 = 32,768, the Qwen3 base models' context, the
    longest the context check lets through; as the trainer YAML states, 1.7B and 8B pass with nothing
    else, 14B also needs an update budget of one sequence (and its update is then 37.7 GiB per GPU)."""
    yaml = (REPO / "recipe" / "stapo" / "config" / "stapo_trainer.yaml").read_text()
    assert "data.max_response_length=31744" in yaml
    (budget,) = re.findall(r"(actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu=\d+), its update ([0-9.]+) GiB", yaml)
    for model in ("qwen3_1_7b", "qwen3_8b"):
        run(cluster, "data.max_response_length=31744", model=model)
    err = refused(cluster, "data.max_response_length=31744", model="qwen3_14b")
    assert any(p.key == f"{ACTOR}.ppo_max_token_len_per_gpu" for p in err.problems)
    logged = run(cluster, "data.max_response_length=31744", budget[0], model="qwen3_14b")
    (update,) = [line for line in logged.splitlines() if line.startswith("  update ")]
    assert update.split()[1] == budget[1] and " ok " in update
    err = refused(cluster, "data.max_response_length=31745", f"{ACTOR}.ppo_max_token_len_per_gpu=32769",
                  model="qwen3_1_7b")
    assert any(p.key == "data.max_response_length" for p in err.problems)


# ------------------------------------------------------------------------------------------------
# advice the preflight accepts
# ------------------------------------------------------------------------------------------------


def _advised(text: str) -> list[str]:
    return text.split("run with ", 1)[1].split(" (", 1)[0].split(" or with ")[0].split()


@pytest.mark.parametrize("gpu_mem_gb", [39.4, 44.4])
def test_stapo_8b_on_one_node_of_40_or_48gb_cards_gets_a_plan_that_passes(cluster, gpu_mem_gb):
    """No passing path before: sequence parallelism (refused with stats_from=current), then a budget
    below one sequence. Now: vLLM's share and the budgets, every one at least a sequence."""
    err = refused(cluster, f"recipe.gpu_mem_gb={gpu_mem_gb}", nnodes=1)
    (first,) = [str(p) for p in err.problems if "GPU memory" in p.key and "run with" in str(p)]
    advice = _advised(first)
    assert not any("ulysses" in o for o in advice)
    assert all(int(o.split("=")[1]) >= 16384 for o in advice if "max_token_len" in o)
    logged = run(cluster, f"recipe.gpu_mem_gb={gpu_mem_gb}", *advice, nnodes=1)
    assert "preflight passed" in logged and "DOES NOT FIT" not in logged and "TIGHT" not in logged


def test_stapo_8b_with_micro_batch_scope_on_one_80gb_node_passes_as_its_table_says(cluster):
    """The update's entropy (scope=micro_batch) on one node of 80 GB cards: every printed row ok, and
    the preflight passes."""
    logged = run(cluster, f"{PL}.scope=micro_batch", nnodes=1)
    rows = [line for line in logged.splitlines() if re.match(r"  [a-z_]+ +[0-9.]+ \+", line)]
    assert len(rows) == 5  # rollout, log_prob, update, update_end, optimizer_step
    assert rows and all(" ok " in row for row in rows), logged
    assert "preflight passed" in logged


def test_a_plan_the_whole_preflight_refuses_is_never_printed(cluster, monkeypatch):
    """Each plan is run through the whole preflight: one it refuses (sequence parallelism with STAPO's
    current-policy statistics) is skipped, the next that passes is printed."""
    real = advice.plans
    shown = []

    def plans(shape, s, gpu, gpus_per_node=8, max_gpus=512):
        sp = advice.Plan("settings", {f"{ACTOR}.ulysses_sequence_parallel_size": 2,
                                      f"{ACTOR}.ppo_max_token_len_per_gpu": 8192}, mm.estimate(shape, s, gpu))
        shown.append(sp)
        yield sp
        yield from real(shape, s, gpu, gpus_per_node, max_gpus)

    monkeypatch.setattr(advice, "plans", plans)
    err = refused(cluster, "recipe.gpu_mem_gb=39.4", nnodes=1)
    assert shown, "the candidate was offered"
    text = str(err)
    assert "ulysses_sequence_parallel_size=2" not in text
    assert f"run with {ROLLOUT}.gpu_memory_utilization=0.5" in text


def test_where_nothing_but_more_gpus_fits_it_says_so_first(cluster):
    err = refused(cluster, "recipe.gpu_mem_gb=39.4", nnodes=1, model="qwen3_14b")
    (first,) = [str(p) for p in err.problems if "GPU memory" in p.key and "make it fit: run with" in str(p)]
    assert "Fix: only offload or more GPUs make it fit: run with trainer.nnodes=" in first
    logged = run(cluster, "recipe.gpu_mem_gb=39.4", *_advised(first), nnodes=1, model="qwen3_14b")
    assert "preflight passed" in logged


def test_advice_is_only_computed_in_the_outermost_preflight(cluster, monkeypatch):
    """The candidates' preflight runs give no advice of their own (no recursion)."""
    calls = []
    real = memory_check.verified_plans

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(memory_check, "verified_plans", counting)
    refused(cluster, "recipe.gpu_mem_gb=39.4", nnodes=1)
    assert len(calls) == 1


def test_config_json_parse_errors_are_named(cluster):
    folder = cluster["models"] / "Broken-8B"
    write_model(folder, {})
    (folder / "config.json").write_text("{not json")
    err = refused(cluster, f"actor_rollout_ref.model.path={folder}")
    assert any(p.key == f"{folder}/config.json" and "not JSON" in p.problem for p in err.problems), str(err)
    (folder / "config.json").write_text(json.dumps([1, 2]))
    err = refused(cluster, f"actor_rollout_ref.model.path={folder}")
    assert any("not a JSON object" in str(p) for p in err.problems), str(err)


# ------------------------------------------------------------------------------------------------
# far from fitting, inside the margin only, room to spare
# ------------------------------------------------------------------------------------------------


def _memory_fixes(err: PreflightError) -> list[str]:
    return [p.fix for p in err.problems if p.key.startswith("GPU memory")]


@functools.lru_cache(maxsize=None)
def _run_settings(model: str, nnodes: int, response: int = 15360) -> tuple[mm.ModelShape, mm.Settings]:
    config = compose([f"model={model}", "method=stapo", f"trainer.nnodes={nnodes}", "trainer.n_gpus_per_node=8",
                      f"data.max_response_length={response}"])
    ensure_loss_statistics(config, log=lambda _: None)
    return builtin_shape(model_path(config)), mm.settings_from_config(config)


def _floor(model: str, gpu_mem_gb: float, nnodes: int, response: int = 15360) -> mm.Estimate:
    """The run at its least (every budget at one sequence, vLLM's share at its least), by the model."""
    shape, settings = _run_settings(model, nnodes, response)
    gpu = gpu_mem_gb * mm.GIB
    return mm.estimate(shape, advice.one_sequence(shape, settings, gpu), gpu)


@pytest.mark.parametrize("nnodes", [8, 32])
def test_qwen3_8b_on_16gb_cards_states_the_floor_and_the_levers_in_order(cluster, nnodes):
    """64 or 256 cards of 14.6 GiB (a 16 GB card as CUDA reports it): no change the preflight makes
    fits, so instead of advice the refusal states what a GPU needs at one 16,384-token sequence per
    micro-batch, then shorter responses, a larger card, offload, in that order; the other passes
    point at it. The larger card it names runs the run at one sequence."""
    err = refused(cluster, "recipe.gpu_mem_gb=14.6", nnodes=nnodes)
    first, *others = _memory_fixes(err)
    floor = _floor("qwen3_8b", 14.6, nnodes)
    need = max(p.total + mm.margin_bytes(p) for p in floor.passes)
    assert first.startswith("no setting the preflight can change makes it fit, nor more GPUs: with one 16384-token "
                            f"sequence per micro-batch and vLLM's share at its least (0.7) a GPU still needs "
                            f"{mm.gib(need)} GiB with the estimate's margin (pass 'update'), more than the 14.6 GiB")
    levers = first.split("What can, by the estimate and in this order: ", 1)[1]
    assert levers.index("not shorter responses: at 1024-token ones") < levers.index("a larger card: ") \
        < levers.index("not offload: pass 'update' holds the actor's whole state")
    assert "run with" not in first and others and all("says what can" in f for f in others)
    card = float(re.search(r"a larger card: ([0-9.]+) GiB as CUDA reports it fits at one sequence", levers).group(1))
    on_card = _floor("qwen3_8b", card, nnodes)
    least = [f"{ROLLOUT}.gpu_memory_utilization={on_card.settings.gpu_memory_utilization}",
             f"{ACTOR}.ppo_max_token_len_per_gpu=16384", f"{ROLLOUT}.log_prob_max_token_len_per_gpu=16384"]
    assert "preflight passed" in run(cluster, f"recipe.gpu_mem_gb={card}", *least, nnodes=nnodes)
    refused(cluster, f"recipe.gpu_mem_gb={card - 0.1:.1f}", *least, nnodes=nnodes)
    if nnodes == 32:  # more cards lower it by the sharded state they split
        assert need < max(p.total + mm.margin_bytes(p) for p in _floor("qwen3_8b", 14.6, 8).passes)
    doc = " ".join((REPO / "docs" / "memory.md").read_text().split())
    assert (f"{mm.gib(need)} GiB per GPU on 64 of them" if nnodes == 8 else f"and {mm.gib(need)} on 256") in doc


def test_shorter_responses_come_first_where_they_fit(cluster):
    """Qwen3-1.7B on 13 GiB cards, 64 of them: the response length the refusal names runs with every
    budget at one sequence; 1,024 tokens more does not."""
    err = refused(cluster, "recipe.gpu_mem_gb=13", model="qwen3_1_7b")
    (first, *_) = _memory_fixes(err)
    response, longest = map(int, re.search(r"What can, by the estimate and in this order: shorter responses: "
                                           r"data.max_response_length=(\d+) fits with every budget at one "
                                           r"(\d+)-token sequence; a larger card", first).groups())
    assert longest == response + 1024

    def at(response: int) -> list[str]:
        floor = _floor("qwen3_1_7b", 13, 8, response)
        return [f"data.max_response_length={response}", "recipe.gpu_mem_gb=13",
                f"{ROLLOUT}.gpu_memory_utilization={floor.settings.gpu_memory_utilization}",
                *[f"{k}={response + 1024}" for k in (f"{ACTOR}.ppo_max_token_len_per_gpu",
                                                      f"{ROLLOUT}.log_prob_max_token_len_per_gpu")]]

    assert "preflight passed" in run(cluster, *at(response), model="qwen3_1_7b")
    refused(cluster, *at(response + 1024), model="qwen3_1_7b")


def test_a_run_that_fits_only_inside_the_margin_says_so(cluster):
    """Qwen3-8B on 21.3 GiB cards, 64 of them: at one sequence it needs more than the card with the
    margin but not without; the refusal says so, and the changes it names pass."""
    err = refused(cluster, "recipe.gpu_mem_gb=21.3")
    (first, *_) = _memory_fixes(err)
    assert ", though not without it: run with " in first
    named = first.split(", though not without it: run with ", 1)[1].split(" to run inside the margin")[0].split()
    assert named[-1] == "recipe.memory_accept_tight=true"
    logged = run(cluster, "recipe.gpu_mem_gb=21.3", *named)
    assert "preflight passed" in logged and "DOES NOT FIT" not in logged and "TIGHT" in logged


def test_advice_is_verified_apart_from_problems_the_config_already_has(cluster):
    """Qwen3-8B on 256 cards of 24 GB (22.0 GiB as CUDA reports an L4's), its training data missing: the
    plan that fits is still named (checked against every problem but the missing file), not 'no
    setting'; with the data there, it passes."""
    missing = f"data.train_files={cluster['data']}/missing.parquet"
    err = refused(cluster, "recipe.gpu_mem_gb=22", missing, nnodes=32)
    assert any(p.key == "data.train_files" for p in err.problems)
    (first, *_) = _memory_fixes(err)
    assert first.startswith("run with ") and "no setting" not in first
    assert "preflight passed" in run(cluster, "recipe.gpu_mem_gb=22", *_advised(first), nnodes=32)


def test_a_card_with_room_to_spare_names_what_the_room_buys(cluster):
    """Qwen3-8B on 141 GB cards (139.8 GiB), 64 of them: the table names the largest vLLM share and
    budgets with which every pass fits (the update's capped at the mini-batch a GPU gets: 64 prompts x 8
    responses x 16,384 tokens / 64 GPUs); with them the preflight passes, and one step more does not."""
    logged = run(cluster, "recipe.gpu_mem_gb=139.8")
    (room,) = [line for line in logged.splitlines() if line.startswith("  room to spare: ")]
    named = dict(o.split("=") for o in room.split("still fits with ", 1)[1].split(": ", 1)[0].split())
    assert named[f"{ROLLOUT}.gpu_memory_utilization"] == "0.9"
    assert named[f"{ACTOR}.ppo_max_token_len_per_gpu"] == str(64 * 8 * 16384 // 64)
    assert "vLLM's share 125.8 GiB instead of 97.9" in room
    assert "8 longest sequences instead of 2: the whole mini-batch a GPU gets" in room
    log_prob = int(named[f"{ROLLOUT}.log_prob_max_token_len_per_gpu"])
    with_room = run(cluster, "recipe.gpu_mem_gb=139.8", *[f"{k}={v}" for k, v in named.items()])
    assert "preflight passed" in with_room and "TIGHT" not in with_room and "room to spare" not in with_room
    doc = " ".join((REPO / "docs" / "memory.md").read_text().split())  # docs/memory.md says the same
    share = re.search(r"vLLM's share ([0-9.]+) GiB instead of ([0-9.]+)", room).groups()
    assert f"vLLM at 0.9 (a {share[0]} GiB share instead of {share[1]}" in doc
    assert f"the whole mini-batch a GPU gets ({int(named[f'{ACTOR}.ppo_max_token_len_per_gpu']):,} tokens)" in doc
    refused(cluster, "recipe.gpu_mem_gb=139.8", f"{ROLLOUT}.gpu_memory_utilization=0.95")
    refused(cluster, "recipe.gpu_mem_gb=139.8", f"{ROLLOUT}.log_prob_max_token_len_per_gpu={log_prob + 1024}")
