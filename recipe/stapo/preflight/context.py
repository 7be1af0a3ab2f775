"""The model and its context: prompt + response within vLLM's context, the heads split over the groups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from .problem import ACTOR, ROLLOUT, Problem, is_int, pick

#: rollouts whose context is ``rollout.max_model_len``, else the model's ``max_position_embeddings``
CONTEXT_ROLLOUTS = ("vllm", "sglang")


def model_path(config: DictConfig) -> str:
    return str(pick(config, "actor_rollout_ref.model.hf_config_path", "") or pick(config, "actor_rollout_ref.model.path", ""))


#: the key under which :func:`model_config_json` reports a file that is not a JSON object
UNUSABLE = "__unusable__"


def model_config_json(config: DictConfig) -> tuple[Optional[dict], str]:
    """(the parsed ``config.json`` of the run's model, its path), (None, why not) when it cannot be read
    here, or ({UNUSABLE: why}, its path) when it is read but is not a JSON object."""
    file = Path(model_path(config)) / "config.json"
    try:
        data = json.loads(file.read_text())
    except OSError as e:
        return None, f"{file}: {e.strerror or e}"
    except ValueError as e:
        return {UNUSABLE: f"not JSON ({e})"}, str(file)
    if not isinstance(data, dict):
        return {UNUSABLE: "not a JSON object"}, str(file)
    return data, str(file)


def check_context(config: DictConfig, found: list[Problem]) -> None:
    """Prompt + response fit the context vLLM serves (verl silently cuts the responses to fit it)."""
    if str(pick(config, f"{ROLLOUT}.name", "")) not in CONTEXT_ROLLOUTS:
        return
    raw, source = model_config_json(config)
    if raw is None or UNUSABLE in raw:
        return
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    check_heads({**raw, **text}, source, config, found)
    positions = raw.get("max_position_embeddings", text.get("max_position_embeddings"))
    if not is_int(positions) or positions < 1:
        said = "missing" if positions is None else f"{positions!r} is not a whole number >= 1"
        found.append(Problem(f"{source}: max_position_embeddings", f"{said}: verl reads it to size vLLM's context, "
                             "and raises without a usable one (after Ray starts)", "use the model's own config.json"))
        return
    prompt, response = pick(config, "data.max_prompt_length"), pick(config, "data.max_response_length")
    longest = prompt + response
    served = pick(config, f"{ROLLOUT}.max_model_len")
    if served is not None:
        if not is_int(served) or served < 1:
            found.append(Problem(f"{ROLLOUT}.max_model_len", "must be a whole number >= 1 or null",
                                 f"leave it null (the model's max_position_embeddings, {positions})", served))
            return
        if served > positions:
            found.append(Problem(f"{ROLLOUT}.max_model_len", f"above the model's max_position_embeddings={positions} "
                                 f"({source}): verl refuses it when the rollout starts",
                                 f"set it to at most {positions}, or leave it null", served))
            return
    context, named = (served, f"{ROLLOUT}.max_model_len={served}") if served is not None else (
        positions, f"the model's max_position_embeddings={positions} ({source})")
    if longest > context:
        fix = (f"set data.max_response_length to at most {context - prompt} (or shorten data.max_prompt_length)"
               if prompt < context else f"set data.max_prompt_length below {context}, leaving room for the responses")
        found.append(Problem(
            "data.max_response_length", f"data.max_prompt_length + data.max_response_length = {prompt} + {response} "
            f"= {longest} tokens exceed {named}: vLLM serves at most that context, and verl clamps each request's "
            f"new tokens to it minus the prompt, so responses would stop before {response} tokens",
            f"{fix}, or use a model whose context holds prompt + response", response))


def check_heads(shape: dict, source: str, config: DictConfig, found: list[Problem]) -> None:
    """The model's heads (``shape``) split over vLLM's tensor-parallel and the Ulysses sequence-parallel group."""
    heads = shape.get("num_attention_heads")
    kv_heads = shape.get("num_key_value_heads", heads)
    if not (is_int(heads) and is_int(kv_heads) and heads > 0 and kv_heads > 0):
        return  # the memory check names the field
    for key, who in ((f"{ROLLOUT}.tensor_model_parallel_size", "vLLM"),
                     (f"{ACTOR}.ulysses_sequence_parallel_size", "verl's sequence parallelism")):
        size = pick(config, key)  # a whole number >= 1 (the numbers passed)
        if size < 2:
            continue
        if heads % size or (kv_heads % size and size % kv_heads):
            divisors = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
            found.append(Problem(key, f"the model has {heads} attention heads and {kv_heads} key-value heads ({source}): "
                                 f"{who} splits the heads over the group, and refuses a size that does not divide them "
                                 "(or, for the key-value heads, that they do not divide), after Ray starts",
                                 f"use a size among {divisors}", size))
