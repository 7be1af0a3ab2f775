"""The recipe's config, from composition to the config verl receives, in the launching process before
Ray starts (:mod:`recipe.stapo.main_stapo` imports this module, never the reverse). Importing it imports
no verl: ``VERL_USE_EXTERNAL_MODULES`` must be set first (:func:`ensure_patch_module_env`).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import sys
import unicodedata
from pathlib import Path
from typing import Callable, Mapping, MutableMapping, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from recipe.stapo.methods import methods
from recipe.stapo.policy_loss import POLICY_LOSS, settings_of
from recipe.stapo.preflight import PreflightError, Problem, check_environment
from recipe.stapo.preflight import check as preflight_check
from recipe.stapo.preflight.values import RAY_ENV_VARS, seen_by_workers

MODELS = ("qwen3_1_7b", "qwen3_8b", "qwen3_14b")
CONFIG_DIR = str(Path(__file__).resolve().parent / "config")
CONFIG_NAME = "stapo_trainer"
PATCH_MODULE = "verl_patches.activate"

CALCULATE_ENTROPY = "actor_rollout_ref.actor.calculate_entropy"

DATA_PATH_KEYS = ("data.train_files", "data.val_files")
OUTPUT_PATH_KEYS = ("trainer.default_local_dir", "trainer.resume_from_path", "trainer.validation_data_dir",
                    "trainer.rollout_data_dir", "recipe.token_dump.dir")
MODEL_PATH_KEYS = ("actor_rollout_ref.model.path",)

#: what ``LAUNCH=submit`` forwards to the Ray job, beyond the names below: the recipe's own variables and
#: the communication / allocator settings every node's processes must share (NCCL, Gloo, vLLM, CUDA)
FORWARDED_ENV_PREFIXES = ("STAPO_", "NCCL_", "TORCH_NCCL_", "GLOO_", "VLLM_", "CUDA_")
FORWARDED_ENV_NAMES = ("VERL_USE_EXTERNAL_MODULES", "GPU_MEM_GB",
                       "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_DISTRIBUTED_DEBUG",
                       "HYDRA_FULL_ERROR", "VERL_LOGGING_LEVEL",
                       "VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR",
                       "WANDB_API_KEY", "WANDB_ENTITY", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_DIR",
                       "WANDB_RESUME", "WANDB_RUN_ID", "WANDB_TAGS", "WANDB_NOTES",
                       "HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT",
                       "HF_HUB_CACHE", "HF_HUB_ENABLE_HF_TRANSFER")
#: never forwarded: launcher-only (the job's driver must train, not just check) or set per node (one
#: node's value would be wrong on the others; export them before that node's ``ray start``)
NOT_FORWARDED_ENV_NAMES = ("STAPO_DRY_RUN", "CUDA_VISIBLE_DEVICES", "VLLM_HOST_IP")
#: forwarded variables holding secrets: a job's runtime env is shown in plain text by ``ray job list`` and
#: the dashboard; with ``STAPO_SECRETS_FILE`` they stay out of it (every verl process reads them from that
#: file, :mod:`verl_patches.env_file`)
SECRET_ENV_NAMES = ("WANDB_API_KEY", "HF_TOKEN", "VLLM_API_KEY")
SECRETS_FILE_ENV = "STAPO_SECRETS_FILE"
LAUNCH_DIR_ENV = "STAPO_LAUNCH_DIR"
RUN_FILE_ENV_NAMES = ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "WANDB_DIR")
RUN_METRICS_FILE = "metrics.jsonl"
#: never uploaded with the job's working directory (gitignore patterns; a leading ``/`` anchors a name at
#: the project's root, so ``recipe/stapo/data/`` is shipped while the top-level ``data/`` is not); the
#: tiny CPU assets the repository ships serve CPU runs only, never a cluster job
WORKING_DIR_EXCLUDES = ("/.git", "/.venv", "/data", "/results", "/checkpoints", "/assets", "/wandb", "/outputs",
                        "/runs", "/stapo_cpu/shipped_assets", "__pycache__", ".pytest_cache", "*.egg-info",
                        "*.parquet", "*.safetensors")


def ensure_patch_module_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put :data:`PATCH_MODULE` first in ``VERL_USE_EXTERNAL_MODULES`` unless it is listed: where it is,
    it keeps its place, so a module listed before it (a platform the patches need, docs/cpu.md) imports first.
    """
    modules = [m for m in environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if PATCH_MODULE not in modules:
        modules.insert(0, PATCH_MODULE)
    environ["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``python -m recipe.stapo.main_stapo <overrides>`` would run with (interpolations
    unresolved, as Hydra gives it to the entry point).

    Raises ``ValueError`` naming the group for an unknown ``method=`` or ``model=``, naming the override
    for one :func:`override_problems` refuses, and with Hydra's message for an override Hydra refuses (a
    key that does not exist, bad syntax).
    """
    # hydra (a second to import) loads only here: jobs and the quickstart import this module without it
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    for override in overrides:
        for group, valid in (("method", tuple(methods())), ("model", MODELS)):
            if override.startswith(group + "=") and override.split("=", 1)[1] not in valid:
                raise ValueError(f"unknown {group} {override.split('=', 1)[1]!r}: expected one of {list(valid)}")
    refused = override_problems(overrides)
    if refused:
        raise ValueError("override refused: " + "; ".join(refused))
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except MissingConfigException as e:
        raise ValueError(str(e)) from e
    except (ConfigCompositionException, OverrideParseException) as e:  # a bad override: its message, no traceback
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise ValueError(f"override refused: {str(e).strip()}{cause}".replace("\n", " ")) from None


#: characters outside ASCII that stand for an ASCII one in an override (dashes and minus signs, quotes)
_ASCII_STAND_INS = {"-": "\u2010\u2011\u2012\u2013\u2014\u2212\ufe63\uff0d", "'": "\u2018\u2019\u201a\u2032",
                    '"': "\u201c\u201d\u201e\u2033"}


def _ascii_for(char: str) -> Optional[str]:
    """The ASCII character ``char`` stands for in an override (a digit of another script, a dash, a
    typographic quote, a space of another width), or None."""
    if unicodedata.category(char) == "Nd":
        return str(unicodedata.digit(char))
    if unicodedata.category(char) == "Zs":
        return " "
    for ascii_char, stand_ins in _ASCII_STAND_INS.items():
        if char in stand_ins:
            return ascii_char
    return None


def _unquoted_non_ascii(override: str) -> list[int]:
    """Positions of characters outside ASCII in ``override`` outside '...' and "..."."""
    positions, quote, escaped = [], None, False
    for i, char in enumerate(override):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif not char.isascii():
            positions.append(i)
    return positions


def override_problem(override: str) -> Optional[str]:
    """The fix for characters outside ASCII outside quotes in ``override`` (a full-width digit, a
    typographic dash or quote, text in another script), where Hydra's lexer stops with a bare caret; or None."""
    positions = _unquoted_non_ascii(override)
    if not positions:
        return None
    chars = [override[i] for i in positions]
    named = ", ".join(dict.fromkeys(f"{c!r} ({unicodedata.name(c, 'U+%04X' % ord(c))})" for c in chars))
    if all(_ascii_for(c) is not None for c in chars):
        fixed = "".join(_ascii_for(c) if i in positions else c for i, c in enumerate(override))
        fix = f"write it in ASCII: {fixed}"
    else:
        key, _, value = override.partition("=")
        fix = (f"quote the value: {key}='{value}'" if value and "'" not in value
               else "write it in ASCII, or quote the value")
    verb = "is not an ASCII character" if len(set(chars)) == 1 else "are not ASCII characters"
    return (f"{override}: {named} {verb}, and Hydra's override grammar reads unquoted keys and values in "
            f"ASCII only; {fix}")


#: a key's last part naming a credential, upper case, ``_`` between its words: API_KEY, SECRET or PASSWORD as words,
#: TOKEN as the last word (not ppo_max_token_len_per_gpu, STAPO_TOKEN_DUMP_DIR, tokenizer_path, STAPO_SECRETS_FILE)
_CREDENTIAL = re.compile(r"(^|_)(API_?KEY|SECRET|PASSWORD|PASSWD)(_|$)|(^|_)TOKEN$")


def credential_keys(key: str, value: object = None) -> list[str]:
    """``key`` and the keys of a dict ``value`` (nested) that name a credential (WANDB_API_KEY, HF_TOKEN,
    aws_secret_access_key, db.password, in any case)."""
    name = re.sub(r"[^A-Z0-9]+", "_", key.rsplit(".", 1)[-1].upper())
    found = [key] if _CREDENTIAL.search(name) else []
    for sub, item in (value.items() if isinstance(value, dict) else ()):
        found += credential_keys(f"{key}.{sub}", item)
    return found


@functools.cache
def recipe_keys() -> tuple[str, ...]:
    """Every key of the recipe's own config section (``recipe.*`` in the YAML), dotted, nested ones too;
    read once per process."""
    def walk(prefix: str, node) -> list[str]:
        subs = node.items() if isinstance(node, dict) else ()
        return [prefix, *(key for name, value in subs for key in walk(f"{prefix}.{name}", value))]

    section = OmegaConf.load(Path(CONFIG_DIR) / f"{CONFIG_NAME}.yaml").recipe
    return tuple(walk("recipe", OmegaConf.to_container(section, resolve=False))[1:])


def override_problems(overrides: Sequence[str]) -> list[str]:
    """What the driver refuses in ``overrides`` (flags left alone), each with its fix: a deletion
    (``~key``), a key added to the recipe's section that it does not have (nothing would read it), a
    credential (:func:`credential_keys`), and :func:`override_problem` of one Hydra refuses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # hydra only here: as in compose

    parser = OverridesParser.create()
    found = []
    for override in overrides:
        added = override.lstrip("+").split("=", 1)[0] if override.startswith("+") else ""
        if added.startswith("recipe.") and added not in recipe_keys():
            close = difflib.get_close_matches(added, recipe_keys(), n=1, cutoff=0.8)
            found.append(f"{override}: {added} is not a key of the recipe's config, so nothing would read it"
                         f"{f' (did you mean {close[0]}?)' if close else ''}; its keys: {', '.join(recipe_keys())}")
        if override.startswith("~"):
            found.append(f"{override}: deletes a key, which verl then fills with its config class's default, not the "
                         "recipe's (~actor_rollout_ref.actor.optim trains at a learning rate of 1e-3, 1000 times the "
                         "paper's); set the key's value instead (null where it takes none)")
        if override.startswith(("-", "~")) or "=" not in override:
            continue
        value, problem = None, None
        try:
            value = parser.parse_override(override).value()
        except Exception:  # noqa: BLE001  (Hydra's grammar errors differ by version; the override is named below)
            problem = override_problem(override)
        credentials = credential_keys(override.split("=", 1)[0].lstrip("+"), value)
        if credentials:  # named by its keys only: the override's text holds the credential
            name = credentials[0].rsplit(".", 1)[-1]
            found.append(f"{', '.join(credentials)}: names a credential, which no override may carry (`ray job list`, "
                         f"the config verl prints and wandb's run config would show it); export {name}=... instead "
                         f"(LAUNCH=submit forwards {', '.join(SECRET_ENV_NAMES)}), or write {name}=... in the file "
                         f"{SECRETS_FILE_ENV} names, which every verl process reads (docs/cluster.md, \"Secrets\")")
        elif problem:
            found.append(problem)
    return found


def ensure_loss_statistics(config: DictConfig, log: Callable[[str], None] = print) -> list[str]:
    """Set ``actor.calculate_entropy`` where the policy loss reads the update's own entropy
    (``needs_update_entropy``: ``stats_from=current`` with ``scope=micro_batch``); each change is logged
    through ``log``. Returns the overrides applied (``key=value`` strings).
    """
    try:
        settings = settings_of(config)
    except ValueError:  # a bad value: the preflight reports it, naming the key
        return []
    applied = []
    if (settings is not None and settings.needs_update_entropy
            and not OmegaConf.select(config, CALCULATE_ENTROPY)):
        with open_dict(config):
            OmegaConf.update(config, CALCULATE_ENTROPY, True, force_add=True)
        applied.append(f"{CALCULATE_ENTROPY}=true")
        log(f"[stapo] {POLICY_LOSS}.stats_from=current with scope=micro_batch reads the update's entropy: "
            f"setting {CALCULATE_ENTROPY}=true")
    return applied


def _is_remote(path: str) -> bool:
    return "://" in path


def absolute_path(path: str, cwd: Path) -> str:
    """``path`` (``~`` expanded) made absolute against ``cwd``; URIs (``hdfs://``...) unchanged."""
    if _is_remote(path):
        return path
    return str((cwd / Path(path).expanduser()).resolve())


def run_files_env(config: DictConfig, cwd: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Where the trainer writes a run's files: each of :data:`RUN_FILE_ENV_NAMES` from the config's
    :data:`RAY_ENV_VARS`, else ``environ``, made absolute against ``cwd``; by default the metrics file and
    tensorboard go beside the checkpoints (``trainer.default_local_dir``).
    """
    seen = seen_by_workers(config, environ)
    files = {}
    for name in RUN_FILE_ENV_NAMES:
        value = seen.get(name)
        if value not in (None, ""):
            files[name] = absolute_path(str(value), cwd)
    run_dir = OmegaConf.select(config, "trainer.default_local_dir", default=None)
    if isinstance(run_dir, str) and run_dir and not _is_remote(run_dir):
        run_dir = absolute_path(run_dir, cwd)
        if "VERL_FILE_LOGGER_PATH" not in files and "VERL_FILE_LOGGER_ROOT" not in files:
            files["VERL_FILE_LOGGER_PATH"] = os.path.join(run_dir, RUN_METRICS_FILE)
        files.setdefault("TENSORBOARD_DIR", os.path.join(run_dir, "tensorboard"))
    return files


def resolve_paths(config: DictConfig, cwd: Optional[str | os.PathLike] = None,
                  log: Callable[[str], None] = print, environ: Mapping[str, str] = os.environ) -> None:
    """Resolve every interpolation in ``config`` (in place) and make its paths absolute against ``cwd``
    (default: ``$STAPO_LAUNCH_DIR``, else the current directory), the run's files (:func:`run_files_env`)
    in :data:`RAY_ENV_VARS`: what the workers see then depends on neither their environment nor folder.
    """
    cwd = Path(cwd or environ.get(LAUNCH_DIR_ENV) or os.getcwd()).resolve()
    with open_dict(config):
        for key in DATA_PATH_KEYS + OUTPUT_PATH_KEYS:
            value = OmegaConf.select(config, key, default=None)  # resolves the interpolation
            if isinstance(value, str) and value:
                OmegaConf.update(config, key, absolute_path(value, cwd))
            elif isinstance(value, ListConfig):
                OmegaConf.update(config, key, [absolute_path(str(v), cwd) for v in value])
        for key in MODEL_PATH_KEYS:
            value = OmegaConf.select(config, key, default=None)
            if not isinstance(value, str) or not value:
                continue
            # explicitly local spellings always count; anything else is local only if it exists (not a hub id)
            local = value.startswith(("/", "./", "../", "~")) or (cwd / Path(value).expanduser()).exists()
            if local and not _is_remote(value):
                OmegaConf.update(config, key, absolute_path(value, cwd))
            else:
                log(f"[stapo] {key}={value} is not a local folder: verl will fetch it from the Hugging Face hub")
        for name, value in run_files_env(config, cwd, environ).items():
            OmegaConf.update(config, f"{RAY_ENV_VARS}.{name}", value, force_add=True)
    OmegaConf.resolve(config)


def wandb_run_id(project: str, experiment: str) -> str:
    """A wandb run id fixed by the project and experiment names: the experiment name with characters
    wandb refuses replaced, plus 8 hex digits of a hash of both names (unique after truncation)."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", experiment).strip("-")[:40] or "run"
    return f"{readable}-{hashlib.sha1(f'{project}/{experiment}'.encode()).hexdigest()[:8]}"


def ensure_wandb_resume(config: DictConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """With the wandb logger: ``WANDB_RUN_ID`` (:func:`wandb_run_id` unless exported) and ``WANDB_RESUME``
    (``allow`` unless exported) for every worker, so a resumed run continues its wandb run (verl's
    ``wandb.init`` passes no id). Returns the variables set.
    """
    loggers = OmegaConf.select(config, "trainer.logger", default=[]) or []
    if "wandb" not in ([loggers] if isinstance(loggers, str) else list(loggers)):
        return {}
    run_env = {
        "WANDB_RUN_ID": environ.get("WANDB_RUN_ID")
        or wandb_run_id(str(config.trainer.project_name), str(config.trainer.experiment_name)),
        "WANDB_RESUME": environ.get("WANDB_RESUME", "allow"),
    }
    with open_dict(config):
        for key, value in run_env.items():
            OmegaConf.update(config, f"{RAY_ENV_VARS}.{key}", value, force_add=True)
    return run_env


def stringify_ray_env_vars(config: DictConfig) -> None:
    """Ray accepts only string environment variables; the YAML interpolates numbers into them."""
    env_vars = OmegaConf.select(config, RAY_ENV_VARS)
    if env_vars:
        with open_dict(config):
            for key in list(env_vars):
                value = env_vars[key]
                env_vars[key] = "" if value is None else str(value)


def unresolvable_keys(config: DictConfig | ListConfig, prefix: str = "") -> dict[str, str]:
    """``{key: interpolation}`` of every key holding an interpolation omegaconf cannot resolve, in the
    config's order."""
    found: dict[str, str] = {}
    keys = range(len(config)) if isinstance(config, ListConfig) else list(config.keys())
    for key in keys:
        full = f"{prefix}[{key}]" if isinstance(config, ListConfig) else f"{prefix}.{key}" if prefix else str(key)
        if OmegaConf.is_interpolation(config, key):
            try:
                config[key]
            except OmegaConfBaseException:
                found[full] = str(config._get_node(key)._value())
            continue
        if OmegaConf.is_missing(config, key):
            continue
        child = config[key]
        if isinstance(child, (DictConfig, ListConfig)):
            found.update(unresolvable_keys(child, full))
    return found


def unresolvable(error: Exception, config: DictConfig) -> Problem:
    """The :class:`Problem` of an interpolation omegaconf cannot resolve, naming the key that holds it and
    the variable or key it missed."""
    failing = unresolvable_keys(config)
    # the first key that fails on its own, not just by referring to another failing key
    own = [key for key, expression in failing.items() if not any(o in expression for o in failing if o != key)]
    key = next(iter(own or failing), None) or getattr(error, "full_key", None) or "the config"
    text = str(getattr(error, "msg", None) or error).strip().splitlines()[0]
    variable = re.search(r"Environment variable '([^']+)' not found", text)
    if variable:
        fix = (f"export {variable.group(1)}=<value> before launching, or override the key that reads it with a "
               f"value (or give a default: ${{oc.env:{variable.group(1)},<default>}})")
    else:
        fix = "give the key it names a value (an override key=value), or correct the interpolation"
    return Problem(key, f"cannot be resolved: {text}", fix)


def prepare(config: DictConfig, cwd: Optional[str | os.PathLike] = None,
            log: Callable[[str], None] = print, environ: Optional[Mapping[str, str]] = None) -> DictConfig:
    """Everything the driver does to ``config`` (in place) before verl gets it, in order; returns it.
    Any mistake raises :class:`~recipe.stapo.preflight.PreflightError` (a ``ValueError``) before Ray starts.
    """
    bad_environment = check_environment()  # the variables the YAML interpolates, before resolving them
    if bad_environment:
        raise PreflightError(bad_environment)
    ensure_loss_statistics(config, log=log)
    try:
        resolve_paths(config, cwd=cwd, log=log)
    except OmegaConfBaseException as e:  # an interpolation that cannot be resolved: named, not a traceback
        raise PreflightError([unresolvable(e, config)]) from None
    ensure_wandb_resume(config)
    stringify_ray_env_vars(config)
    preflight_check(config, environ=environ, log=log)
    return config


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a submitted job carries (the constants above say which); with
    ``STAPO_SECRETS_FILE`` set, none of :data:`SECRET_ENV_NAMES` (the workers read them from that file)."""
    skip = set(NOT_FORWARDED_ENV_NAMES) | (set(SECRET_ENV_NAMES) if environ.get(SECRETS_FILE_ENV) else set())
    return {k: v for k, v in sorted(environ.items()) if k not in skip
            and (k in FORWARDED_ENV_NAMES or k.startswith(FORWARDED_ENV_PREFIXES))}


def job_runtime_env(environ: Mapping[str, str]) -> dict:
    """Runtime env of ``ray job submit``. ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1``: verl's driver calls
    ``ray.init`` with the config's runtime env, which Ray would otherwise refuse as a conflict with the job's.
    """
    env = dict(environ)
    if env.get("VERL_USE_EXTERNAL_MODULES"):
        ensure_patch_module_env(env)
    # else the job leaves the variable to the node's environment (the CPU path names its platform module
    # there), and the driver puts the recipe's patches first itself (main_stapo)
    env_vars = forwarded_env(env)
    env_vars["RAY_OVERRIDE_JOB_RUNTIME_ENV"] = "1"
    return {"env_vars": env_vars, "excludes": list(WORKING_DIR_EXCLUDES)}


def _main(argv: Sequence[str]) -> int:
    """``python -m recipe.stapo.driver runtime-env [OVERRIDE...]``: print :func:`job_runtime_env` as JSON (on stderr
    a warning naming the secrets it carries), or refuse the job's overrides (:func:`override_problems`, exit 1)."""
    usage = "usage: python -m recipe.stapo.driver runtime-env [OVERRIDE...]   (the Ray job runtime env of LAUNCH=submit)"
    if list(argv) in (["--help"], ["-h"]):
        print(usage)
        return 0
    if list(argv[:1]) != ["runtime-env"]:
        print(usage, file=sys.stderr)
        return 2
    refused = override_problems(argv[1:])
    if refused:
        print("[stapo] override refused (nothing was submitted):\n" + "\n".join(f"  - {r}" for r in refused),
              file=sys.stderr)
        return 1
    runtime_env = job_runtime_env(os.environ)
    shown = [name for name in SECRET_ENV_NAMES if name in runtime_env["env_vars"]]  # readable in `ray job list`
    if shown:
        print(f"[stapo] warning: {', '.join(shown)} travel in the job's runtime env, which `ray job list` and the "
              f"dashboard show in plain text to anyone who reaches the dashboard; {SECRETS_FILE_ENV}=<file only you "
              f"can read> keeps them out (docs/cluster.md, \"Secrets\")", file=sys.stderr)
    print(json.dumps(runtime_env, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
