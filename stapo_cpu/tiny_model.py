"""The tiny assets' model: a random-init tiny Qwen3 and its supervised warm-up on the task, with
random tokens inserted into the targets (:func:`noisy_response`), until sampling solves
``target_success`` of the validation problems (docs/miniature.md says what each is for).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .tiny_config import AssetConfig
from .tiny_task import all_pairs, is_correct, make_problem, make_response
from .tiny_tokenizer import SPECIAL_TOKENS, encode_chat


def make_model(cfg: AssetConfig, tokenizer):
    """A random-init tiny ``Qwen3ForCausalLM`` (fixed seed, float32, eager attention)."""
    # torch and transformers (seconds) only when the assets are built
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        attn_implementation="eager", torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


@dataclass(frozen=True)
class SampleStats:
    """What sampling at temperature 1.0 from the model gives on some problems (one response each):
    ``rare`` counts sampled tokens with p < ``tau_p``, ``rare_in_correct`` those in correct responses
    (the tokens S2T can flag)."""

    success_rate: float
    responses: int
    tokens: int
    mean_length: float
    rare: int
    rare_in_correct: int
    tokens_in_correct: int

    @property
    def rare_per_1k(self) -> float:
        """Rare sampled tokens per 1000 sampled tokens."""
        return 1000.0 * self.rare / max(self.tokens, 1)

    @property
    def candidates_per_1k(self) -> float:
        """Rare tokens of correct responses per 1000 tokens of correct responses."""
        return 1000.0 * self.rare_in_correct / max(self.tokens_in_correct, 1)


def sample_stats(model, tokenizer, pairs: list[tuple[int, int]], cfg: AssetConfig, seed: int) -> SampleStats:
    """Sample one response per problem ``(a, b)`` (temperature 1.0, ``cfg.max_new_tokens``) and count
    successes and rare tokens (p < ``cfg.tau_p``)."""
    # torch only when the assets are built
    import torch

    # imported where used: it loads torch
    from stapo_cpu.sampling import sample_batch

    questions = [make_problem(a, b)[0] for a, b in pairs]
    truths = [make_problem(a, b)[2] for a, b in pairs]
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        samples = sample_batch(model, [encode_chat(tokenizer, q) for q in questions],
                               max_new_tokens=cfg.max_new_tokens, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.pad_token_id, temperature=1.0, generator=gen)
    model.train(was_training)
    log_tau = math.log(cfg.tau_p)
    hits = tokens = rare = rare_ok = tokens_ok = 0
    for sample, truth in zip(samples, truths):
        n_rare = sum(lp < log_tau for lp in sample.log_probs)
        ok = is_correct(tokenizer.decode(sample.token_ids, skip_special_tokens=True), truth)
        hits += ok
        tokens += len(sample.token_ids)
        rare += n_rare
        if ok:
            rare_ok += n_rare
            tokens_ok += len(sample.token_ids)
    return SampleStats(hits / len(questions), len(questions), tokens, tokens / len(questions), rare, rare_ok,
                       tokens_ok)


def noisy_response(ids: list[int], noise_rate: float, vocab: int, n_special: int, rng: random.Random) -> list[int]:
    """``ids`` with a random ordinary token (id in ``[n_special, vocab)``) inserted before each
    position with probability ``noise_rate`` (the model's long tail)."""
    out: list[int] = []
    for token in ids:
        if rng.random() < noise_rate:
            out.append(rng.randrange(n_special, vocab))
        out.append(token)
    return out


def _sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (input_ids, labels) with labels = -100 on prompt and padding. Shapes (B, L) int64."""
    # torch only when the assets are built
    import torch

    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(examples):
        seq = prompt + response
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(response)
    return ids, labels


def response_loss(model, ids, labels):
    """Next-token cross-entropy over the labelled (response) positions only; the same value as
    ``model(input_ids=ids, labels=labels).loss`` without computing the vocabulary softmax at prompt
    and padding positions. ids, labels: (B, L) int64, labels -100 where not trained."""
    # torch only when the assets are built
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    return F.cross_entropy(model.lm_head(hidden[keep]).float(), targets[keep])


def warmup_pairs(cfg: AssetConfig, val_pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Problems the warm-up trains on: every ``(a, b)`` of the range except the validation ones."""
    held_out = set(val_pairs)
    return [pair for pair in all_pairs(cfg) if pair not in held_out]


def warm_up(model, tokenizer, cfg: AssetConfig, sft_pairs, val_pairs) -> tuple[int, float, list[float]]:
    """Supervised warm-up until the sampled success rate reaches ``cfg.target_success``.

    Each step draws ``cfg.warmup_batch_size`` problems of ``sft_pairs`` with a fresh phrasing of
    their response (:func:`make_response`) and noise tokens (:func:`noisy_response`).
    Returns (steps done, final success rate, success rate after each chunk)."""
    # torch only when the assets are built; tqdm for its progress bar
    import torch
    from tqdm import tqdm

    prompt_ids = {}
    eval_pairs = val_pairs[: cfg.eval_prompts]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed + 1)
    n_special = len(SPECIAL_TOKENS)
    history: list[float] = []
    model.train()
    bar = tqdm(range(1, cfg.max_warmup_steps + 1), desc="tiny-model warm-up", leave=False, mininterval=2.0)
    rate = 0.0
    for step in bar:
        batch = []
        for a, b in rng.sample(sft_pairs, min(cfg.warmup_batch_size, len(sft_pairs))):
            if (a, b) not in prompt_ids:
                prompt_ids[(a, b)] = encode_chat(tokenizer, make_problem(a, b)[0])
            response = tokenizer(make_response(a, b, rng), add_special_tokens=False)["input_ids"]
            response = noisy_response(response, cfg.noise_rate, len(tokenizer), n_special, rng)
            batch.append((prompt_ids[(a, b)], response + [tokenizer.eos_token_id]))
        ids, labels = _sft_batch(batch, tokenizer.pad_token_id)
        loss = response_loss(model, ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0:
            rate = sample_stats(model, tokenizer, eval_pairs, cfg, seed=cfg.seed + step).success_rate
            history.append(rate)
            bar.set_postfix(loss=f"{loss.item():.3f}", success=f"{rate:.2f}")
            if rate >= cfg.target_success:
                return step, rate, history
    return cfg.max_warmup_steps, rate, history
