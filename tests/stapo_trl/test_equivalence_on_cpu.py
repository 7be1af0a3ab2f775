"""``tau_p=0``: STAPOTrainer is TRL's GRPOTrainer bit for bit, in every setting TRL offers.

Each case trains GRPOTrainer and STAPOTrainer(tau_p=0) from the same saved model, data and seed,
and compares every logged value (timings aside) and every final weight exactly (``==``,
``torch.equal``): each of TRL's loss types with one optimizer step per generation, and with four
micro-batch steps per generation over two optimizer steps (``steps_per_generation=4``,
``gradient_accumulation_steps=2``), each generation used twice (``num_iterations=2``) and the KL
term on (``beta>0``, a reference model); then sequence-level ratios, the two-sided clip
(``delta``), the entropy bonus, truncated-completion masking, four accumulation steps, and
evaluation.
"""

from __future__ import annotations

import math

import pytest
import torch

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.config import LOSS_TYPES
from tests.helpers.trl_tiny import digit_reward, prompts_dataset, tiny_model, tiny_tokenizer, trainer_settings

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

#: several optimizer steps per generation, each generation used twice, a KL term
MULTI_STEP = dict(steps_per_generation=4, num_iterations=2, beta=0.05, max_steps=4)

CASES = (
    [pytest.param(loss, {}, id=f"{loss}-one-step-per-generation") for loss in LOSS_TYPES]
    + [pytest.param(loss, MULTI_STEP, id=f"{loss}-spg4-ga2-iter2-beta") for loss in LOSS_TYPES]
    + [
        pytest.param("grpo", dict(MULTI_STEP, importance_sampling_level="sequence"), id="grpo-sequence-ratio"),
        pytest.param("dapo", dict(MULTI_STEP, delta=10.0, epsilon_high=0.28, entropy_coef=0.01,
                                  mask_truncated_completions=True, max_completion_length=16),
                     id="dapo-delta-entropy-bonus-truncation"),
        pytest.param("dapo", dict(gradient_accumulation_steps=4, steps_per_generation=8, max_steps=4),
                     id="dapo-ga4-spg8"),
        pytest.param("cispo", dict(MULTI_STEP, epsilon_high=5.0, eval_strategy="steps", eval_steps=2,
                                   per_device_eval_batch_size=4), id="cispo-eval"),
    ]
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model saved once: both trainers (and TRL's reference model for beta > 0) load it."""
    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer, seed=0).save_pretrained(path)
    return str(path)


def run(trainer_cls, config_cls, model_dir, out, loss_type, overrides, **extra):
    from trl import GRPOConfig  # noqa: F401  (TRL is the trl extra)

    settings = dict(overrides)
    if loss_type == "luspo":  # TRL's luspo is a sequence-level loss
        settings.setdefault("importance_sampling_level", "sequence")
    args = config_cls(**trainer_settings(out, loss_type=loss_type, **settings, **extra))
    trainer = trainer_cls(model=model_dir, reward_funcs=digit_reward, args=args, train_dataset=prompts_dataset(),
                          eval_dataset=prompts_dataset(8) if args.eval_strategy != "no" else None,
                          processing_class=tiny_tokenizer())
    trainer.train()
    return trainer


def logged(trainer) -> list[dict]:
    """Every logged record, timings left out."""
    return [{k: v for k, v in h.items() if "time" not in k and "per_second" not in k} for h in trainer.state.log_history]


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("loss_type, overrides", CASES)
def test_tau_p_zero_is_grpo_trainer_bit_for_bit(tmp_path, model_dir, loss_type, overrides):
    from trl import GRPOConfig, GRPOTrainer

    grpo = run(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "grpo", loss_type, overrides)
    stapo = run(STAPOTrainer, STAPOConfig, model_dir, tmp_path / "stapo", loss_type, overrides, tau_p=0.0)
    grpo_logs, stapo_logs = logged(grpo), logged(stapo)
    assert len(grpo_logs) == len(stapo_logs) and sum("loss" in h for h in grpo_logs) == grpo.args.max_steps
    for step, (g, s) in enumerate(zip(grpo_logs, stapo_logs)):
        assert set(g) <= set(s), step
        differing = {k: (g[k], s[k]) for k in g if not same(g[k], s[k])}
        assert not differing, f"record {step}: {differing}"
        assert not {k for k in s if k not in g and not k.startswith(("s2t/", "eval_s2t/"))}, step
    stapo_weights = stapo.model.state_dict()
    for name, p in grpo.model.state_dict().items():
        assert torch.equal(stapo_weights[name], p), name
    assert any(not torch.equal(p, q) for p, q in zip(grpo.model.parameters(), tiny_model(tiny_tokenizer()).parameters()))
    train = [h for h in stapo_logs if "loss" in h]
    assert all(h["s2t/candidates"] == 0 and h["s2t/tokens"] > 0 for h in train)
    assert all(h["s2t/current_forward_tokens_frac"] == 0 for h in train)  # nothing to forward
    if grpo.args.eval_strategy != "no":
        assert any("eval_loss" in h for h in grpo_logs)
    if grpo.args.mask_truncated_completions:  # some completions were cut, so the masking acted
        assert any(h.get("completions/clipped_ratio", 0) > 0 for h in grpo_logs)
