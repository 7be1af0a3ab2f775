"""The tiny assets' task: addition problems answered by a worked column addition (:func:`make_response`),
split into train and validation sets (:func:`make_pairs`), written in verl's RL parquet format
(:func:`write_parquet`) and scored as the training reward scores them (:func:`is_correct`).
"""

from __future__ import annotations

import random
from pathlib import Path

from stapo_core.fileio import atomic_write

from .tiny_config import INSTRUCTION, AssetConfig

DATA_SOURCE = "stapo_tiny_addition"

#: the reasoning templates of a response, one group per sentence slot. Within a slot every phrasing
#: is equally likely, so the model learns genuinely uncertain ("forking") positions where a slot
#: starts, and near-certain positions inside the arithmetic (digits, "=", "+").
OPENERS = (
    "Let's add {a} and {b}.",
    "We need to compute {a} + {b}.",
    "First, write {a} + {b} in columns.",
    "Okay, so we want {a} + {b}.",
    "So the question asks for {a} + {b}.",
    "To find {a} + {b}, add place by place.",
)
ONES = (
    "The ones digits are {x} and {y}: {x} + {y} = {s}.",
    "Ones place: {x} + {y} = {s}.",
    "Start with the ones: {x} + {y} = {s}.",
    "Add the units first: {x} + {y} = {s}.",
)
CARRY = ("Write {d} and carry 1.", "So we write {d}, carrying 1.", "That gives {d} with a carry of 1.")
NO_CARRY = ("Write {d}, no carry.", "No carry, so the ones digit is {d}.", "That is {d}, nothing to carry.")
TENS = ("Then the tens: {x}{c} = {s}.", "Next, the tens: {x}{c} = {s}.", "Now the tens place: {x}{c} = {s}.")
TENS_SAME = ("The tens digit stays {s}.", "Then the tens: still {s}.", "Nothing changes in the tens: {s}.")
CHECKS = ("Wait, let me check: {t} - {b} = {a}. Yes.", "Let me verify: {t} - {b} = {a}, correct.",
          "Check: {a} + {b} = {t}. Good.")
FINALS = (
    "So the sum is {t}. The answer is \\boxed{{{t}}}",
    "Therefore we get {t}, and the answer is \\boxed{{{t}}}",
    "Thus the result is {t}. Final answer: \\boxed{{{t}}}",
    "Hence the total is {t}. \\boxed{{{t}}}",
)
#: probability that a response double-checks its sum before concluding
CHECK_PROB = 0.4


def make_response(a: int, b: int, rng: random.Random) -> str:
    """A worked column addition of ``a + b`` (``a`` two digits, ``b`` one digit), one phrasing per
    slot drawn with ``rng``; it ends with the final answer as ``\\boxed{a + b}`` (nothing after it)."""
    t = a + b
    ones = a % 10 + b
    carry = ones // 10
    tens = a // 10 + carry
    parts = [rng.choice(OPENERS).format(a=a, b=b),
             rng.choice(ONES).format(x=a % 10, y=b, s=ones),
             rng.choice(CARRY if carry else NO_CARRY).format(d=ones % 10),
             rng.choice(TENS).format(x=a // 10, c=" + 1", s=tens) if carry
             else rng.choice(TENS_SAME).format(s=tens)]
    if rng.random() < CHECK_PROB:
        parts.append(rng.choice(CHECKS).format(a=a, b=b, t=t))
    parts.append(rng.choice(FINALS).format(a=a, b=b, t=t))
    return " ".join(parts)


def make_problem(a: int, b: int, rng: random.Random | None = None) -> tuple[str, str, str]:
    """(user prompt, reference response, ground truth) for ``a + b``.

    The response's phrasing is drawn with ``rng`` (default: a generator seeded with ``(a, b)``, so
    the same problem always gets the same reference response)."""
    question = f"What is {a} + {b}?\n\n{INSTRUCTION}"
    response = make_response(a, b, rng if rng is not None else random.Random(a * 1000 + b))
    return question, response, str(a + b)


def all_pairs(cfg: AssetConfig) -> list[tuple[int, int]]:
    """Every problem ``(a, b)`` of the configured ranges, in order."""
    return [(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(cfg.b_low, cfg.b_high + 1)]


def make_pairs(cfg: AssetConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint train / val lists of (a, b), drawn with ``cfg.seed``."""
    if cfg.low < 0 or cfg.high < cfg.low:
        raise ValueError(f"AssetConfig: need 0 <= low <= high, got low={cfg.low}, high={cfg.high}")
    if not 0 <= cfg.b_low <= cfg.b_high <= 9:
        raise ValueError(f"AssetConfig: need 0 <= b_low <= b_high <= 9, got b_low={cfg.b_low}, b_high={cfg.b_high}")
    pairs = all_pairs(cfg)
    if cfg.n_train + cfg.n_val > len(pairs):
        raise ValueError(f"AssetConfig: n_train + n_val = {cfg.n_train + cfg.n_val} exceeds the {len(pairs)} "
                         f"distinct problems of a in [{cfg.low}, {cfg.high}], b in [{cfg.b_low}, {cfg.b_high}]")
    rng = random.Random(cfg.seed)
    pairs = rng.sample(pairs, cfg.n_train + cfg.n_val)
    return pairs[: cfg.n_train], pairs[cfg.n_train :]


def _rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    rows = []
    for index, (a, b) in enumerate(pairs):
        question, _, truth = make_problem(a, b)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "a": a, "b": b},
        })
    return rows


def write_parquet(pairs: list[tuple[int, int]], split: str, path: Path) -> None:
    """Write one split in verl's RL parquet format."""
    # pandas (a second) only when a split is written
    import pandas as pd

    atomic_write(path, lambda tmp: pd.DataFrame(_rows(pairs, split)).to_parquet(tmp, index=False))


def is_correct(text: str, truth: str) -> bool:
    """The training reward's verdict: verl's DAPO rule with ``strict_box_verify`` (the last
    ``\\boxed{}`` within the response's final 100 characters equals ``truth`` exactly)."""
    # verl's scorer (seconds) only when a response is scored
    from verl.utils.reward_score.math_dapo import compute_score

    return compute_score(text, truth, strict_box_verify=True)["score"] > 0
