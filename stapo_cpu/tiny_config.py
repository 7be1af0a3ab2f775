"""Settings of the tiny CPU assets: the dataclass every builder step reads, and its hash.

The hash identifies a build: :mod:`.assets` reuses a folder whose manifest records the same hash.
It covers every field and the instruction the prompts end with (the prompts change with it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from stapo_core import DEFAULT_TAU_P

#: instruction appended to every prompt (as in the real runs; docs/method.md, "Training settings")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class AssetConfig:
    """Settings of the tiny assets (all defaults give the shipped quickstart assets).

    Problems are ``a + b`` with ``a`` uniform in ``[low, high]`` and ``b`` in ``[b_low, b_high]``.
    The warm-up trains in chunks of ``eval_every`` steps and stops at the first chunk whose sampled
    success rate (temperature 1.0, ``eval_prompts`` val prompts) reaches ``target_success``, or after
    ``max_warmup_steps``.
    """

    seed: int = 0
    low: int = 10
    high: int = 99
    b_low: int = 2
    b_high: int = 9
    n_train: int = 480
    n_val: int = 64
    vocab_size: int = 3072
    filler_words: int = 6000
    filler_sentences: int = 3000
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 256
    warmup_batch_size: int = 24
    warmup_lr: float = 3e-3
    max_warmup_steps: int = 1500
    eval_every: int = 50
    eval_prompts: int = 32
    target_success: float = 0.4
    noise_rate: float = 0.004
    max_new_tokens: int = 160
    tau_p: float = DEFAULT_TAU_P

    def digest(self) -> str:
        """sha256 (16 hex chars) of the config, the format version and the prompt instruction."""
        blob = json.dumps({"config": dataclasses.asdict(self), "instruction": INSTRUCTION, "version": 1},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
