"""Single values verl reports only after Ray (:data:`VALUE_CHECKS`), the device, and the environment."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from stapo_core.fileio import probe_writable
from verl_patches.env_file import parse_env_file
from verl_patches.resume import MetricsFileBusy, check_no_writer, writer_lock_path
from verl_patches.weight_sync import parse_timeout

from .problem import ACTOR, NO_VALUE, ROLLOUT, Problem, is_int, shown

#: where the config gives every Ray worker its environment variables
RAY_ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"


def _is_number(value) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class ValueCheck:
    """A key, what its value must be (``what``, read by :func:`_is`), what verl does otherwise, the fix."""

    key: str
    what: str
    why: str
    fix: str
    optional: bool = False  # null is allowed


_RANGE = re.compile(r"a (whole )?number (?:(>=?) (\S+)|in ([\[(])(\S+), (\S+)([\])]))")


def _is(value, what: str) -> bool:
    """Whether ``value`` is ``what``: "a whole number >= k", "a number > x" (or >=), "a number in [a, b)"
    (either bracket), else names after "one of ", joined by ", " or " or "."""
    match = _RANGE.match(what)
    if match is None:
        return isinstance(value, str) and value in re.split(r", | or ", what.removeprefix("one of "))
    whole, op, bound, left, low, high, right = match.groups()
    if not (is_int(value) if whole else _is_number(value)):
        return False
    if op:
        return value > float(bound) if op == ">" else value >= float(bound)
    return ((value > float(low) if left == "(" else value >= float(low))
            and (value < float(high) if right == ")" else value <= float(high)))


#: verl 0.9.1's rollouts (``verl.workers.rollout.base``) and the package each one's engine needs
ROLLOUT_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}
_VLLM = "vLLM refuses it when its engine starts, after Ray (verl passes it on unchecked)"
_TOP_K = "a whole number >= -1 (-1 or 0: every token, as vLLM reads both)"

#: the limits verl itself does not check (:mod:`.verl_config` runs those it does)
VALUE_CHECKS: tuple[ValueCheck, ...] = (
    ValueCheck(f"{ACTOR}.optim.clip_grad", "a number > 0", "verl clips every gradient's norm to it unchecked: 0 "
               "zeroes every update, a negative value flips it", "the paper: 1.0"),
    ValueCheck(f"{ACTOR}.optim.lr_warmup_steps_ratio", "a number in [0, 1]", "verl warms up for this share of the "
               "training steps unchecked: above 1 the warm-up never ends", "e.g. 0.0"),
    ValueCheck(f"{ACTOR}.ppo_epochs", "a whole number >= 1", "with no update the trainer fails at the end of the first "
               "step, after Ray (KeyError: 'actor/mfu')", "the paper: 1"),
    ValueCheck(f"{ACTOR}.clip_ratio_low", "a number in [0, 1)", "the ratio's lower clip bound 1 - clip_ratio_low must "
               "stay above 0, or the clip never acts", "the paper: 0.2 (bounds [0.8, 1.28])", optional=True),
    ValueCheck(f"{ACTOR}.clip_ratio_high", "a number >= 0", "the ratio's upper clip bound 1 + clip_ratio_high would "
               "fall below 1 and clip every improving token", "the paper: 0.28", optional=True),
    ValueCheck(f"{ACTOR}.clip_ratio", "a number >= 0", "the clip bounds would be wrong in every update",
               "verl's default: 0.2"),
    ValueCheck(f"{ACTOR}.clip_ratio_c", "a number > 1", "verl's policy loss asserts it in the first update, after the "
               "first rollout", "the paper's runs: 10.0"),
    ValueCheck(f"{ACTOR}.kl_loss_coef", "a number >= 0", "verl adds coef x KL to the loss unchecked: a negative one "
               "pushes the policy away from the reference", "e.g. 0.001"),
    ValueCheck(f"{ROLLOUT}.temperature", "a number > 0", "the log-probabilities divide by it (0 gives infinities) or "
               "vLLM refuses it after Ray starts", "the paper: 1.0"),
    ValueCheck(f"{ROLLOUT}.top_p", "a number in (0, 1]", _VLLM, "the paper: 1.0"),
    ValueCheck(f"{ROLLOUT}.top_k", _TOP_K, _VLLM, "-1"),
    ValueCheck(f"{ROLLOUT}.gpu_memory_utilization", "a number in (0, 1]", f"{_VLLM}: a fraction of each GPU's memory",
               "e.g. 0.6"),
    ValueCheck(f"{ROLLOUT}.max_num_seqs", "a whole number >= 1", _VLLM, "verl's default: 1024"),
    ValueCheck(f"{ROLLOUT}.max_num_batched_tokens", "a whole number >= 1", _VLLM, "verl's default: 8192"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.n", "a whole number >= 1", "validation fails at its first batch, after Ray starts",
               "the paper: 32"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.top_p", "a number in (0, 1]", _VLLM, "the paper: 0.9"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.temperature", "a number >= 0", _VLLM, "the paper: 0.7"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.top_k", _TOP_K, _VLLM, "-1"),
    ValueCheck("trainer.total_training_steps", "a whole number >= 1 (or null: total_epochs decides)", "the trainer "
               "fails computing its schedule, after Ray starts", "the paper: 3000", optional=True),
    ValueCheck("trainer.total_epochs", "a whole number >= 1", "with total_training_steps null the trainer would run no "
               "step", "e.g. 1000"),
    ValueCheck("trainer.resume_mode", "one of auto, disable, resume_path", "the trainer logs an unknown mode and fails "
               "on it when it loads checkpoints, after Ray starts", "auto"),
    ValueCheck("trainer.max_actor_ckpt_to_keep", "a whole number >= 1 (or null: keep all)", "checkpoint pruning fails "
               "at the first save", "the recipe: 3", optional=True),
    ValueCheck("data.truncation", "one of error, left, right, middle", "the rollout refuses it at its first long prompt",
               "the recipe: error"),
    ValueCheck(f"{ACTOR}.strategy", "fsdp or fsdp2", "verl's workers look its engine up when they start, after Ray; the "
               "recipe's patches and memory estimate are written for verl's FSDP engine",
               "the recipe: fsdp (fsdp2 on the CPU path)"),
)


def check_values(config: DictConfig, environ: Mapping[str, str]) -> list[Problem]:
    """The problems of the module docstring's list; a key the config does not have is not checked."""
    found: list[Problem] = []
    for value_check in VALUE_CHECKS:
        value = OmegaConf.select(config, value_check.key, default=NO_VALUE)
        if value is NO_VALUE or (value is None and value_check.optional):
            continue
        if not _is(value, value_check.what):
            found.append(Problem(value_check.key, f"must be {value_check.what} ({value_check.why})",
                                 f"set {value_check.key} to {value_check.what}; {value_check.fix}", shown(value)))
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY  # verl loads only here: its workers' (name, mode) table

    engine, mode = OmegaConf.select(config, f"{ROLLOUT}.name"), OmegaConf.select(config, f"{ROLLOUT}.mode", default="async")
    if engine is not None and (engine, mode) not in _ROLLOUT_REGISTRY:
        key = f"{ROLLOUT}.mode" if engine in {name for name, _ in _ROLLOUT_REGISTRY} else f"{ROLLOUT}.name"
        found.append(Problem(key, f"verl has no rollout {engine!r} in mode {mode!r} (it looks the pair up when the rollout "
                             f"workers start, after Ray; its rollouts: {sorted(_ROLLOUT_REGISTRY)})",
                             f"use {ROLLOUT}.name=vllm, {ROLLOUT}.mode=async (the recipe's)",
                             shown(OmegaConf.select(config, key))))
    elif engine in ROLLOUT_PACKAGES and importlib.util.find_spec(ROLLOUT_PACKAGES[engine]) is None:
        found.append(Problem(f"{ROLLOUT}.name", f"the {engine} rollout needs the package {ROLLOUT_PACKAGES[engine]}, "
                             "which is not installed here (verl imports it when the rollout workers start, after Ray)",
                             f"install it, or use {ROLLOUT}.name=vllm (requirements.txt)", engine))
    found += check_gpu_mem_source(config, environ)
    found += check_run_environment(config, environ)
    found += check_device(config, environ)
    return found


def check_device(config: DictConfig, environ: Mapping[str, str]) -> list[Problem]:
    """verl's CPU device and verl's platform variable together or not at all (docs/cpu.md)."""
    device = str(OmegaConf.select(config, "trainer.device", default="cuda"))
    platform = (seen_by_workers(config, environ).get("VERL_PLATFORM") or "").strip().lower()
    if device == "cpu" and platform != "cpu":
        return [Problem("trainer.device", "the CPU device without VERL_PLATFORM=cpu: verl would run its GPU code "
                        "paths on the CPU and fail after Ray starts (on a machine with GPUs verl replaces cpu by its "
                        "accelerator), and the memory check skips a CPU run", "a CPU run sets trainer.device=cpu, "
                        "VERL_PLATFORM=cpu and the CPU path's environment and overrides together (docs/cpu.md); for "
                        "GPUs, drop trainer.device", device)]
    if device != "cpu" and platform == "cpu":
        return [Problem(origin(config, "VERL_PLATFORM"), f"selects verl's CPU platform in every process of a run on "
                        f"trainer.device={device}", "unset VERL_PLATFORM for a GPU run (it belongs to a CPU run, with "
                        "trainer.device=cpu; docs/cpu.md)", "cpu")]
    return []


#: a number as the YAML's ``oc.decode`` reads it: ASCII digits, an optional sign, point and exponent
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def gpu_mem_from_env(environ: Mapping[str, str]) -> Optional[float]:
    """The positive number ``GPU_MEM_GB`` holds, as the YAML reads it; None when it is unset, else ValueError."""
    raw = environ.get("GPU_MEM_GB")
    if raw is None:
        return None
    if not raw.isascii():
        odd = sorted({c for c in raw if not c.isascii()})
        named = ", ".join(f"{c!r} ({unicodedata.name(c, 'U+%04X' % ord(c))})" for c in odd)
        raise ValueError(f"holds characters other than ASCII ({named}), which the config's parser refuses")
    value = float(raw) if _PLAIN_NUMBER.fullmatch(raw.strip()) else math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError("set but empty" if not raw.strip() else "not a positive number")
    return value


#: environment variables the YAML reads as folders: name -> what the folder is
FOLDER_ENV = {"STAPO_DATA_DIR": "the data folder (data.train_files, data.val_files)",
              "STAPO_MODEL_DIR": "the folder of the model folders (actor_rollout_ref.model.path)",
              "STAPO_LAUNCH_DIR": "the folder relative paths are taken from (the run scripts export their own)"}


def check_environment(environ: Optional[Mapping[str, str]] = None) -> list[Problem]:
    """What the environment must hold before the config is resolved, and what ``import verl`` reads in the driver
    (:data:`IMPORT_ENV`; Hydra's error would name neither); then imports ``VERL_USE_EXTERNAL_MODULES`` here."""
    environ = os.environ if environ is None else environ
    found: list[Problem] = []
    try:
        gpu_mem_from_env(environ)
    except ValueError as e:
        found.append(Problem("GPU_MEM_GB", f"{e}: it is the target GPU's memory in GiB (recipe.gpu_mem_gb)",
                             "export GPU_MEM_GB=80 (ASCII digits), or unset it for the default", environ["GPU_MEM_GB"]))
    for name, what in FOLDER_ENV.items():
        raw = environ.get(name)
        if raw is not None and not raw.strip():
            found.append(Problem(name, f"set but empty: it is {what}, and the config would read the empty name as "
                                 "the root folder", f"export {name}=<folder>, or unset it for the default", raw))
    launch = environ.get("STAPO_LAUNCH_DIR", "").strip()
    if launch and not Path(launch).expanduser().is_dir():
        found.append(Problem("STAPO_LAUNCH_DIR", f"is not a folder: it is {FOLDER_ENV['STAPO_LAUNCH_DIR']}",
                             "export STAPO_LAUNCH_DIR=$PWD, or unset it", launch))
    imported = _read_environment(environ.get, str, IMPORT_ENV)
    modules = environ.get("VERL_USE_EXTERNAL_MODULES", "")
    if imported or not modules or environ is not os.environ:
        return found + imported
    for module in modules.split(","):
        try:
            importlib.import_module(module.strip())
        except Exception as e:  # noqa: BLE001  (any error: verl would raise it inside Hydra, naming nothing)
            return found + [Problem("VERL_USE_EXTERNAL_MODULES", f"lists {module.strip()!r}, whose import fails: {e} "
                                    "(every verl process imports it when it imports verl)", "correct what the error "
                                    "names, or drop the module from the list", modules)]
    return found


def _logging_level(raw: str) -> None:
    """``VERL_LOGGING_LEVEL`` as every verl module reads it at import: a throwaway logger is set to it."""
    try:
        logging.getLogger("stapo.preflight.level_probe").setLevel(raw)
    except (ValueError, TypeError):
        raise ValueError(f"VERL_LOGGING_LEVEL={raw!r} is not a logging level: setting a logger to it fails "
                         "(Python's 'Unknown level')") from None


#: what ``import verl`` reads in the driver (a :data:`RUN_ENV_CHECKS` name each)
IMPORT_ENV = ("VERL_USE_EXTERNAL_MODULES", "VERL_LOGGING_LEVEL", "STAPO_SECRETS_FILE")


def check_gpu_mem_source(config: DictConfig, environ: Mapping[str, str]) -> list[Problem]:
    """An override of ``recipe.gpu_mem_gb`` that disagrees with ``GPU_MEM_GB``, which the YAML reads into it."""
    try:
        from_env = gpu_mem_from_env(environ)
    except ValueError:  # check_environment reports it
        return []
    value = OmegaConf.select(config, "recipe.gpu_mem_gb", default=None)
    if from_env is None or not _is_number(value) or math.isclose(float(value), from_env, rel_tol=1e-9):
        return []
    return [Problem("recipe.gpu_mem_gb", f"disagrees with the environment's GPU_MEM_GB={environ['GPU_MEM_GB']!r}, "
                    "which the YAML reads into this key: the override would win without a word",
                    f"give the value once: drop the override recipe.gpu_mem_gb={value} and set GPU_MEM_GB, or unset "
                    f"GPU_MEM_GB", value)]


@dataclass(frozen=True)
class EnvCheck:
    """An environment variable a run's processes read (``who``), the reader they use (raising ``ValueError``), the fix."""

    name: str
    who: str
    read: Callable[[str], object]
    fix: str


def _reward_workers(raw: str) -> int:
    # the recipe's reward package loads only where a run checks it (its import starts no helper process)
    from recipe.stapo.reward.guard import WORKERS_ENV, workers_from_env

    return workers_from_env({WORKERS_ENV: raw})


def _external_modules(raw: str) -> None:
    missing = []
    for module in filter(None, (m.strip() for m in raw.split(","))):
        try:
            found = importlib.util.find_spec(module) is not None  # a dotted name imports its parents, as import does
        except (ImportError, ValueError):
            found = False
        missing += [] if found else [module]
    if missing:
        raise ValueError(f"VERL_USE_EXTERNAL_MODULES={raw!r} lists {', '.join(map(repr, missing))}, which cannot be "
                         "imported (in the driver, verl fails inside Hydra's config loading, naming no module)")


def read_secrets_file(raw: str) -> dict:
    return parse_env_file(raw.strip()) if raw.strip() else {}


def _metrics_file(raw: str) -> None:
    path = Path(raw)
    if path.is_dir():
        raise ValueError(f"the metrics file {raw} is a folder; verl's file logger writes a file (e.g. "
                         f"{path / 'metrics.jsonl'})")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"the metrics file {raw}: this user cannot write it")
    reason = probe_writable(path.parent)
    if reason:
        raise ValueError(f"the metrics file {raw}: its folder cannot be written ({reason})")
    lock = writer_lock_path(path)
    if lock.exists() and (not lock.is_file() or not os.access(lock, os.R_OK | os.W_OK)):
        what = "not a file" if not lock.is_file() else "not readable and writable by this user"
        raise ValueError(f"the metrics file {raw}: its writer lock {lock} is {what}, and the logger takes it when it "
                         "opens the file; remove it or give this user access")


#: what a run's processes read from the environment, beyond the config
RUN_ENV_CHECKS: tuple[EnvCheck, ...] = (
    EnvCheck("STAPO_WEIGHT_SYNC_TIMEOUT_S", "the trainer, at each weight sync to vLLM (the first one comes after Ray, "
             "the model load and vLLM's start)", parse_timeout,
             "set it to seconds in [1, 2147483], e.g. 600 (the default), or unset it"),
    EnvCheck("STAPO_REWARD_WORKERS", "the recipe's reward module, when a reward worker imports it", _reward_workers,
             "set it to a whole number >= 1, e.g. 4, or unset it for min(4, CPUs)"),
    EnvCheck("STAPO_SECRETS_FILE", "every verl process, when it imports the recipe's patches", read_secrets_file,
             "point it to a NAME=value file only you can read (chmod 600), or unset it"),
    EnvCheck("VERL_USE_EXTERNAL_MODULES", "every verl process, when it imports verl", _external_modules,
             "install the missing module (pip install -e .) or drop it from the list"),
    EnvCheck("VERL_LOGGING_LEVEL", "every verl process, when it imports verl's modules", _logging_level,
             "set it to INFO (or DEBUG, WARNING: upper case), or unset it"),
)
#: variables the config sets for every worker from its own keys (an exported value is never read): name -> key
CONFIG_OWNED_ENV = {"STAPO_TOKEN_DUMP_DIR": "recipe.token_dump.dir",
                    "STAPO_TOKEN_DUMP_RESPONSES": "recipe.token_dump.responses",
                    "STAPO_TOKEN_DUMP_CONTEXT": "recipe.token_dump.context",
                    "STAPO_TOKEN_DUMP_IDS": "recipe.token_dump.ids",
                    "STAPO_TOKEN_DUMP_METHOD": "recipe.method"}


def _read_environment(seen: Callable[[str], Optional[str]], key: Callable[[str], str], names) -> list[Problem]:
    """One problem per variable of :data:`RUN_ENV_CHECKS` in ``names`` whose value (``seen``) its reader refuses."""
    found = []
    for env_check in RUN_ENV_CHECKS:
        raw = seen(env_check.name)
        if env_check.name in names and raw is not None:
            try:
                env_check.read(raw)
            except (ValueError, OSError) as e:
                found.append(Problem(key(env_check.name), f"{e} (read by {env_check.who})", env_check.fix, raw))
    return found


def seen_by_workers(config: DictConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the run's processes see: ``environ``, updated by :data:`RAY_ENV_VARS` (where null is "")."""
    given = OmegaConf.select(config, RAY_ENV_VARS, default=None) or {}
    return {**environ, **{str(k): "" if v is None else str(v) for k, v in given.items()}}


def origin(config: DictConfig, name: str) -> str:
    given = OmegaConf.select(config, RAY_ENV_VARS, default=None) or {}
    return f"{RAY_ENV_VARS}.{name}" if name in given else name


def check_run_environment(config: DictConfig, environ: Mapping[str, str]) -> list[Problem]:
    """What the run's processes would refuse after Ray: :data:`RUN_ENV_CHECKS`, the metrics file, its writer."""
    seen = seen_by_workers(config, environ)
    found = _read_environment(seen.get, lambda name: origin(config, name), [c.name for c in RUN_ENV_CHECKS])
    for name, key in CONFIG_OWNED_ENV.items():  # a value that differs from the exported one is the config's
        exported = environ.get(name)
        if exported is not None and exported != seen[name]:
            found.append(Problem(name, f"is exported as {exported!r}, but every worker reads {seen[name]!r}: the "
                                 f"config sets it from {key} ({RAY_ENV_VARS}), so the exported "
                                 "value is never read", f"set {key} instead, and unset {name}", exported))
    metrics, variable = metrics_file_of(config, seen)
    if not metrics or "://" in metrics:
        return found
    if not (environ.get("LAUNCH", "") == "submit" and not Path(metrics).parent.exists()):
        try:
            _metrics_file(metrics)
        except ValueError as e:
            found.append(Problem(origin(config, variable), f"{e} (verl's file logger opens it in the trainer, after Ray "
                                 "starts)", f"point {variable} to a writable place, or unset it (the metrics then go to "
                                 "<trainer.default_local_dir>/metrics.jsonl)", seen[variable]))
    try:  # a second writer: its logger refuses one too, but after Ray
        check_no_writer(metrics)
    except MetricsFileBusy as e:
        found.append(Problem("trainer.default_local_dir", str(e), "wait for the other launch to end (or stop it), or "
                             "give this run another trainer.default_local_dir (CKPT_DIR) or experiment name", metrics))
    except OSError:
        pass  # a file this process cannot open: left to the logger, which names it
    return found


def logger_names(config: DictConfig) -> Optional[list]:
    """The names of ``trainer.logger`` (a name or a list), None when it is neither."""
    value = OmegaConf.select(config, "trainer.logger", default=None)
    return [value] if isinstance(value, str) else list(value) if isinstance(value, ListConfig) else None


def metrics_file_of(config: DictConfig, seen: Mapping[str, str]) -> tuple[Optional[str], str]:
    """``(path, variable)``: the ``file`` logger's metrics file and the variable naming it, or ``(None, "")``."""
    if "file" not in (logger_names(config) or []):
        return None, ""
    if seen.get("VERL_FILE_LOGGER_PATH"):
        return seen["VERL_FILE_LOGGER_PATH"], "VERL_FILE_LOGGER_PATH"
    root = seen.get("VERL_FILE_LOGGER_ROOT")
    if not root:
        return None, ""
    project = OmegaConf.select(config, "trainer.project_name", default="")
    experiment = OmegaConf.select(config, "trainer.experiment_name", default="")
    return os.path.join(os.path.expanduser(root), str(project), f"{experiment}.jsonl"), "VERL_FILE_LOGGER_ROOT"
