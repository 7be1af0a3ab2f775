"""The recipe's Hydra configs: methods differ only where the spec says, run scripts compose to
valid verl configs, bad overrides fail with clear messages."""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recipe.stapo.driver import MODELS, compose, prepare
from recipe.stapo.methods import PAPER_METHODS
from stapo_core import DEFAULT_Q, DEFAULT_TAU_P
from verl.utils.config import omega_conf_to_dataclass
from tests.helpers.cluster_files import fake_cluster
from tests.helpers.paths import REPO
from tests.helpers.verl_validation import validate

PL = "actor_rollout_ref.actor.policy_loss"
ACTOR = "actor_rollout_ref.actor"


def flat(cfg) -> dict:
    """Leaf keys of a composed config, interpolations left unresolved (they name the same thing)."""
    out = {}

    def walk(node, prefix):
        container = OmegaConf.to_container(node, resolve=False) if not isinstance(node, (dict, list)) else node
        items = container.items() if isinstance(container, dict) else enumerate(container)
        if not container:
            out[prefix] = container
        for k, v in items:
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (dict, list)) and v:
                walk(v, key)
            else:
                out[key] = v

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


# What the spec (sections 4-5) lets each method change relative to JustRL, beyond its name. Every
# method shares the policy-loss class (the recipe's TokenSelectionLossConfig, token selection none
# unless the method sets it) and the S2T monitor, so neither is a difference.
ALLOWED_VS_JUSTRL = {
    "stapo": {f"{PL}.token_selection", f"{PL}.tau_p", f"{PL}.q", f"{PL}.strategy", f"{PL}.stats_from",
              f"{PL}.scope", f"{PL}.current_forward", f"{PL}.sequence_ratio", f"{PL}.seed"},
    "entropy20": {f"{PL}.token_selection", f"{PL}.entropy_top_ratio", f"{PL}.stats_from", f"{PL}.scope",
                  f"{PL}.sequence_ratio"},
    "grpo": {f"{ACTOR}.loss_agg_mode", f"{ACTOR}.clip_ratio_high", f"{ACTOR}.clip_ratio_c", f"{ACTOR}.use_kl_loss",
             f"{ACTOR}.kl_loss_coef", f"{ACTOR}.kl_loss_type"},
    "justrl": set(),
}


@pytest.fixture(scope="module")
def composed():
    return {m: compose([f"method={m}", "model=qwen3_8b"]) for m in PAPER_METHODS}


@pytest.mark.parametrize("a, b", list(itertools.combinations(PAPER_METHODS, 2)))
def test_methods_differ_only_where_the_spec_says(composed, a, b):
    fa, fb = flat(composed[a]), flat(composed[b])
    differing = {k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>")}
    differing -= {"recipe.method"}  # what names the method
    allowed = ALLOWED_VS_JUSTRL[a] | ALLOWED_VS_JUSTRL[b]
    assert differing <= allowed, f"{a} vs {b}: unexpected differences {sorted(differing - allowed)}"
    assert differing, f"{a} and {b} compose to the same config"


def test_shared_settings_are_the_papers(composed):
    for method, cfg in composed.items():
        a = cfg.actor_rollout_ref.actor
        assert (a.optim.lr, a.optim.lr_warmup_steps, a.optim.clip_grad, a.optim.weight_decay) == (1e-6, 10, 1.0, 0.1)
        assert a.optim.lr_scheduler_type == "constant"
        assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, a.ppo_mini_batch_size) == (256, 8, 64)
        assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, 15360)
        assert a.ppo_micro_batch_size_per_gpu == 1 and a.entropy_coeff == 0
        assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.filter_groups.enable
        assert (cfg.actor_rollout_ref.rollout.temperature, cfg.actor_rollout_ref.rollout.top_p) == (1.0, 1.0)
        val = cfg.actor_rollout_ref.rollout.val_kwargs
        assert (val.n, val.temperature, val.top_p) == (32, 0.7, 0.9)  # JustRL's validation
        if method == "grpo":
            assert (a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high) == ("seq-mean-token-mean", 0.2, 0.2)
            assert a.use_kl_loss and a.kl_loss_coef == 0.04 and a.clip_ratio_c == 3.0
        else:
            assert (a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high) == ("token-mean", 0.2, 0.28)
            assert not a.use_kl_loss and a.clip_ratio_c == 10.0  # JustRL's dual clip
    for method, cfg in composed.items():  # one policy-loss class; S2T monitored where it is not applied
        settings = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.policy_loss)
        assert type(settings).__name__ == "TokenSelectionLossConfig" and settings.loss_mode == "vanilla"
        assert settings.s2t_monitor and settings.monitors_s2t == (method != "stapo")
        assert (settings.tau_p, settings.q, settings.strategy) == (0.002, 0.75, "low_entropy")  # the paper's
        assert (settings.tau_p, settings.q) == (DEFAULT_TAU_P, DEFAULT_Q)  # stapo_core's defaults, one value
        assert settings.update_effect_responses == 0  # off at paper scale (docs/miniature.md)
        assert settings.token_selection == {"stapo": "s2t", "entropy20": "entropy_topk"}.get(method, "none")
    s2t = composed["stapo"].actor_rollout_ref.actor.policy_loss
    assert (s2t.loss_mode, s2t.token_selection, s2t.tau_p, s2t.q, s2t.strategy) == (
        "vanilla", "s2t", 0.002, 0.75, "low_entropy")
    assert s2t.stats_from == "current" and s2t.scope is None  # Algorithm 1: current policy, whole mini-batch
    assert composed["entropy20"].actor_rollout_ref.actor.policy_loss.entropy_top_ratio == 0.2


def dry_run(script: Path, *args: str, env_extra=None) -> list[str]:
    env = {**os.environ, "STAPO_DRY_RUN": "1", **(env_extra or {})}
    out = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, check=True).stdout
    lines = [shlex.split(line) for line in out.strip().splitlines()]
    for argv in lines:
        assert argv[1:3] == ["-m", "recipe.stapo.main_stapo"], argv
    return [argv[3:] for argv in lines]


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """Stand-in shared storage (data, the paper's model folders, a checkpoint root) and its variables."""
    return fake_cluster(tmp_path_factory.mktemp("shared"))


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "run_scripts").glob("qwen3_*_*.sh")))
def test_every_run_script_passes_the_preflight(script, storage, monkeypatch):
    """The twelve paper runs, each composed from its script's command line and prepared as the driver
    does: the whole preflight (paths, names, numbers, GPU memory on an 80 GB card) and verl's own validation."""
    (overrides,) = dry_run(REPO / "run_scripts" / script, env_extra={**storage, "LOGGER": "console"})
    for key, value in storage.items():  # what common.sh exports to the driver
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GPU_MEM_GB", raising=False)
    cfg = compose(overrides)
    logged = []
    prepare(cfg, log=logged.append, environ={})
    size, method = script[len("qwen3_"):-len(".sh")].split("_")
    assert cfg.recipe.method == method
    assert cfg.recipe.model == "qwen3_" + size.replace(".", "_")
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 64
    assert cfg.actor_rollout_ref.model.path == f"{storage['STAPO_MODEL_DIR']}/Qwen3-{size.upper()}-Base"
    assert "preflight passed" in logged[-1] and "target 79.1 GiB" in logged[-1]


def test_run_script_environment_and_loggers():
    (o,) = dry_run(REPO / "run_scripts" / "qwen3_8b_stapo.sh", f"{PL}.q=0.5",
                   env_extra={"NNODES": "2", "GPUS_PER_NODE": "4", "LOGGER": "file,tensorboard"})
    cfg = compose(o)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 4)
    assert list(cfg.trainer.logger) == ["console", "file", "tensorboard"]
    assert cfg.actor_rollout_ref.actor.policy_loss.q == 0.5
    bad = subprocess.run(["bash", str(REPO / "run_scripts/qwen3_8b_stapo.sh")], capture_output=True, text=True,
                         env={"STAPO_DRY_RUN": "1", "LOGGER": "mlflowx", "PATH": "/usr/bin:/bin"})
    assert bad.returncode != 0 and "unknown logger 'mlflowx'" in bad.stderr


def test_ablation_sweep_passes_the_preflight(storage, monkeypatch):
    for key, value in storage.items():  # what common.sh exports to the driver
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GPU_MEM_GB", raising=False)
    runs = dry_run(REPO / "run_scripts" / "ablations.sh", "all", env_extra={**storage, "LOGGER": "console"})
    runs += dry_run(REPO / "run_scripts" / "ablations.sh", "compose", env_extra={**storage, "LOGGER": "console"})
    strategies, qs, taus = [], [], []
    for overrides in runs:
        cfg = compose(overrides)
        prepare(cfg, log=lambda _: None, environ={})  # the preflight, then verl's validation
        pl = cfg.actor_rollout_ref.actor.policy_loss
        strategies.append(pl.strategy), qs.append(pl.q), taus.append(pl.tau_p)
    assert {"low_entropy", "high_entropy", "random", "full"} <= set(strategies)
    assert len(set(qs)) >= 3 and len(set(taus)) >= 3
    names = [next(o for o in r if o.startswith("trainer.experiment_name=")) for r in runs]
    assert len(set(names)) == len(names), "every ablation run needs its own experiment name"


def test_unknown_method_fails_clearly():
    with pytest.raises(ValueError, match="unknown method 'ppo2'"):
        compose(["method=ppo2"])
    with pytest.raises(ValueError, match="unknown model"):
        compose(["model=qwen3_70b"])


@pytest.mark.parametrize(
    "method, override, key",
    [("stapo", f"{PL}.q=1.5", "q"), ("stapo", f"{PL}.tau_p=0", "tau_p"), ("stapo", f"{PL}.strategy=lowest", "strategy"),
     ("stapo", f"{PL}.stats_from=old", "stats_from"), ("stapo", f"{PL}.scope=global", "scope"),
     ("stapo", f"{PL}.seed=0.5", "seed"), ("entropy20", f"{PL}.entropy_top_ratio=0", "entropy_top_ratio"),
     ("stapo", f"{PL}.current_forward=some", "current_forward"),
     ("stapo", f"{PL}.sequence_ratio=all_tokens", "sequence_ratio"),  # vanilla's ratio is per token
     ("entropy20", f"{PL}.token_selection=entropy_topk_paper", "token_selection")],
)
def test_bad_s2t_value_fails_in_driver_naming_the_key(method, override, key):
    cfg = compose([f"method={method}", override])
    with pytest.raises(ValueError, match=rf"{PL}\.{key}="):
        validate(cfg)


def test_unknown_s2t_key_fails():
    with pytest.raises(Exception, match="tau_pp|Could not override"):
        compose(["method=stapo", f"{PL}.tau_pp=0.1"])


@pytest.mark.parametrize("model", MODELS)
def test_models_select_qwen3_base_checkpoints(model):
    cfg = compose([f"model={model}"])
    size = {"qwen3_1_7b": "1.7B", "qwen3_8b": "8B", "qwen3_14b": "14B"}[model]
    assert cfg.actor_rollout_ref.model.path.endswith(f"Qwen3-{size}-Base")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert (actor.policy_loss.loss_mode, actor.policy_loss.token_selection) == ("vanilla", "s2t")


def test_ray_env_vars_reach_ray_resolved_and_as_strings():
    """verl hands ray_kwargs to ray.init without resolving interpolations, and Ray accepts only
    string env vars: the entry point resolves and stringifies them first."""
    from recipe.stapo.driver import stringify_ray_env_vars

    cfg = compose(["method=stapo", "recipe.token_dump.dir=/runs/x", "recipe.token_dump.responses=8"])
    stringify_ray_env_vars(cfg)
    env = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env, resolve=False)["env_vars"]
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",")[0] == "verl_patches.activate"
    assert (env["STAPO_TOKEN_DUMP_DIR"], env["STAPO_TOKEN_DUMP_RESPONSES"]) == ("/runs/x", "8")
    assert all(isinstance(v, str) and "${" not in v for v in env.values())
