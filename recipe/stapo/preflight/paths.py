"""Paths: data files, the model folder, the folders the run writes, the checkpoint it resumes from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, ListConfig

from stapo_core.fileio import probe_writable
from verl_patches.token_dump import settings as dump

from .problem import Problem, is_int, pick, world_size
from .values import CONFIG_OWNED_ENV, seen_by_workers

#: columns every row of a data file needs (beside ``data.prompt_key`` and ``data.reward_fn_key``)
REWARD_MODEL_COLUMN, GROUND_TRUTH_FIELD = "reward_model", "ground_truth"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
#: folders the run writes to (the checkpoint folder always; the others when set)
OUTPUT_DIR_KEYS = ("trainer.default_local_dir", "recipe.token_dump.dir", "trainer.validation_data_dir",
                   "trainer.rollout_data_dir")


def _paths(value) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, (ListConfig, list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def _local(key: str, path: str, notes: list[str], submit: bool) -> Optional[Path]:
    """``path`` when it is checked here; None, with a note, when it is remote or (LAUNCH=submit) not visible."""
    if "://" in path:
        notes.append(f"{key}: {path} is remote, not checked here")
        return None
    if submit and not Path(path).exists():
        notes.append(f"{key}: {path} is not visible here (LAUNCH=submit): the job's driver checks it on the head node")
        return None
    return Path(path)


def _data_file(config: DictConfig, key: str, path: str, found: list[Problem], notes: list[str],
               submit: bool) -> Optional[int]:
    """Check one data file; returns its row count when it was read here (None otherwise)."""
    prepare_cmd = ("python -m recipe.stapo.data.prepare " + ("train" if key == "data.train_files" else "bench")
                   + " --out-dir <folder>, then set STAPO_DATA_DIR=<folder> (or " + key + ")")
    p = _local(key, path, notes, submit)
    if p is None:
        return None
    if not p.is_file():
        found.append(Problem(key, f"{path} {'is not a file' if p.exists() else 'does not exist'}", prepare_cmd))
        return None
    import pyarrow as pa  # pyarrow (half a second to import) only when a data file is checked
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(p)
        schema = meta.schema.to_arrow_schema()
    except Exception as e:  # noqa: BLE001
        found.append(Problem(key, f"{path} is not a parquet file ({type(e).__name__}: {e})", prepare_cmd))
        return None
    if meta.num_rows == 0:  # before the columns: a file without rows may have none either
        found.append(Problem(key, f"{path} has no rows", prepare_cmd))
        return None
    prompt_key = str(pick(config, "data.prompt_key", "prompt"))
    source_key = str(pick(config, "data.reward_fn_key", "data_source"))
    missing = [c for c in (prompt_key, source_key, REWARD_MODEL_COLUMN) if c not in schema.names]
    if not missing:
        reward = schema.field(REWARD_MODEL_COLUMN).type
        if not pa.types.is_struct(reward) or reward.get_field_index(GROUND_TRUTH_FIELD) < 0:
            missing.append(f"{REWARD_MODEL_COLUMN}.{GROUND_TRUTH_FIELD}")
    if missing:
        found.append(Problem(key, f"{path} has no column {', '.join(missing)} (it has {', '.join(schema.names)}); "
                             f"the run reads {prompt_key}, {source_key} and {REWARD_MODEL_COLUMN}.{GROUND_TRUTH_FIELD}",
                             prepare_cmd))
    return meta.num_rows


def _model_folder(config: DictConfig, found: list[Problem], notes: list[str], submit: bool) -> None:
    key = "actor_rollout_ref.model.path"
    path = str(pick(config, key, "") or "")
    download = (f"download it (hf download Qwen/<model> --local-dir <folder>) and set STAPO_MODEL_DIR "
                f"(or {key}) to the folder holding it")
    if not path:
        found.append(Problem(key, "is empty", download))
        return
    if "://" not in path and not path.startswith("/"):  # the driver made every local path absolute: a hub id
        return                                          # (logged by resolve_paths)
    folder = _local(key, path, notes, submit)
    if folder is None:
        return
    if not folder.is_dir() or not any(folder.iterdir()):
        said = "is empty" if folder.is_dir() else "is not a folder" if folder.exists() else "does not exist"
        found.append(Problem(key, f"{path} {said}", download))
        return
    try:
        config_json = json.loads((folder / "config.json").read_text())
        if not isinstance(config_json, dict) or "model_type" not in config_json:
            raise ValueError("no model_type")
    except (OSError, ValueError) as e:
        found.append(Problem(key, f"{path} has no readable Hugging Face config.json ({e})", download))
    tokenizer = Path(str(pick(config, "actor_rollout_ref.model.tokenizer_path", "") or path))
    if not any((tokenizer / f).is_file() for f in TOKENIZER_FILES):
        found.append(Problem("actor_rollout_ref.model.tokenizer_path" if tokenizer != folder else key,
                             f"{tokenizer} has no tokenizer ({' / '.join(TOKENIZER_FILES)})", download))
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        found.append(Problem(key, f"{path} has no weights ({' / '.join(WEIGHT_PATTERNS[:2])})", download))


def check_paths(config: DictConfig, found: list[Problem], notes: list[str], submit: bool = False) -> None:
    """Data files, the model folder, the folders the run writes to, a checkpoint to resume from."""
    batch_key = "data.gen_batch_size" if pick(config, "data.gen_batch_size") else "data.train_batch_size"
    batch = pick(config, batch_key)
    for key in ("data.train_files", "data.val_files"):
        paths = _paths(pick(config, key))
        if not paths:
            found.append(Problem(key, "is empty", "set it to the parquet file(s) of recipe.stapo.data.prepare"))
        rows = [_data_file(config, key, path, found, notes, submit) for path in paths]
        # every training file read here: verl's loader drops an incomplete last batch, so fewer rows train no step
        if key == "data.train_files" and paths and None not in rows and is_int(batch) and sum(rows) < batch:
            found.append(Problem(key, f"{', '.join(paths)} hold{'s' if len(paths) == 1 else ''} {sum(rows)} prompts, "
                                 f"fewer than one batch ({batch_key}={batch}): verl drops an incomplete batch, so no "
                                 f"training step would run", f"train on at least {batch} prompts, or set {batch_key} "
                                 f"to at most {sum(rows)}"))
    _model_folder(config, found, notes, submit)
    for key in OUTPUT_DIR_KEYS:
        value = pick(config, key)
        if not value:
            if key == "trainer.default_local_dir":
                found.append(Problem(key, "is empty", "set CKPT_DIR (or trainer.default_local_dir)"))
            continue
        folder = _local(key, str(value), notes, submit)
        reason = probe_writable(folder) if folder is not None else None
        if reason:
            found.append(Problem(key, f"{value} cannot be created or written: {reason}",
                                 "choose a folder this user can write, on storage every node sees"
                                 + (" (CKPT_DIR in the run scripts)" if key == "trainer.default_local_dir" else "")))
    check_resume(config, found, submit)


#: verl's checkpoint tracker in ``trainer.default_local_dir``: the step of the last checkpoint saved
TRACKER = "latest_checkpointed_iteration.txt"


def check_resume(config: DictConfig, found: list[Problem], submit: bool = False) -> None:
    """The checkpoint a run resumes from, found as verl's trainer finds it, with shards for this GPU count."""
    mode, run_dir = pick(config, "trainer.resume_mode"), str(pick(config, "trainer.default_local_dir", "") or "")
    if mode == "auto" and run_dir and "://" not in run_dir and (Path(run_dir) / TRACKER).exists():
        tracker, key = Path(run_dir) / TRACKER, "trainer.default_local_dir"
        steps = sorted(int(p.name.split("_")[-1]) for p in Path(run_dir).glob("global_step_*")
                       if p.name.split("_")[-1].isdigit())
        restart = (f"write the step of a checkpoint of {run_dir} into it ({', '.join(map(str, steps)) or 'none'} "
                   "there), or trainer.resume_mode=disable to train from step 0 (the checkpoints there are then "
                   "overwritten)")
        try:
            step = int(tracker.read_bytes().decode())
        except (OSError, ValueError) as e:
            found.append(Problem(key, f"{tracker} tells verl which checkpoint to resume, read as int() of its text, and "
                                 f"{type(e).__name__}: {e}: the trainer would stop there, after Ray, the model load and "
                                 "vLLM's start", restart))
            return
        folder = Path(run_dir) / f"global_step_{step}"
        if not folder.is_dir():
            found.append(Problem(key, f"{tracker} names step {step}, but {folder} does not exist: verl would train from "
                                 "step 0 without a word", restart))
            return
    elif mode == "resume_path":
        resume = str(pick(config, "trainer.resume_from_path", "") or "")
        if submit and not Path(resume).exists() or "://" in resume:
            return
        if not resume or not Path(resume).is_dir():
            found.append(Problem("trainer.resume_from_path", f"{resume!r} is not a checkpoint folder "
                                 "(trainer.resume_mode=resume_path)", "point it to a global_step_<k> folder, or use "
                                 "trainer.resume_mode=auto"))
            return
        try:
            int(resume.split("global_step_")[-1] if "global_step_" in resume else None)
        except (TypeError, ValueError):
            found.append(Problem("trainer.resume_from_path", "verl takes the step to resume at from the folder's name, "
                                 "int() of what follows its last 'global_step_', and refuses any other folder after "
                                 "Ray, the model load and vLLM's start", "point it to the global_step_<k> folder "
                                 "itself, e.g. <trainer.default_local_dir>/global_step_100", resume))
            return
        folder = Path(resume)
    else:
        return
    world = world_size(config)
    saved = sorted({p.name.split("_world_size_")[1].split("_")[0] for p in (folder / "actor").glob("model_world_size_*")})
    if world and str(world) not in saved:
        found.append(Problem("trainer.resume_from_path" if mode == "resume_path" else "trainer.default_local_dir",
                             f"{folder / 'actor'} holds no model shards for {world} GPUs (model_world_size_{world}_rank_*"
                             f".pt; saved for: {', '.join(saved) or 'none'}): verl's FSDP checkpoint loads one shard per "
                             "rank of the run's GPU count and would fail after Ray and the model load",
                             f"resume on the GPU count it was saved with ({', '.join(saved) or 'none'}), or from another "
                             "checkpoint, or trainer.resume_mode=disable", str(folder)))


def check_token_dump(config: DictConfig, found: list[Problem]) -> None:
    """The token dump's settings, read as every actor will read them (only when the dump is on)."""
    seen = seen_by_workers(config, {})  # the config sets the dump's variables for every worker
    if not seen.get(dump.DIR_ENV):
        return
    for variable in (dump.RESPONSES_ENV, dump.CONTEXT_ENV, dump.IDS_ENV):
        key = CONFIG_OWNED_ENV[variable]
        try:
            dump.settings_from_env({dump.DIR_ENV: seen[dump.DIR_ENV], variable: seen.get(variable, "")})
        except ValueError as e:
            found.append(Problem(key, str(e), f"correct {key}, or drop the override for the recipe's default"))
