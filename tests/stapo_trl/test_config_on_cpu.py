"""``STAPOConfig``'s refusals: S2T's own settings, and the GRPOConfig values TRL 1.16 accepts and
fails on later (each named with its value and the allowed values). No trainer."""

from __future__ import annotations

import math
import re

import pytest

from stapo_trl import STAPOConfig
from stapo_trl.config import LOSS_TYPES, VALUE_RULES

BASE = dict(use_cpu=True, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
            report_to="none")


def make(tmp_path, config_cls=STAPOConfig, **overrides):
    return config_cls(**{"output_dir": str(tmp_path), **BASE, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tau_p": -0.1}, "tau_p=-0.1 is invalid"),
        ({"tau_p": 1.0}, "tau_p=1.0 is invalid"),
        ({"q": 0.0}, "q=0.0 is invalid"),
        ({"strategy": "lowest"}, "strategy='lowest' is invalid"),
        ({"current_forward": "positive"}, "current_forward='positive' is invalid: expected one of "
                                          "['positive_advantage', 'full']"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
        ({"steps_per_generation": 3}, "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"),
    ],
)
def test_config_refuses_bad_s2t_settings_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(tmp_path, **overrides)


#: a bad value per rule of VALUE_RULES; TRL's GRPOConfig takes each of them, or fails without naming the field
BAD_VALUES = [
    ("loss_type", "bogus"), ("importance_sampling_level", "seq"), ("scale_rewards", "std"),
    ("multi_objective_aggregation", "sum"), ("vllm_importance_sampling_mode", "truncate"),
    ("num_iterations", 0), ("num_iterations", 1.5), ("max_completion_length", 0), ("max_completion_length", True),
    ("steps_per_generation", 0), ("generation_batch_size", 0), ("gradient_accumulation_steps", 0),
    ("per_device_train_batch_size", 0), ("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("min_p", 2.0), ("repetition_penalty", 0.0), ("sapo_temperature_pos", 0.0), ("sapo_temperature_neg", -1.0),
    ("num_generations", 0), ("learning_rate", float("nan")), ("learning_rate", -1e-6), ("epsilon", -0.1),
    ("epsilon_high", -0.1), ("delta", 1.0), ("beta", -0.04), ("output_dir", ""),
]


@pytest.mark.parametrize("name, value", BAD_VALUES)
def test_config_refuses_values_trl_fails_on_later_naming_field_value_and_allowed(tmp_path, name, value):
    from trl import GRPOConfig

    try:
        make(tmp_path / "trl", GRPOConfig, **{name: value})  # TRL takes it (and fails, or trains wrong, later)
    except Exception as trl_error:  # noqa: BLE001  (or fails at once, naming something else: num_generations=0)
        assert name not in str(trl_error), trl_error
    (rule,) = [r for r in VALUE_RULES if r.field == name]
    with pytest.raises(ValueError) as error:
        make(tmp_path, **{name: value})
    assert str(error.value) == f"STAPOConfig: {name}={value!r} is invalid: expected {rule.expected}"


def test_every_value_rule_is_tested_and_allows_trls_default(tmp_path):
    assert {name for name, _ in BAD_VALUES} == {r.field for r in VALUE_RULES}
    make(tmp_path)  # every GRPOConfig default passes


def test_dr_grpo_needs_a_max_completion_length(tmp_path):
    make(tmp_path / "grpo", max_completion_length=None)  # TRL's own option: generate's default length
    with pytest.raises(ValueError, match=r"max_completion_length=None is invalid with loss_type='dr_grpo'"):
        make(tmp_path, loss_type="dr_grpo", max_completion_length=None)


def test_loss_types_are_trls():
    """The loss types STAPOConfig allows are the ones TRL's GRPOConfig documents (each also trains
    in tests/stapo_trl/test_equivalence_on_cpu.py)."""
    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert tuple(re.findall(r"'(\w+)'", listed)) == LOSS_TYPES


@pytest.mark.parametrize("name, value", [("loss_type", t) for t in LOSS_TYPES] + [
    ("importance_sampling_level", "sequence"), ("scale_rewards", "batch"), ("scale_rewards", False),
    ("multi_objective_aggregation", "normalize_then_sum"), ("vllm_importance_sampling_mode", "sequence_mask"),
    ("max_completion_length", 1), ("top_k", None), ("top_k", 0), ("min_p", 0.05), ("top_p", 1.0),
    ("steps_per_generation", 4)])
def test_config_accepts_trls_values(tmp_path, name, value):
    assert getattr(make(tmp_path, **{name: value}), name) == (value if name != "scale_rewards" or value else "none")


def test_config_defaults_are_the_papers(tmp_path):
    args = make(tmp_path)
    assert (args.tau_p, args.q, args.strategy, args.current_forward) == (0.002, 0.75, "low_entropy",
                                                                         "positive_advantage")


def _raises(outcome):
    return isinstance(outcome, Exception)


def _logged(outcome):
    return [h for h in outcome.state.log_history if "loss" in h] if not _raises(outcome) else None


#: what TRL 1.16's GRPOTrainer does with each bad value (docs/trl.md's table), one step on the tiny model
LATE = [
    ("loss_type", "bogus", {}, _raises),
    ("importance_sampling_level", "seq", {}, _raises),
    ("scale_rewards", "std", {}, _raises),
    ("multi_objective_aggregation", "sum", {}, _raises),
    ("num_iterations", 0, {}, lambda o: _logged(o) == []),  # no step at all
    ("num_iterations", -1, {}, _raises),
    ("max_completion_length", 0, {}, _raises),
    ("max_completion_length", True, {}, lambda o: _logged(o)[0]["completions/max_length"] == 1),
    ("steps_per_generation", 0, {}, _raises),
    ("generation_batch_size", 0, {}, _raises),
    ("gradient_accumulation_steps", 0, {}, _raises),
    ("per_device_train_batch_size", 0, {}, _raises),
    ("temperature", 0.0, {}, _raises),
    ("repetition_penalty", 0.0, {}, _raises),
    ("top_p", 0.0, {}, lambda o: (_logged(o)[0]["loss"], _logged(o)[0]["grad_norm"]) == (0.0, 0.0)),
    ("top_k", -1, {}, _raises),
    ("min_p", 2.0, {}, _raises),
    ("sapo_temperature_pos", 0.0, {"loss_type": "sapo"}, lambda o: math.isnan(_logged(o)[0]["grad_norm"])),
    ("learning_rate", float("nan"), {}, _raises),  # torch's optimizer, once training starts
    ("learning_rate", -1e-6, {}, _raises),
    ("loss_type", "dr_grpo", {"max_completion_length": None}, _raises),
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name, value, extra, late", LATE, ids=[f"{n}={v!r}" for n, v, _, _ in LATE])
def test_trl_fails_later_or_trains_wrong_with_each_refused_value(tmp_path, name, value, extra, late):
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers.trl_tiny import digit_reward, prompts_dataset, tiny_model, tiny_tokenizer, trainer_settings

    args = GRPOConfig(**trainer_settings(tmp_path, max_steps=1, **{name: value, **extra}))  # accepted
    try:
        tokenizer = tiny_tokenizer()
        outcome = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=digit_reward, args=args,
                              train_dataset=prompts_dataset(), processing_class=tokenizer)
        outcome.train()
    except Exception as error:  # noqa: BLE001  (any late failure is the point)
        outcome = error
    assert late(outcome), outcome


def test_numpy_scalars_are_read_as_the_python_numbers_they_hold(tmp_path):
    """Values from numpy (a grid from np.arange or np.linspace) were refused as 'invalid: expected an
    integer >= 2' for np.int64(4), which is one."""
    import numpy as np

    config = make(tmp_path, tau_p=np.float32(0.5), q=np.float32(0.25), learning_rate=np.float32(1e-6),
                  num_generations=np.int64(4), per_device_train_batch_size=np.int64(8), num_iterations=np.int32(1))
    read = (config.tau_p, config.q, config.learning_rate, config.num_generations, config.per_device_train_batch_size,
            config.num_iterations)
    assert read == (0.5, 0.25, float(np.float32(1e-6)), 4, 8, 1)
    assert [type(value) for value in read] == [float, float, float, int, int, int]
    with pytest.raises(ValueError, match="num_generations=1 is invalid"):
        make(tmp_path, num_generations=np.int64(1))
