"""Single values: the type and range of config values whose bad value verl reports only after Ray
has started (minutes in, often without the key's name), the logger list, a second writer of the
run's metrics file, and the environment variables the recipe's YAML reads as numbers.

Each check of :data:`VALUE_CHECKS` says what verl does with a bad value (read from verl 0.9.1's
trainer, workers and config dataclasses). :func:`check_environment` parses the environment variables
(``GPU_MEM_GB``) once, before the config is resolved, so that a bad one is named instead of failing
inside omegaconf.

Importing this module imports no verl.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from .problem import ACTOR, ROLLOUT, Problem, is_int

_ABSENT = object()


def _is_number(value) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class ValueCheck:
    """A key, the test its value must pass, what that means (``what``: "a whole number >= 1", ...),
    what verl does otherwise (``why``) and the fix."""

    key: str
    test: Callable[[object], bool]
    what: str
    why: str
    fix: str
    optional: bool = False  # null is allowed


def _int_at_least(low: int) -> Callable[[object], bool]:
    return lambda v: is_int(v) and v >= low


def _number_in(low: float, high: float, low_open: bool, high_open: bool) -> Callable[[object], bool]:
    def test(v) -> bool:
        if not _is_number(v):
            return False
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    return test


def _one_of(*choices: str) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and v in choices


def _is_bool(value) -> bool:
    return isinstance(value, bool)


_FRACTION = _number_in(0.0, 1.0, True, False)
_NON_NEGATIVE = _number_in(0.0, math.inf, False, True)
_POSITIVE = _number_in(0.0, math.inf, True, True)

VALUE_CHECKS: tuple[ValueCheck, ...] = (
    # the optimiser (verl's FSDP engine builds it in every worker)
    ValueCheck(f"{ACTOR}.optim.lr", _NON_NEGATIVE, "a number >= 0",
         "the workers' optimiser fails with a TypeError minutes after Ray starts", "the paper: 1e-6"),
    ValueCheck(f"{ACTOR}.optim.weight_decay", _NON_NEGATIVE, "a number >= 0",
         "the workers' optimiser refuses it after Ray starts", "the paper: 0.1"),
    ValueCheck(f"{ACTOR}.optim.lr_warmup_steps", _int_at_least(-1), "a whole number >= -1 (-1: use lr_warmup_steps_ratio)",
         "the workers' scheduler fails after Ray starts", "the paper: 10", optional=True),
    ValueCheck(f"{ACTOR}.optim.lr_warmup_steps_ratio", _number_in(0.0, 1.0, False, False), "a number in [0, 1]",
         "the workers' scheduler fails after Ray starts", "e.g. 0.0"),
    ValueCheck(f"{ACTOR}.optim.clip_grad", _POSITIVE, "a number > 0",
         "gradient clipping fails in the workers after Ray starts", "the paper: 1.0"),
    ValueCheck(f"{ACTOR}.optim.lr_scheduler_type", _one_of("constant", "cosine"), "'constant' or 'cosine'",
         "verl's FSDP engine refuses it when the workers start", "the paper: constant"),
    # the update
    ValueCheck(f"{ACTOR}.ppo_epochs", _int_at_least(1), "a whole number >= 1",
         "with no update the trainer fails at the end of the first step (KeyError: 'actor/mfu')", "the paper: 1"),
    ValueCheck(f"{ACTOR}.clip_ratio_low", _number_in(0.0, 1.0, False, True), "a number in [0, 1)",
         "the ratio's lower clip bound 1 - clip_ratio_low must stay above 0, or the clip never acts",
         "the paper: 0.2 (bounds [0.8, 1.28])", optional=True),
    ValueCheck(f"{ACTOR}.clip_ratio_high", _NON_NEGATIVE, "a number >= 0",
         "the ratio's upper clip bound 1 + clip_ratio_high would fall below 1 and clip every improving token",
         "the paper: 0.28", optional=True),
    ValueCheck(f"{ACTOR}.clip_ratio", _NON_NEGATIVE, "a number >= 0",
         "the clip bounds would be wrong in every update", "verl's default: 0.2"),
    ValueCheck(f"{ACTOR}.clip_ratio_c", _number_in(1.0, math.inf, True, True), "a number > 1",
         "verl's policy loss asserts it in the first update, after the first rollout", "the paper's runs: 10.0"),
    ValueCheck(f"{ACTOR}.entropy_coeff", _is_number, "a number", "the loss fails in the first update", "the paper: 0"),
    ValueCheck(f"{ACTOR}.kl_loss_coef", _NON_NEGATIVE, "a number >= 0", "the loss fails in the first update", "e.g. 0.001"),
    # sampling
    ValueCheck(f"{ROLLOUT}.temperature", _POSITIVE, "a number > 0",
         "the log-probabilities divide by it (0 gives infinities) or vLLM refuses it after Ray starts", "the paper: 1.0"),
    ValueCheck(f"{ROLLOUT}.top_p", _FRACTION, "a number in (0, 1]", "vLLM refuses it when the rollout starts, after Ray",
         "the paper: 1.0"),
    ValueCheck(f"{ROLLOUT}.top_k", _int_at_least(-1), "a whole number >= -1 (-1: off)",
         "vLLM refuses it when the rollout starts, after Ray", "-1"),
    ValueCheck(f"{ROLLOUT}.gpu_memory_utilization", _FRACTION, "a number in (0, 1]",
         "vLLM refuses it when its engine starts, after Ray (a fraction of each GPU's memory)", "e.g. 0.6"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.n", _int_at_least(1), "a whole number >= 1",
         "validation fails at its first batch, after Ray starts", "the paper: 32"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.top_p", _FRACTION, "a number in (0, 1]", "vLLM refuses it at the first validation",
         "the paper: 0.9"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.temperature", _NON_NEGATIVE, "a number >= 0",
         "vLLM refuses it at the first validation", "the paper: 0.7"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.top_k", _int_at_least(-1), "a whole number >= -1 (-1: off)",
         "vLLM refuses it at the first validation", "-1"),
    ValueCheck(f"{ROLLOUT}.val_kwargs.do_sample", _is_bool, "true or false", "validation reads it as a truth value",
         "the paper: true"),
    # the trainer loop
    ValueCheck("trainer.total_training_steps", _int_at_least(1), "a whole number >= 1 (or null: total_epochs decides)",
         "the trainer fails computing its schedule, after Ray starts", "the paper: 3000", optional=True),
    ValueCheck("trainer.total_epochs", _int_at_least(1), "a whole number >= 1",
         "the trainer fails computing its schedule, after Ray starts", "e.g. 1000"),
    ValueCheck("trainer.test_freq", _int_at_least(-1), "a whole number (-1 or 0: never validate)",
         "the trainer compares it with the step after the first step, after Ray starts", "the paper: 20"),
    ValueCheck("trainer.save_freq", _int_at_least(-1), "a whole number (-1 or 0: never save)",
         "the trainer compares it with the step after the first step, after Ray starts", "the paper: 100"),
    ValueCheck("trainer.resume_mode", _one_of("auto", "disable", "resume_path"), "one of auto, disable, resume_path",
         "the trainer ignores or refuses an unknown mode when it loads checkpoints, after Ray starts", "auto"),
    ValueCheck("trainer.val_before_train", _is_bool, "true or false", "the trainer reads it as a truth value", "true"),
    ValueCheck("trainer.max_actor_ckpt_to_keep", _int_at_least(1), "a whole number >= 1 (or null: keep all)",
         "checkpoint pruning fails at the first save", "the recipe: 3", optional=True),
    ValueCheck("data.shuffle", _is_bool, "true or false", "the data loader reads it as a truth value", "true"),
    ValueCheck("data.truncation", _one_of("error", "left", "right", "middle"), "one of error, left, right, middle",
         "the dataset refuses it at its first long prompt", "the recipe: error"),
)


def _shown(value) -> object:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value)
    return value


def check_values(config: DictConfig) -> list[Problem]:
    """One problem per value of :data:`VALUE_CHECKS` that fails its test, plus the logger list
    (verl's backends) and ``recipe.gpu_mem_gb`` given as true/false. A key the config does not have
    is not checked (verl then uses its default)."""
    found: list[Problem] = []
    for value_check in VALUE_CHECKS:
        value = OmegaConf.select(config, value_check.key, default=_ABSENT)
        if value is _ABSENT or (value is None and value_check.optional):
            continue
        if not value_check.test(value):
            found.append(Problem(value_check.key, f"must be {value_check.what} ({value_check.why})",
                                 f"set {value_check.key} to {value_check.what}; {value_check.fix}", _shown(value)))
    _check_logger(config, found)
    _check_metrics_writer(config, found)
    gpu_mem = OmegaConf.select(config, "recipe.gpu_mem_gb", default=None)
    if isinstance(gpu_mem, bool):
        found.append(Problem("recipe.gpu_mem_gb", "the target GPU's memory in GB must be a number, not true/false",
                      "set GPU_MEM_GB (or recipe.gpu_mem_gb) to a number of GiB, e.g. 80", gpu_mem))
    return found


def _check_logger(config: DictConfig, found: list[Problem]) -> None:
    """``trainer.logger``: a name or a list of names of verl's tracking backends (verl asserts it when
    the trainer builds its tracker, after Ray starts)."""
    value = OmegaConf.select(config, "trainer.logger", default=_ABSENT)
    if value is _ABSENT:
        return
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, ListConfig) else None
    supported = supported_loggers()
    if names is None or not all(isinstance(n, str) for n in names):
        found.append(Problem("trainer.logger", "must be a list of logger names", f"e.g. trainer.logger=[console,wandb] "
                             f"(verl's loggers: {', '.join(supported)})", _shown(value)))
        return
    unknown = [n for n in names if n not in supported and n != "tracking"]
    if unknown:
        hints = [f"{n} -> {close[0]}" for n in unknown if (close := difflib.get_close_matches(n, supported, n=1))]
        found.append(Problem("trainer.logger", f"{', '.join(map(repr, unknown))} is not one of verl's loggers (verl "
                             "asserts it when the trainer starts, after Ray)",
                             (f"did you mean {'; '.join(hints)}? " if hints else "")
                             + f"verl's loggers: {', '.join(supported)}", _shown(value)))


def _check_metrics_writer(config: DictConfig, found: list[Problem]) -> None:
    """The run's metrics file (``VERL_FILE_LOGGER_PATH`` the driver passes to the workers) has no
    writer now: another launch of the same run still training would lose records to this one (the
    logger itself refuses a second writer too, but only after Ray has started)."""
    # importing verl_patches applies the patches, which imports verl: only after VERL_USE_EXTERNAL_MODULES is set
    from verl_patches.resume import MetricsFileBusy, check_no_writer

    path = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH", default=None)
    loggers = OmegaConf.select(config, "trainer.logger", default=None)
    names = [loggers] if isinstance(loggers, str) else list(loggers) if isinstance(loggers, ListConfig) else []
    if not path or "file" not in names:
        return
    try:
        check_no_writer(path)
    except MetricsFileBusy as e:
        found.append(Problem("trainer.default_local_dir", str(e), "wait for the other launch to end (or stop it), or "
                      "give this run another trainer.default_local_dir (CKPT_DIR) or experiment name", path))
    except OSError:
        return  # a file this process cannot open: left to the logger, which names it


def supported_loggers() -> list[str]:
    """verl's tracking backends (``verl.utils.tracking.Tracking.supported_backend``)."""
    from verl.utils.tracking import Tracking  # verl loads only after VERL_USE_EXTERNAL_MODULES is set

    return list(Tracking.supported_backend)


# ------------------------------------------------------------------------------------------------
# environment variables
# ------------------------------------------------------------------------------------------------

#: environment variables the YAML reads as numbers: name -> (what, example)
NUMBER_ENV = {"GPU_MEM_GB": ("the target GPU's memory in GiB (recipe.gpu_mem_gb)", "80")}


def positive_number_from_env(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The positive finite number ``environ[name]`` holds, or None when it is unset.

    Raises:
        ValueError: naming the variable, its value and an example, for anything else: empty, a word
            (``true``), a list (``[80]``), zero, a negative number, NaN or infinity.
    """
    environ = os.environ if environ is None else environ
    if name not in environ:
        return None
    raw = environ[name]
    what, example = NUMBER_ENV.get(name, ("a number", "1"))
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        shown = "set but empty" if not raw.strip() else f"{raw!r}, not a positive number"
        raise ValueError(f"environment variable {name} is {shown}: it is {what}. Set e.g. {name}={example}, "
                         f"or unset it for the default")
    return value


def check_environment(environ: Optional[Mapping[str, str]] = None) -> list[Problem]:
    """A problem for each variable of :data:`NUMBER_ENV` that is set
    to something other than a positive number (checked before the config is resolved: omegaconf
    would fail on it with a long traceback that does not name the variable, or read ``true`` as 1)."""
    found: list[Problem] = []
    for name in NUMBER_ENV:
        try:
            positive_number_from_env(name, environ)
        except ValueError as e:
            found.append(Problem(name, str(e), f"export {name}={NUMBER_ENV[name][1]} (or unset it)"))
    return found
