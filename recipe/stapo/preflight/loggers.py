"""What the trainer's tracker needs when it starts: names, loggers, wandb's settings and credentials, folders."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from stapo_core.fileio import probe_writable

from .problem import Problem, shown
from .values import logger_names, origin, read_secrets_file, seen_by_workers

LOGGER_KEY = "trainer.logger"
#: the package verl imports when the tracker starts each backend (``verl.utils.tracking.Tracking``)
LOGGER_PACKAGES = {"wandb": "wandb", "tracking": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow",
                   "swanlab": "swanlab", "vemlp_wandb": "volcengine_ml_platform", "clearml": "clearml",
                   "trackio": "trackio", "rl_insight": "rl_insight"}
#: wandb modes that need no credentials
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")
WANDB_DEFAULT_HOST = "https://api.wandb.ai"
_WANDB_FIX = ("run `wandb login` (it writes ~/.netrc), or put WANDB_API_KEY in STAPO_SECRETS_FILE (or export it), or "
              "log offline (WANDB_MODE=offline; `wandb sync` later), or leave wandb out: LOGGER=console,file in the "
              "run scripts (trainer.logger=[console,file])")


def check_loggers(config: DictConfig, environ: Mapping[str, str]) -> list[Problem]:
    """Every problem of the module docstring's list (``environ``: the launching environment)."""
    found = check_run_names(config)
    names = _check_logger_list(config, found)
    if names is None:
        return found
    for name in names:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            found.append(Problem(LOGGER_KEY, f"the {name} logger needs the package {package}, which is not installed "
                                 "here (verl imports it when the trainer's tracker starts, after Ray, the model load "
                                 "and vLLM's start)", f"pip install {package}, or drop {name} from {LOGGER_KEY}",
                                 names))
    seen = seen_by_workers(config, environ)
    submit = environ.get("LAUNCH", "") == "submit"
    wandb = "wandb" in names or "tracking" in names
    if wandb:
        found += check_wandb(config, environ, submit)
    for variable, logger, used in (("TENSORBOARD_DIR", "tensorboard", "tensorboard" in names),
                                   ("WANDB_DIR", "wandb", wandb)):
        folder = seen.get(variable)
        if used and folder and "://" not in folder and not submit:
            reason = probe_writable(Path(folder).expanduser())
            if reason:
                found.append(Problem(origin(config, variable), f"{folder} cannot be created or written: {reason} "
                                     f"(the {logger} logger writes there from the trainer, after Ray starts)",
                                     f"point {variable} to a folder this user can write, or unset it", folder))
    return found


def check_run_names(config: DictConfig) -> list[Problem]:
    """The project and experiment names are not empty; with wandb, the project name passes wandb's check."""
    found = []
    for key, what in (("trainer.project_name", "PROJECT"), ("trainer.experiment_name", "EXPERIMENT")):
        value = OmegaConf.select(config, key, default=None)
        if value is None or not str(value).strip():
            found.append(Problem(key, "is empty: the project and experiment names name the run (its checkpoint "
                                 "folder <CKPT_DIR>/<project>/<experiment>, the metrics file <VERL_FILE_LOGGER_ROOT>/"
                                 "<project>/<experiment>.jsonl, the wandb run and the id a relaunch continues)",
                                 f"give it a name ({what} in the run scripts)", value))
    names = logger_names(config) or []
    project = OmegaConf.select(config, "trainer.project_name", default=None)
    if ("wandb" in names or "tracking" in names) and project is not None and str(project).strip():
        problem = _wandb_settings_problem({"project": str(project)})
        if problem:
            found.append(Problem("trainer.project_name", f"wandb refuses it as a project name ({problem}); wandb.init "
                                 "would fail when the trainer's tracker starts, after Ray",
                                 "use a name without / \\ # ? % : of at most 128 characters (PROJECT in the run "
                                 "scripts)", project))
    return found


def _check_logger_list(config: DictConfig, found: list[Problem]) -> Optional[list[str]]:
    """``trainer.logger``'s names, or None (with a problem) when they are not usable."""
    value = OmegaConf.select(config, LOGGER_KEY, default=None)
    if value is None and not OmegaConf.select(config, "trainer", default=None):
        return None
    from verl.utils.tracking import Tracking  # verl loads only after VERL_USE_EXTERNAL_MODULES is set

    names, value = logger_names(config), shown(value)
    supported = list(Tracking.supported_backend)
    if names is None or not all(isinstance(n, str) for n in names):
        found.append(Problem(LOGGER_KEY, "must be a list of logger names", f"e.g. trainer.logger=[console,wandb] "
                             f"(verl's loggers: {', '.join(supported)})", value))
        return None
    if not names:
        found.append(Problem(LOGGER_KEY, "is empty: the run would record no metric at all (verl logs a step's metrics "
                             "only through its loggers)", "name at least one, e.g. trainer.logger=[console,file] (the "
                             "metrics file <trainer.default_local_dir>/metrics.jsonl)", value))
        return None
    unknown = [n for n in names if n not in supported and n != "tracking"]
    if unknown:
        hints = [f"{n} -> {close[0]}" for n in unknown if (close := difflib.get_close_matches(n, supported, n=1))]
        found.append(Problem(LOGGER_KEY, f"{', '.join(map(repr, unknown))} is not one of verl's loggers (verl "
                             "asserts it when the trainer starts, after Ray)",
                             (f"did you mean {'; '.join(hints)}? " if hints else "")
                             + f"verl's loggers: {', '.join(supported)}", value))
        return None
    return names


def _wandb_settings_problem(values: Mapping[str, str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What wandb's settings reader refuses in ``values`` and ``environ``, in its words (None: nothing)."""
    if importlib.util.find_spec("wandb") is None:
        return None
    # wandb (a second to import) loads only where a run logs to it: its own reader decides
    from wandb import Settings

    try:
        settings = Settings(**values)
        if environ:
            settings.update_from_env_vars(dict(environ))
    except Exception as e:  # noqa: BLE001  (wandb's UsageError and pydantic's ValidationError alike)
        return " ".join(str(e).split())[:300]
    return None


def check_wandb(config: DictConfig, environ: Mapping[str, str], submit: bool) -> list[Problem]:
    """wandb's settings from the ``WANDB_*`` variables the workers see (else the secrets file's), and its
    credentials (not in submit mode)."""
    seen = seen_by_workers(config, environ)
    env = {n: v for n, v in sorted(seen.items()) if n.startswith("WANDB_")}
    try:
        secrets = read_secrets_file(seen.get("STAPO_SECRETS_FILE") or "")
    except (ValueError, OSError):  # the run environment's check names the file
        secrets = {}
    env.update({n: v for n, v in secrets.items() if n.startswith("WANDB_") and n not in env})
    found = []
    for name, value in env.items():
        problem = None if name == "WANDB_API_KEY" else _wandb_settings_problem({}, {name: value})
        if problem:
            found.append(Problem(origin(config, name), f"wandb refuses it ({problem}); wandb.init would fail when the "
                                 "trainer's tracker starts, after Ray", f"correct {name}, or unset it", value))
    if submit or found:
        return found
    missing = wandb_credentials_problem(env)
    if missing:
        found.append(Problem(LOGGER_KEY, f"the wandb logger {missing}: wandb.init would stop with \"No API key "
                             "configured\" when the trainer's tracker starts, after Ray, the model load and vLLM's "
                             "start", _WANDB_FIX, "wandb"))
    return found


def wandb_credentials_problem(env: Mapping[str, str]) -> Optional[str]:
    """What wandb will not find in ``env`` and the netrc file (None: it needs none, or finds a valid key)."""
    mode = env.get("WANDB_MODE", "online").strip().lower()
    if mode in WANDB_LOCAL_MODES or importlib.util.find_spec("wandb") is None:
        return None
    # wandb's credential readers (as for its settings above): the checks wandb.init runs
    from wandb.sdk.lib.wbauth import validation, wbnetrc

    if env.get("WANDB_API_KEY"):
        bad = validation.check_api_key(env["WANDB_API_KEY"])
        return f"has a WANDB_API_KEY wandb refuses ({bad})" if bad else None
    if env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    try:
        if wbnetrc.read_netrc_auth(host=env.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST):
            return None
    except Exception as e:  # noqa: BLE001  (wandb's AuthenticationError: a key of the wrong form)
        return f"finds a netrc entry wandb refuses ({e})"
    return (f"has no credentials: no WANDB_API_KEY (in the environment, the config's runtime env or the secrets file), "
            f"no WANDB_IDENTITY_TOKEN_FILE, no netrc entry for {env.get('WANDB_BASE_URL') or WANDB_DEFAULT_HOST}, and "
            f"WANDB_MODE is {mode!r}")
