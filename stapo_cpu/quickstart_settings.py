"""The quickstart's settings check: STAPO's run must carry the paper's S2T settings, clip range, loss
aggregation and reward; only scale settings (batch sizes, lengths, learning rate, steps, model) may
differ, and the summary lists each next to the recipe's paper-scale value."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from recipe.stapo.driver import compose
from stapo_core.s2t import DEFAULT_Q, DEFAULT_TAU_P

ACTOR = "actor_rollout_ref.actor"
#: the settings that make STAPO the paper's STAPO: config key -> the paper's value (the reward is
#: checked against the recipe's own paper-scale config, see :func:`paper_settings`)
PAPER_S2T = {
    f"{ACTOR}.policy_loss.loss_mode": "vanilla",
    f"{ACTOR}.policy_loss.token_selection": "s2t",
    f"{ACTOR}.policy_loss.tau_p": DEFAULT_TAU_P,
    f"{ACTOR}.policy_loss.q": DEFAULT_Q,
    f"{ACTOR}.policy_loss.strategy": "low_entropy",
    f"{ACTOR}.policy_loss.stats_from": "current",
    f"{ACTOR}.clip_ratio_low": 0.2,
    f"{ACTOR}.clip_ratio_high": 0.28,
    f"{ACTOR}.clip_ratio_c": 10.0,
    f"{ACTOR}.loss_agg_mode": "token-mean",
    f"{ACTOR}.entropy_coeff": 0,
    f"{ACTOR}.use_kl_loss": False,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
}
REWARD_KEYS = ("reward.custom_reward_function.path", "reward.custom_reward_function.name")
#: validation samples per held-out problem (the CPU runs draw one, the paper-scale config 32)
VAL_N = "actor_rollout_ref.rollout.val_kwargs.n"
#: scale settings: allowed to differ from the paper (listed in the summary with both values)
SCALE_KEYS = {
    "data.train_batch_size": "prompts per step",
    "actor_rollout_ref.rollout.n": "responses per prompt",
    f"{ACTOR}.ppo_mini_batch_size": "prompts per PPO mini-batch",
    "data.max_prompt_length": "max prompt tokens",
    "data.max_response_length": "max response tokens",
    f"{ACTOR}.optim.lr": "learning rate",
    f"{ACTOR}.optim.lr_warmup_steps": "lr warm-up steps",
    "trainer.total_training_steps": "training steps",
    "actor_rollout_ref.model.path": "model",
    VAL_N: "validation samples per problem",
}


def config_value(config, key: str):
    value = OmegaConf.select(config, key, default=None)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def paper_settings() -> dict:
    """The paper's value of every checked key: :data:`PAPER_S2T` and the reward function of the
    recipe's paper-scale config (``method=stapo`` with no other override)."""
    paper = compose(["method=stapo"])
    return {**PAPER_S2T, **{key: config_value(paper, key) for key in REWARD_KEYS}}


def run_settings(method: str, overrides: list[str]) -> dict:
    """The checked and the scale settings of the config ``main_stapo method=<method> <overrides>``
    runs with (composed by Hydra exactly as the trainer composes it)."""
    config = compose([f"method={method}", *overrides])
    return {key: config_value(config, key) for key in [*PAPER_S2T, *REWARD_KEYS, *SCALE_KEYS]}


def s2t_differences(settings: dict, paper: dict) -> list[str]:
    """One line per checked key whose value differs from the paper's (empty: the paper's STAPO)."""
    return [f"{key} = {settings.get(key)!r}, the paper's is {value!r}" for key, value in paper.items()
            if settings.get(key) != value]


def settings_markdown(settings: dict) -> str:
    """The summary's settings section: the checked S2T settings (all the paper's) and the scale
    settings next to the recipe's paper-scale values."""
    paper = compose(["method=stapo"])
    lines = ["## STAPO settings (checked: equal to the paper's)\n", "| setting | value |", "|---|---|"]
    lines += [f"| `{key}` | {settings[key]} |" for key in [*PAPER_S2T, *REWARD_KEYS]]
    lines += ["", "## Scale settings (the only differences from the paper's runs)\n",
              "| setting | quickstart | paper-scale config |", "|---|---|---|"]
    for key, label in SCALE_KEYS.items():
        ours, theirs = settings[key], config_value(paper, key)
        if key.endswith("model.path"):
            ours = f"tiny Qwen3 ({Path(str(ours)).parent.name}/{Path(str(ours)).name})"
        lines.append(f"| {label} (`{key}`) | {ours} | {theirs} |")
    return "\n".join(lines) + "\n"
