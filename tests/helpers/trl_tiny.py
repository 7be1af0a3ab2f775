"""A tiny causal LM and tokenizer built in memory for the TRL adapter's tests (no hub download).

A character-level tokenizer (digits, ``+``, ``=``, a few letters, pad and eos) and a 2-layer
Qwen3 with a wide weight initialisation, so that its next-token distributions are far from uniform
and sampled tokens below a small ``tau_p`` occur. Also the prompts, a reward, and the trainer
settings that run on a CPU in seconds.
"""

from __future__ import annotations

import torch

VOCAB = list("0123456789+=abcdefghijklmnopqrstuvwxyz ")
PAD, EOS = "<pad>", "<eos>"


def tiny_tokenizer():
    """Character-level ``PreTrainedTokenizerFast`` (pad and eos set, left padding as TRL expects)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, EOS] + VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(tokenizer, seed: int = 0, init_std: float = 0.5):
    """A 2-layer Qwen3 (hidden 32) over ``tokenizer``'s vocabulary, float32, weights from ``seed``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        initializer_range=init_std, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def prompts_dataset(count: int = 16):
    """``count`` addition prompts (``"a+b="``) as a ``datasets.Dataset`` with a ``prompt`` column."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{i % 7}+{(3 * i) % 5}=" for i in range(count)]})


def digit_reward(completions, **kwargs) -> list[float]:
    """The fraction of digit characters in each completion (varies across a group's completions)."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def trainer_settings(output_dir, **overrides) -> dict:
    """Keyword arguments of ``GRPOConfig``/``STAPOConfig`` for a seconds-long CPU run."""
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, fp16=False, seed=0, report_to="none",
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=8, max_steps=2, logging_steps=1, save_strategy="no", learning_rate=1e-2,
        temperature=1.0, dataloader_num_workers=0, disable_tqdm=True,
    )
    settings.update(overrides)
    return settings
