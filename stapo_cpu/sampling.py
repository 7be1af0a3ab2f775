"""Batched ancestral sampling with a Hugging Face causal LM, returning per-token log-probs.

Used by the tiny assets' check of how often the warmed-up model succeeds and samples rare tokens
(:mod:`stapo_cpu.tiny_model`). The log-prob returned for each sampled token is ``log_softmax(logits / temperature)[token]``: the
same quantity verl's actor computes for ``old_log_prob`` (it divides the logits by the rollout
temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Sample:
    """One sampled continuation.

    Attributes:
        token_ids: response token ids (the stop token included when generation stopped on it).
        log_probs: float log-prob of each response token under ``softmax(logits / T)``; same length.
        stop_reason: ``"completed"`` (an eos token was drawn) or ``"length"`` (max_new_tokens hit).
    """

    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. Returns (input_ids, attention_mask), both int64 of shape (B, max_len)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.no_grad()
def sample_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> list[Sample]:
    """Sample one continuation per prompt (KV-cached, left-padded batch).

    Args:
        model: a ``transformers`` causal LM (eval mode is set by the caller); run on CPU.
        prompts: B token-id lists (any lengths >= 1).
        max_new_tokens: maximum response length per prompt.
        eos_token_ids: ids that end a response (kept as its last token).
        pad_token_id: id used for left padding (masked out by the attention mask).
        temperature: > 0; logits are divided by it before softmax.
        generator: torch.Generator for reproducible draws.

    Returns:
        B :class:`Sample` s, in prompt order.
    """
    if len(prompts) == 0:
        raise ValueError("sample_batch: `prompts` is empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("sample_batch: every prompt needs at least one token (got an empty prompt)")
    if max_new_tokens < 1:
        raise ValueError(f"sample_batch: `max_new_tokens` must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"sample_batch: `temperature` must be > 0, got {temperature}")
    input_ids, attention_mask = _left_pad(prompts, pad_token_id)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.as_tensor(list(eos_token_ids), dtype=torch.long)
    batch = input_ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool)
    tokens, logps = [], []
    past = None
    step_ids = input_ids
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :].float() / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        tokens.append(nxt)
        logps.append(log_probs.gather(-1, nxt.unsqueeze(-1)).squeeze(-1))
        done = done | torch.isin(nxt, eos)
        if bool(done.all()):
            break
        step_ids = nxt.unsqueeze(-1)
        attention_mask = torch.cat([attention_mask, torch.ones((batch, 1), dtype=torch.long)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
    return _collect(torch.stack(tokens, dim=1), torch.stack(logps, dim=1), eos)


def _collect(tokens: torch.Tensor, logps: torch.Tensor, eos: torch.Tensor) -> list[Sample]:
    """Cut each row after its first eos. tokens, logps: (B, T)."""
    samples = []
    eos_set = set(eos.tolist())
    for row_tokens, row_logps in zip(tokens.tolist(), logps.tolist()):
        end = next((i + 1 for i, t in enumerate(row_tokens) if t in eos_set), None)  # None: no eos, all of it
        samples.append(Sample(row_tokens[:end], row_logps[:end], "length" if end is None else "completed"))
    return samples
