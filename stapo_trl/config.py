"""``STAPOConfig``: TRL's ``GRPOConfig`` with S2T's settings (docs/trl.md), and the checks of the
``GRPOConfig`` values that TRL 1.16 accepts and then fails on (or silently trains wrong) later."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from trl import GRPOConfig

from stapo_core import DEFAULT_Q, DEFAULT_TAU_P, STRATEGIES
from stapo_core.checks import check_fraction, is_number

#: TRL 1.16's ``loss_type`` values (``GRPOTrainer._compute_loss``)
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: which completions the statistics forward covers (the verl recipe's ``current_forward``)
CURRENT_FORWARDS = ("positive_advantage", "full")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ValueRule(NamedTuple):
    """One ``GRPOConfig`` field TRL does not check: ``ok(value)`` or a ValueError naming ``field``,
    the value and ``expected``; ``late``: what TRL 1.16 does with a bad value."""

    field: str
    ok: Callable
    expected: str
    late: str


def _one_of(*values) -> Callable:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


#: the rules, checked in this order before ``GRPOConfig.__post_init__`` (so before anything is set up)
VALUE_RULES = (
    ValueRule("loss_type", _one_of(*LOSS_TYPES), f"one of {list(LOSS_TYPES)}",
              "ValueError 'Unknown loss type' at the first loss"),
    ValueRule("importance_sampling_level", _one_of("token", "sequence"), "one of ['token', 'sequence']",
              "ValueError at the first loss"),
    ValueRule("scale_rewards", _one_of("group", "batch", "none", True, False),
              "one of ['group', 'batch', 'none', True, False]", "ValueError after the first generation"),
    ValueRule("multi_objective_aggregation", _one_of("sum_then_normalize", "normalize_then_sum"),
              "one of ['sum_then_normalize', 'normalize_then_sum']", "ValueError after the first generation"),
    ValueRule("vllm_importance_sampling_mode",
              _one_of("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
              "one of ['token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask']",
              "ValueError after the first vLLM generation"),
    ValueRule("num_iterations", lambda v: _is_int(v) and v >= 1, "an integer >= 1",
              "0 trains no step at all, -1 fails in the sampler, 1.5 with a TypeError"),
    ValueRule("max_completion_length", lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1 (or None)",
              "0 or less fails in generate() without naming the field, 1.5 or True trains on 1 token"),
    ValueRule("steps_per_generation", lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1 (or None)",
              "0 fails in the dataloader ('batch_size should be a positive integer')"),
    ValueRule("generation_batch_size", lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1 (or None)",
              "0 fails in the dataloader ('batch_size should be a positive integer')"),
    ValueRule("gradient_accumulation_steps", lambda v: _is_int(v) and v >= 1, "an integer >= 1",
              "0 fails in the dataloader ('batch_size should be a positive integer')"),
    ValueRule("per_device_train_batch_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1",
              "0 fails in the dataloader ('batch_size should be a positive integer')"),
    ValueRule("temperature", lambda v: is_number(v) and v > 0, "a number > 0",
              "ValueError from generate() at the first generation"),
    ValueRule("top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]",
              "0 trains with every loss and gradient 0"),
    ValueRule("top_k", lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 (0: no top-k), or None",
              "ValueError from generate() at the first generation"),
    ValueRule("min_p", lambda v: v is None or (is_number(v) and 0 <= v <= 1), "a number in [0, 1], or None",
              "ValueError from generate() at the first generation"),
    ValueRule("repetition_penalty", lambda v: is_number(v) and v > 0, "a number > 0",
              "ValueError from generate() at the first generation"),
    ValueRule("num_generations", lambda v: _is_int(v) and v >= 2, "an integer >= 2 (a group to compare)",
              "0 ends in ZeroDivisionError inside GRPOConfig"),
    ValueRule("learning_rate", lambda v: is_number(v) and v >= 0, "a finite number >= 0",
              "NaN or a negative rate fails in torch's optimizer when training starts"),
    ValueRule("epsilon", lambda v: is_number(v) and v >= 0, "a number >= 0 (the lower clip is 1 - epsilon)",
              "a negative epsilon clips the ratio outside its own range: trains silently wrong"),
    ValueRule("epsilon_high", lambda v: v is None or (is_number(v) and v >= 0), "a number >= 0, or None",
              "a negative epsilon_high clips the ratio below 1: trains silently wrong"),
    ValueRule("delta", lambda v: v is None or (is_number(v) and v > 1), "a number > 1 (the dual clip), or None",
              "delta <= 1 caps the ratio at or below 1: trains silently wrong"),
    ValueRule("beta", lambda v: is_number(v) and v >= 0, "a number >= 0 (the KL coefficient)",
              "a negative beta rewards moving away from the reference: trains silently wrong"),
    ValueRule("output_dir", lambda v: v is None or (isinstance(v, (str, os.PathLike)) and os.fspath(v).strip() != ""),
              "a folder path, or None (TRL's default folder)", "'' saves every checkpoint into the working folder"),
    ValueRule("sapo_temperature_pos", lambda v: is_number(v) and v > 0, "a number > 0",
              "0 makes sapo's gradient NaN, a negative one inverts its gate"),
    ValueRule("sapo_temperature_neg", lambda v: is_number(v) and v > 0, "a number > 0",
              "0 makes sapo's gradient NaN, a negative one inverts its gate"),
)


def check_values(config) -> None:
    """ValueError naming the first field of :data:`VALUE_RULES` whose value ``config`` holds is bad,
    with the value and the allowed values; also ``max_completion_length=None`` with ``dr_grpo``
    (TRL divides by it: TypeError at the first loss)."""
    for rule in VALUE_RULES:
        value = getattr(config, rule.field)
        if not rule.ok(value):
            raise ValueError(f"STAPOConfig: {rule.field}={value!r} is invalid: expected {rule.expected}")
    if config.loss_type == "dr_grpo" and config.max_completion_length is None:
        raise ValueError("STAPOConfig: max_completion_length=None is invalid with loss_type='dr_grpo': expected an "
                         "integer >= 1 (dr_grpo divides each micro-batch's loss by completions x max_completion_length)")


@dataclass
class STAPOConfig(GRPOConfig):
    """``GRPOConfig`` plus S2T: silence the tokens of positive-advantage completions with
    ``p < tau_p`` and an entropy below the ``q``-quantile of those tokens' entropies, pooled over
    the optimizer step; the loss averages over the tokens kept (docs/trl.md gives each
    ``loss_type``'s divisor).

    The names and defaults are the verl recipe's. Refused, naming the field: TRL's own token filter
    (``top_entropy_quantile``), an optimizer step's batch from several generations, and the values
    of :data:`VALUE_RULES`.
    """

    tau_p: float = field(
        default=DEFAULT_TAU_P,
        metadata={"help": "S2T candidates: tokens of positive-advantage completions with probability p < tau_p. "
                  "In [0, 1); 0 makes no token a candidate (TRL's GRPOTrainer, bit for bit)."},
    )
    q: float = field(
        default=DEFAULT_Q,
        metadata={"help": "S2T silences the candidates whose entropy is below the q-quantile of the candidates' "
                  "entropies (low_entropy), pooled over the optimizer step and every process. In (0, 1)."},
    )
    strategy: str = field(
        default="low_entropy",
        metadata={"help": "Which candidates S2T silences: low_entropy (STAPO), or the paper's ablations "
                  "high_entropy, random, full.", "choices": list(STRATEGIES)},
    )
    current_forward: str = field(
        default="positive_advantage",
        metadata={"help": "Which completions the no-grad statistics forward covers: positive_advantage (the only "
                  "ones that can hold a candidate; the same selection) or full (every completion).",
                  "choices": list(CURRENT_FORWARDS)},
    )

    def __post_init__(self):
        for name, value in vars(self).items():  # a numpy scalar (np.int64 from np.arange): the Python number it holds
            if type(value).__module__ == "numpy" and hasattr(value, "item"):
                setattr(self, name, value.item())
        if not is_number(self.tau_p) or not 0.0 <= self.tau_p < 1.0:
            raise ValueError(f"STAPOConfig: tau_p={self.tau_p!r} is invalid: expected a number in [0, 1)")
        self.tau_p = float(self.tau_p)
        self.q = check_fraction("STAPOConfig: q", self.q)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"STAPOConfig: strategy={self.strategy!r} is invalid: expected one of {list(STRATEGIES)}")
        if self.current_forward not in CURRENT_FORWARDS:
            raise ValueError(f"STAPOConfig: current_forward={self.current_forward!r} is invalid: expected one of "
                             f"{list(CURRENT_FORWARDS)}")
        if self.top_entropy_quantile != 1.0:
            raise ValueError(
                f"STAPOConfig: top_entropy_quantile={self.top_entropy_quantile!r}: TRL's entropy filter and S2T are "
                "two token selections; keep top_entropy_quantile=1.0 with STAPO, or compare the filter with "
                "GRPOConfig (docs/trl.md)"
            )
        check_values(self)
        super().__post_init__()
        if self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"STAPOConfig: steps_per_generation={self.steps_per_generation} is not a multiple of "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: S2T pools tau_h over the batch of "
                "one optimizer step, which must come from one generation"
            )


__all__ = ["CURRENT_FORWARDS", "LOSS_TYPES", "STAPOConfig", "VALUE_RULES", "ValueRule", "check_values"]
