"""Build verl 0.9.1 actor micro-batches (TensorDict) from padded response tensors, for CPU tests.

The layout is the one the legacy trainer hands the actor after ``left_right_2_no_padding``:
``prompts``/``responses`` padded, ``attention_mask`` over prompt+response, per-token fields
``(batch, resp_len)``, and model outputs as flat ``(total_tokens,)`` tensors over every sequence's
prompt and response, which verl's ``no_padding_2_padding`` slices back to ``(batch, resp_len)``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass

PROMPT_LEN = 3


def flat_model_output(resp_values: torch.Tensor, valid: torch.Tensor, filler: float = 0.0) -> torch.Tensor:
    """Flat per-token model output whose response slice is ``resp_values`` (grad flows through it);
    ``valid`` marks the generated tokens (right-padded rows)."""
    pieces = []
    for i in range(resp_values.shape[0]):
        n = int(valid[i].sum())
        prompt_part = torch.full((PROMPT_LEN - 1,), filler, dtype=resp_values.dtype)
        # the output at position p predicts token p+1: response token t sits at PROMPT_LEN - 1 + t
        pieces += [prompt_part, resp_values[i, :n], torch.full((1,), filler, dtype=resp_values.dtype)]
    return torch.cat(pieces)


def micro_batch(
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
) -> TensorDict:
    """A micro-batch TensorDict with right-padded responses.

    ``valid`` marks the generated tokens (rows 1...1 0...0; default ``response_mask``); the
    ``response_mask``/``loss_mask`` may be a subset of it (tokens silenced by a fold).
    """
    bsz, resp_len = response_mask.shape
    valid = response_mask if valid is None else valid
    prompts = torch.ones(bsz, PROMPT_LEN, dtype=torch.long)
    responses = torch.ones(bsz, resp_len, dtype=torch.long)
    attention_mask = torch.cat([torch.ones(bsz, PROMPT_LEN, dtype=torch.long), valid.long()], dim=1)
    fields = {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention_mask,
        "response_mask": response_mask.long(),
        "loss_mask": response_mask.long(),
        "old_log_probs": old_log_probs,
        "advantages": advantages,
    }
    if entropy is not None:
        fields["entropy"] = entropy
    data = TensorDict(fields, batch_size=[bsz])
    tu.assign_non_tensor(
        data,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens if batch_num_tokens is not None else int(response_mask.sum()),
        global_batch_size=global_batch_size if global_batch_size is not None else bsz,
    )
    return data


def right_padded_mask(lengths, resp_len: int) -> torch.Tensor:
    return (torch.arange(resp_len)[None, :] < torch.as_tensor(lengths)[:, None]).long()


def actor_config(*overrides: str):
    """The recipe's actor config (``model=qwen3_1_7b`` and ``overrides``) as verl's dataclass."""
    from recipe.stapo.driver import compose  # the recipe's Hydra config: only the tests that ask for it pay for it

    return omega_conf_to_dataclass(compose(["model=qwen3_1_7b", *overrides]).actor_rollout_ref.actor)


#: per-row advantages of :func:`candidate_batch` (its batch size is their number)
CANDIDATE_ADVANTAGES = (1.0, -1.0, 0.5, 2.0, 0.0, 1.5)


def candidate_batch(resp_len: int, seed: int = 0):
    """A mini-batch of ``len(CANDIDATE_ADVANTAGES)`` right-padded responses of up to ``resp_len`` tokens
    with rare tokens (S2T candidates) in its positive-advantage rows and varied entropies, each
    ``(batch, resp_len)``: ``(mask, old_log_prob, advantages, entropy, (current_log_prob,
    current_entropy))``, the current statistics moved from the rollout's."""
    g = torch.Generator().manual_seed(seed)
    b = len(CANDIDATE_ADVANTAGES)
    mask = right_padded_mask(torch.randint(6, resp_len + 1, (b,), generator=g), resp_len)
    adv = torch.tensor(CANDIDATE_ADVANTAGES)[:, None].expand(b, resp_len).clone()
    old = -torch.rand(b, resp_len, generator=g) * 2.0
    rare = (torch.rand(b, resp_len, generator=g) < 0.4) & (adv > 0)
    old[rare] = -7.0 - torch.rand(int(rare.sum()), generator=g)
    entropy = torch.rand(b, resp_len, generator=g) * 3.0
    current = (old - 0.3 * torch.rand(b, resp_len, generator=g), entropy.flip(1))
    return mask, old, adv, entropy, current
