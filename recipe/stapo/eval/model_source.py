"""The model an evaluation reads, checked before anything is written: a local path must be a
complete Hugging Face model folder (config, weights whole, tokenizer), and its context is read as
vLLM derives it. Reads only ``config.json`` and file headers (milliseconds, whatever the model's size).
A hub id (``ORG/NAME``) must be in the Hugging Face cache, or the hub must answer for it (not offline)."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Optional

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_TIMEOUT_S = 10.0  # how long the hub may take to answer for a model that is not in the cache


def check_model_source(model: str, what: str = "--model") -> None:
    """Refuse a model that is a local path (absolute, ``.`` or ``~``, existing, ``global_step_N``, or
    more than one ``/``) but not a complete Hugging Face model folder; anything else is a hub id
    (:func:`hub_model_problem`); the error says what is missing.
    """
    path = Path(model).expanduser()
    local = path.is_absolute() or model.startswith((".", "~")) or path.exists() or "global_step_" in model or (
        "/" in model and not _HUB_ID.match(model)
    )
    if not local:
        problem = hub_model_problem(model)
        if problem:
            raise ValueError(f"{what} {model}: {problem}; download it where there is internet (`hf download {model}`, into "
                             "this machine's Hugging Face cache), or pass a local model folder; nothing was written")
        return
    if not path.exists():
        base = "" if path.is_absolute() else f" (relative paths are taken from {Path.cwd()}, this process's working folder)"
        raise FileNotFoundError(
            f"{what} {model}: no such folder{base}. A verl checkpoint "
            "global_step_N exists only once the trainer has saved it; a hub id is ORG/NAME"
        )
    if not path.is_dir():
        raise ValueError(f"{what} {model}: not a folder (a Hugging Face model folder or a verl checkpoint is needed)")
    if not (path / "config.json").is_file():
        if (path / "actor").is_dir() or any(path.glob("model_world_size_*_rank_*.pt")):
            raise ValueError(
                f"{what} {model}: a verl checkpoint (FSDP shards), not a Hugging Face model: evaluate it with "
                "run_scripts/eval.sh, which converts it once with verl's model merger"
            )
        raise ValueError(f"{what} {model}: no config.json in it, so it is not a Hugging Face model folder")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(
            f"{what} {model}: config.json but no weights (*.safetensors or *.bin): a copy or conversion that did "
            "not finish? Redo it (eval.sh converts a verl checkpoint into MODEL/actor/merged_hf)"
        )
    problem = model_folder_problem(path)
    if problem:
        raise ValueError(f"{what} {model}: {problem}; redo the copy, or, for the copy run_scripts/eval.sh converts a verl "
                         f"checkpoint into (global_step_N/merged_hf), remove {path} and rerun eval.sh on the checkpoint: "
                         "it converts it again; nothing was written")


def hub_model_problem(model: str) -> Optional[str]:
    """Why the hub id ``model`` cannot be loaded here (one line), or None: its ``config.json`` is in
    the Hugging Face cache, or the hub answers for it within :data:`HUB_TIMEOUT_S`."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache  # only for a hub id: a second to import

    where = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    try:
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return None
        if constants.HF_HUB_OFFLINE:
            return f"{where}, and HF_HUB_OFFLINE is set"
        HfApi().model_info(model, timeout=HUB_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - no network, no such model, a gated one, a malformed id: said in one line
        detail = (str(exc).splitlines() or [""])[0][:200]
        return f"{where}, and the hub does not give it ({type(exc).__name__}: {detail})"
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A Hugging Face model folder has its tokenizer in at least one of these files."""


def model_folder_problem(path: Path) -> Optional[str]:
    """What makes a Hugging Face model folder that has ``config.json`` and weight files unusable, or
    None: a ``config.json`` that is not a JSON object, a ``*.safetensors`` file shorter than its
    header says (a copy or save cut off), a shard index naming a missing file, a ``*.bin`` file
    that is not a complete zip archive, or no tokenizer file (:data:`TOKENIZER_FILES`). Reads only
    the headers (milliseconds, whatever the model's size)."""
    try:
        config = json.loads((path / "config.json").read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{path / 'config.json'} is not valid JSON ({exc})"
    if not isinstance(config, dict):
        return f"{path / 'config.json'} is not a JSON object"
    for index in sorted(path.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            return f"{index} is not a valid shard index ({exc})"
        missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in path.iterdir()})
        if missing:
            return f"{index} names shard(s) that are not there: {', '.join(missing[:5])}"
    for weights in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(weights)
        if problem:
            return f"{weights}: {problem}"
    for weights in sorted(path.glob("*.bin")):
        if not zipfile.is_zipfile(weights):
            return f"{weights}: not a complete PyTorch archive (cut off while being written or copied?)"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return (f"no tokenizer file (one of {', '.join(TOKENIZER_FILES)}); copy the tokenizer of the base model into "
                "it (verl's merger writes it when the checkpoint's huggingface/ folder has it)")
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    """Why a ``.safetensors`` file is not complete (its header is cut, or its tensors end past the
    file's end), or None."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes, not a safetensors file (cut off while being written or copied?)"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"its header says {length} bytes but the file has {size} (cut off while being written or copied?)"
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "an unreadable header (not a safetensors file, or damaged)"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)]
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return f"{size} bytes, but its tensors need {needed} (cut off while being written or copied?)"
    return None


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
"""Keys of a model's ``config.json`` (or its ``text_config``) that bound its context, as vLLM
derives ``max_model_len``: the smallest present, times a RoPE scaling factor."""


def model_context(path: Path) -> Optional[tuple[int, str]]:
    """``(tokens, what)`` of a local model folder's context (prompt + completion), as vLLM derives
    it from ``config.json`` (:data:`CONTEXT_KEYS`; a ``rope_scaling`` ``factor`` multiplies it, of
    ``original_max_position_embeddings`` for YaRN), or None when the folder does not say."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [(text[k], k) for k in CONTEXT_KEYS if isinstance(text.get(k), int) and not isinstance(text.get(k), bool)]
    if not found:
        return None
    tokens, key = min(found)
    what = f"{key} in {path / 'config.json'}"
    rope = text.get("rope_scaling") if isinstance(text.get("rope_scaling"), dict) else {}
    factor, kind = rope.get("factor"), rope.get("rope_type", rope.get("type"))
    if isinstance(factor, (int, float)) and factor > 1 and kind not in (None, "default", "su", "longrope", "llama3", "mrope"):
        base = rope.get("original_max_position_embeddings", tokens) if kind == "yarn" else tokens
        tokens, what = int(base * factor), f"{what} with its rope_scaling factor {factor:g}"
    return tokens, what
