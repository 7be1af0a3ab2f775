"""The model's shape, as the memory model reads it: from a dense decoder-only model's ``config.json``
(:func:`shape_from_hf_config`), or built in for the paper's models (:func:`builtin_shape`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional


class ShapeError(ValueError):
    """A ``config.json`` field the estimate cannot use; ``field`` names it (``None``: the file itself)."""

    def __init__(self, source: str, field: Optional[str], problem: str):
        self.source, self.field, self.problem = source, field, problem
        super().__init__(f"{source or 'config.json'}: " + (f"{field}: " if field else "") + problem)


class NotEstimated(ShapeError):
    """A model the estimate does not cover (a Mixture-of-Experts model); ``field`` is what says so."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a dense decoder-only model's ``config.json``. ``qk_norm``: per-head
    RMSNorm of queries and keys (Qwen3); ``qkv_bias``: biases on the query, key and value projections
    (Qwen2); ``max_position_embeddings``: the context vLLM serves by default (None: not given);
    ``source``: where the numbers come from (a file or a built-in)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    qkv_bias: bool = False
    model_type: str = "qwen3"
    max_position_embeddings: Optional[int] = None
    source: str = ""

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, MLP (gate, up, down), two RMSNorms."""
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        """Token embedding plus the LM head (once when tied) and the final norm: the parameters FSDP
        keeps in its root unit (every decoder layer is its own unit)."""
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.hidden_size

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params


#: fields whose presence (with a positive value) makes a config a Mixture-of-Experts model
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "n_shared_experts")


def _positive_int(cfg: Mapping, key: str, source: str, minimum: int = 1, required: bool = True) -> Optional[int]:
    """``cfg[key]`` as a whole number >= ``minimum``; None when absent and not ``required``;
    :class:`ShapeError` naming the field otherwise."""
    if key not in cfg or cfg[key] is None:
        if required:
            raise ShapeError(source, key, "missing (the memory estimate needs it)")
        return None
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShapeError(source, key, f"{value!r} is not a whole number (transformers builds its layers from it)")
    if value < minimum:
        raise ShapeError(source, key, f"{value!r} must be at least {minimum}")
    return value


def _moe_params(cfg: Mapping, shape_fields: dict) -> Optional[int]:
    """Parameters of a Mixture-of-Experts config with its experts (every layer sparse; a shared
    expert when named), or None when the expert width is not given."""
    experts = next((cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(cfg.get(k), int) and cfg.get(k) > 0), None)
    width = cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size") if cfg.get("num_local_experts") else None)
    if not experts or not isinstance(width, int) or width <= 0:
        return None
    h = shape_fields["hidden_size"]
    q, kv = shape_fields["num_heads"] * shape_fields["head_dim"], shape_fields["num_kv_heads"] * shape_fields["head_dim"]
    shared = cfg.get("shared_expert_intermediate_size") or 0
    layer = 2 * h * q + 2 * h * kv + h * experts + experts * 3 * h * width + 3 * h * int(shared) + 2 * h
    heads = 1 if cfg.get("tie_word_embeddings") else 2
    return shape_fields["num_layers"] * layer + heads * shape_fields["vocab_size"] * h + h


def shape_from_hf_config(config: Mapping, source: str = "") -> ModelShape:
    """:class:`ModelShape` of a Hugging Face ``config.json`` (a nested ``text_config`` is used when
    present), every field checked: whole numbers >= 1 (the vocabulary >= 2), key-value heads dividing
    the attention heads, a head size given or dividing the width. :class:`ShapeError` names the first
    field that is not; :class:`NotEstimated` a Mixture-of-Experts config (its experts are not modelled)."""
    if not isinstance(config, Mapping):
        raise ShapeError(source, None, "not a JSON object")
    text = config.get("text_config")
    cfg = dict(text) if isinstance(text, Mapping) else dict(config)
    source = source or "config.json"
    f = {"hidden_size": _positive_int(cfg, "hidden_size", source),
         "num_layers": _positive_int(cfg, "num_hidden_layers", source),
         "num_heads": _positive_int(cfg, "num_attention_heads", source),
         "intermediate_size": _positive_int(cfg, "intermediate_size", source),
         "vocab_size": _positive_int(cfg, "vocab_size", source, minimum=2)}
    kv = _positive_int(cfg, "num_key_value_heads", source, required=False) or f["num_heads"]
    if f["num_heads"] % kv:
        raise ShapeError(source, "num_key_value_heads", f"{kv} does not divide num_attention_heads="
                         f"{f['num_heads']} (grouped-query attention shares each key-value head among whole groups)")
    head_dim = _positive_int(cfg, "head_dim", source, required=False)
    if head_dim is None:
        if f["hidden_size"] % f["num_heads"]:
            raise ShapeError(source, "head_dim", f"missing, and hidden_size={f['hidden_size']} is not a multiple of "
                             f"num_attention_heads={f['num_heads']}")
        head_dim = f["hidden_size"] // f["num_heads"]
    f.update(num_kv_heads=kv, head_dim=head_dim)
    max_positions = _positive_int(cfg, "max_position_embeddings", source, required=False)
    tied = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if not isinstance(tied, bool):
        raise ShapeError(source, "tie_word_embeddings", f"{tied!r} is not true or false")
    bias = cfg.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise ShapeError(source, "attention_bias", f"{bias!r} is not true or false")
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    for key in MOE_FIELDS:
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            total = _moe_params(cfg, f)
            size = f" (about {total / 1e9:.1f}B parameters with its experts)" if total else ""
            raise NotEstimated(source, key, f"{value!r}: a Mixture-of-Experts model{size}; the memory model "
                               "estimates dense decoders only, and estimating it as the dense model of the same "
                               "width would count a fraction of its parameters")
    if "moe" in model_type.lower():
        raise NotEstimated(source, "model_type", f"{model_type!r}: a Mixture-of-Experts model; the memory model "
                           "estimates dense decoders only")
    return ModelShape(
        hidden_size=f["hidden_size"], num_layers=f["num_layers"], num_heads=f["num_heads"], num_kv_heads=kv,
        head_dim=head_dim, intermediate_size=f["intermediate_size"], vocab_size=f["vocab_size"],
        tie_word_embeddings=tied, qk_norm=model_type.startswith("qwen3"),
        qkv_bias=model_type.startswith("qwen2") or bias, model_type=model_type,
        max_position_embeddings=max_positions, source=source,
    )


def _qwen3(hidden, layers, heads, intermediate, tied, name) -> ModelShape:
    return ModelShape(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128,
                      intermediate_size=intermediate, vocab_size=151936, tie_word_embeddings=tied, qk_norm=True,
                      model_type="qwen3", max_position_embeddings=32768, source=f"built-in {name} architecture")


#: the paper's models (their ``config.json``), for a model path the launching machine cannot read
#: (a hub id, or cluster storage not mounted here); the base and post-trained models share them
BUILTIN_SHAPES = {
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True, "Qwen3-1.7B"),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False, "Qwen3-8B"),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, False, "Qwen3-14B"),
}


def builtin_shape(model_path: str) -> Optional[ModelShape]:
    """The built-in shape whose name the path's last component carries (``.../Qwen3-8B-Base``), or None."""
    name = re.sub(r"[-_](base|instruct)$", "", Path(str(model_path).rstrip("/")).name.lower())
    return BUILTIN_SHAPES.get(name)
