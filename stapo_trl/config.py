"""``STAPOConfig``: TRL's ``GRPOConfig`` with S2T's settings (docs/trl.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from stapo_core import DEFAULT_Q, DEFAULT_TAU_P, STRATEGIES
from stapo_core.checks import check_fraction, is_number


@dataclass
class STAPOConfig(GRPOConfig):
    """``GRPOConfig`` plus S2T: silence the tokens of positive-advantage completions with
    ``p < tau_p`` and an entropy below the ``q``-quantile of those tokens' entropies, pooled over
    the optimizer step; the loss averages over the tokens kept.

    The names and defaults are the verl recipe's (``tau_p``, ``q``, ``strategy``); TRL's own
    token filter (``top_entropy_quantile``) must stay off, and the batch of one optimizer step
    must come from one generation (``steps_per_generation`` a multiple of
    ``gradient_accumulation_steps``) so that its statistics exist when the step begins.
    """

    tau_p: float = field(
        default=DEFAULT_TAU_P,
        metadata={"help": "S2T candidates: tokens of positive-advantage completions with probability p < tau_p. "
                  "In [0, 1); 0 makes no token a candidate (TRL's loss unchanged)."},
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

    def __post_init__(self):
        if not is_number(self.tau_p) or not 0.0 <= self.tau_p < 1.0:
            raise ValueError(f"STAPOConfig: tau_p={self.tau_p!r} is invalid: expected a number in [0, 1)")
        self.tau_p = float(self.tau_p)
        self.q = check_fraction("STAPOConfig: q", self.q)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"STAPOConfig: strategy={self.strategy!r} is invalid: expected one of {list(STRATEGIES)}")
        if self.top_entropy_quantile != 1.0:
            raise ValueError(
                f"STAPOConfig: top_entropy_quantile={self.top_entropy_quantile!r}: TRL's entropy filter and S2T are "
                "two token selections; keep top_entropy_quantile=1.0 with STAPO, or compare the filter with "
                "GRPOConfig (docs/trl.md)"
            )
        super().__post_init__()
        if self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"STAPOConfig: steps_per_generation={self.steps_per_generation} is not a multiple of "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: S2T pools tau_h over the batch of "
                "one optimizer step, which must come from one generation"
            )


__all__ = ["STAPOConfig"]
