"""verl's own validation before Ray, each refusal in verl's words naming the key, file or column."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import io
import re
import tempfile
import traceback
import types
import typing
import warnings
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from .numbers import uses_reference
from .problem import ACTOR, NO_VALUE, Problem, is_int, pick, shown

#: the config sections verl converts into its config classes after Ray starts, and when it converts each
SECTIONS: tuple[tuple[str, Callable[[DictConfig], bool]], ...] = (
    (ACTOR, lambda config: True),
    ("actor_rollout_ref.rollout", lambda config: True),
    ("actor_rollout_ref.ref", uses_reference),
    ("critic", lambda config: _verl_says("need_critic", config)),
    ("distillation", lambda config: bool(pick(config, "distillation.enabled", False))),
    ("skip", lambda config: True),
    ("trainer.v1.separate_async.hybrid_rollout",
     lambda config: pick(config, "trainer.v1.trainer_mode") == "separate_async"),
)
#: what ``ActorRolloutRefWorker.init_model`` renames in the reference's section before converting it
REF_RENAMES = {"log_prob_micro_batch_size": "ppo_micro_batch_size",
               "log_prob_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu",
               "log_prob_use_dynamic_bsz": "use_dynamic_bsz", "log_prob_max_token_len_per_gpu": "ppo_max_token_len_per_gpu"}
#: rows the dataset check reads from the start of every data file
SAMPLE_ROWS = 16
MODEL = "actor_rollout_ref.model"
_FIX = "correct the value verl names (docs/preflight.md)"


def _verl_says(name: str, config: DictConfig) -> bool:
    """verl's own answer (``verl.trainer.ppo.utils.<name>``), without its warnings."""
    from verl.trainer.ppo import utils  # verl only where a check runs (this module imports none)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(getattr(utils, name)(config))


@functools.cache
def verl_defaults() -> dict:
    """verl's whole default config (its ``_generated_ppo_trainer.yaml``), parsed once."""
    import verl  # its location only (the package is imported already wherever this runs)
    import yaml

    text = (Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml").read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def _fields(target: str) -> Optional[tuple[type, dict]]:
    """(the class, its fields' declared types) of the config class ``target`` names; None if not a dataclass."""
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return (cls, typing.get_type_hints(cls)) if dataclasses.is_dataclass(cls) else None
    except Exception:  # noqa: BLE001  (an unknown target is the conversion's to report)
        return None


def _matches(value, hint) -> bool:
    """Whether a config value has the type ``hint`` declares, as verl uses it: an int is a float, a number
    is text (it reads as its digits); null is checked by the caller, anything else verl declares is not."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint) if arg is not type(None))
    kinds = {bool: lambda v: isinstance(v, bool), int: is_int, float: lambda v: is_int(v) or isinstance(v, float),
             str: lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool),
             list: lambda v: isinstance(v, (ListConfig, list)), tuple: lambda v: isinstance(v, (ListConfig, tuple)),
             dict: lambda v: isinstance(v, (DictConfig, dict))}
    simple = typing.get_origin(hint) or hint
    return value is None or kinds[simple](value) if simple in kinds else True


def _takes_null(hint, default) -> bool:
    """Whether verl takes null for a key: its type allows it, its default is null (verl's own config writes null
    into some fields typed otherwise), or its type is not checked."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return type(None) in args or default is None or _matches(object(), hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(arg) for arg in typing.get_args(hint)))
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text", type(None): "null",
             list: "a list", tuple: "a list", dict: "a mapping"}
    return names.get(typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint)))


def check_declared_types(config: DictConfig, skip: frozenset = frozenset()) -> list[Problem]:
    """One problem per value whose type is not verl's (its class's field's, else its default's), beyond ``skip``."""
    found: list[Problem] = []

    def walk(node: DictConfig, prefix: str, fields: Optional[tuple[type, dict]], defaults) -> None:
        for key in node:
            if key == "_target_" or OmegaConf.is_missing(node, key):
                continue
            full, value = f"{prefix}.{key}" if prefix else str(key), node[key]
            default = (defaults if isinstance(defaults, dict) else {}).get(key, _field_default(fields, key))
            default = None if isinstance(default, str) and default.startswith("${") else default  # not known here
            hint = fields[1].get(key) if fields else type(default) if type(default) in (bool, int, float, str) else None
            if isinstance(value, DictConfig):
                target = value.get("_target_") if "_target_" in value else None
                sub = _fields(target) if isinstance(target, str) else None
                if sub is None and dataclasses.is_dataclass(hint):
                    sub = (hint, typing.get_type_hints(hint))
                if sub is not None or fields is None:
                    walk(value, full, sub, default)
            elif hint is None or full in skip or isinstance(value, ListConfig) and not fields and hint is str:  # a list of files
                continue
            elif not _matches(value, hint) or value is None and not _takes_null(hint, default):
                what = _type_name(hint)
                declared = (f"verl's {fields[0].__name__}.{key} is {what}" if fields
                            else f"verl's default for it is {default!r}")
                why = (f"; verl reads any other value by its truth, so {value!r} would run as {bool(value)}"
                       if hint is bool else ": verl checks no type when it builds its config, so the value fails "
                       "where it is first used, after Ray starts")
                found.append(Problem(full, f"must be {what} ({declared}){why}", f"set {full} to {what}", shown(value)))

    walk(config, "", None, verl_defaults())
    return found


def _field_default(fields: Optional[tuple[type, dict]], key: str):
    """The default a config class gives its field ``key`` (None when it has none, or a factory)."""
    field = {f.name: f for f in dataclasses.fields(fields[0])}.get(key) if fields else None
    return field.default if field is not None and field.default is not dataclasses.MISSING else None


def _words(error: BaseException) -> str:
    """What an error says: its message, or for a bare ``assert`` the statement that failed."""
    text = str(error).strip()
    if text:
        return f"{type(error).__name__}: {text}" if not isinstance(error, (ValueError, AssertionError)) else text
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1].line if frames and frames[-1].line else type(error).__name__


#: what an error may call a key by: torch two optimizer keys, verl the reference's keys it renamed
_SAID = {"learning rate": "lr", "beta": "betas", **{new: old for old, new in REF_RENAMES.items()}}


def _named_key(config: DictConfig, section: str, words: str, line: str = "") -> str:
    """The key of ``section`` an error is about: the field it names first (or calls as torch does,
    :data:`_SAID`), then the field the ``line`` that raised it reads, else the one field whose value it
    quotes; the section itself when it names none."""
    node = pick(config, section)
    if not isinstance(node, DictConfig):
        return section
    fields = [str(k) for k in node if k != "_target_" and not OmegaConf.is_missing(node, k)]
    said = words + "".join(f" {key}" for phrase, key in _SAID.items() if phrase in words.lower()) + f" {line}"
    named = sorted((m.start(), k) for k in fields for m in [re.search(rf"(?<!\w){re.escape(k)}(?!\w)", said)] if m)
    quoted = [k for k in fields if not isinstance(node[k], DictConfig) and len(str(node[k])) > 1
              and re.search(rf"(?<![\w.-]){re.escape(str(node[k]))}(?![\w.])", words)]
    key = named[0][1] if named else quoted[0] if len(quoted) == 1 else None
    return f"{section}.{key}" if key else section


def verl_problem(config: DictConfig, section: str, error: BaseException, who: str, fix: str = _FIX) -> Problem:
    """The :class:`Problem` of ``error`` raised by verl (``who``) on ``section``, naming its key and value."""
    words, frames = _words(error), traceback.extract_tb(error.__traceback__)
    key = _named_key(config, section, words, (frames[-1].line or "") if frames else "")
    value = pick(config, key)
    named = NO_VALUE if key == section or isinstance(value, DictConfig) else shown(value)
    return Problem(key, f"{who} refuses it: {words}", fix, named)


#: (section, its YAML, a stamp of its files) -> (the config object, the error), for the advice's reruns
_CONVERTED: dict[tuple, tuple] = {}


def convert(config: DictConfig, section: str, found: list[Problem], node=None, files: tuple = ()):
    """``section`` (or ``node``, the section as verl has changed it) converted into its config class as verl
    converts it, once per process; None with a problem in ``found`` when verl refuses it."""
    from hydra.errors import InstantiationException  # hydra and verl only where a check runs
    from verl.utils.config import omega_conf_to_dataclass

    node = pick(config, section) if node is None else node
    key = (section, OmegaConf.to_yaml(node, resolve=True), files)
    if key not in _CONVERTED:
        try:
            _CONVERTED[key] = omega_conf_to_dataclass(node), None
        except Exception as e:  # noqa: BLE001  (anything a config class raises stops verl's workers after Ray)
            _CONVERTED[key] = None, e
    built, error = _CONVERTED[key]
    if isinstance(error, InstantiationException):
        inner = re.search(r"full_key: (\S+)", str(error))
        where = inner.group(1) if inner else section
        target = pick(config, f"{where}._target_") or "config class"
        found.append(verl_problem(config, where, error.__cause__ or error, f"verl's {str(target).rsplit('.', 1)[-1]} "
                                  "(built when the workers start, after Ray)"))
    elif error is not None:
        found.append(verl_problem(config, section, error, f"verl's {section} config (built after Ray starts)"))
    return built


def _reference_section(config: DictConfig) -> DictConfig:
    """The reference's section as ``ActorRolloutRefWorker.init_model`` hands it to verl's conversion."""
    ref = OmegaConf.create(OmegaConf.to_container(pick(config, "actor_rollout_ref.ref"), resolve=True))
    with open_dict(ref):
        ref.ppo_mini_batch_size = pick(config, f"{ACTOR}.ppo_mini_batch_size")
        for old, new in REF_RENAMES.items():
            ref[new] = ref.pop(old, False if new == "use_dynamic_bsz" else None)
    return ref


def check_optimizer(config: DictConfig, section: str, optim, found: list[Problem]) -> None:
    """verl's optimizer builder, as the FSDP engine calls it, on a stand-in parameter, then one step."""
    import torch  # torch and verl only where a check runs
    from verl.workers.config.optimizer import build_optimizer

    try:
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], optim).step()  # the step reads what the builder does not
    except AttributeError:
        module = importlib.import_module(optim.optimizer_impl)
        close = [n for n in dir(module) if n.lower() == str(optim.optimizer).lower()]
        close = close or difflib.get_close_matches(str(optim.optimizer), dir(module), n=1)
        found.append(Problem(f"{section}.optimizer", f"verl's optimizer builder finds no class {optim.optimizer!r} in "
                             f"{optim.optimizer_impl} (it fails there when the workers start, after Ray and the model "
                             "load)", (f"did you mean {section}.optimizer={close[0]}? " if close else "")
                             + f"the name of an optimizer class of {section}.optimizer_impl (the recipe: AdamW)",
                             optim.optimizer))
    except Exception as e:  # noqa: BLE001  (what torch's optimizer refuses stops every worker after Ray)
        found.append(verl_problem(config, section, e, "the optimizer verl builds (torch's own check)"))


def _validate_config(config: DictConfig, found: list[Problem]) -> None:
    """verl's ``validate_config``, as ``verl.trainer.main_ppo.main`` runs it."""
    from verl.utils.config import validate_config  # verl only where a check runs

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its "all checks passed" line
            validate_config(config=config, use_reference_policy=uses_reference(config),
                            use_critic=_verl_says("need_critic", config))
    except Exception as e:  # noqa: BLE001  (verl's own checks: asserts, ValueErrors)
        words = _words(e)
        named = [k for k in re.findall(r"[a-z_]+(?:\.[a-z_0-9]+)+", words) if pick(config, k) is not None]
        keys = [k for k in named if not isinstance(pick(config, k), DictConfig)] or named  # a value before its section
        found.append(Problem(keys[0] if keys else "the config", f"verl's validate_config refuses it: {words}", _FIX))


def check_verl_configs(config: DictConfig, found: list[Problem], numbers_ok: bool = True) -> bool:
    """Declared types, :data:`SECTIONS` converted, verl's ``validate_config``; whether the types passed."""
    # the patches every worker runs with (verl loads only after VERL_USE_EXTERNAL_MODULES is set)
    import verl_patches.activate  # noqa: F401

    typed = check_declared_types(config, frozenset(p.key for p in found))
    found += typed
    refused = {p.key for p in found}
    before = len(found)
    for section, used in SECTIONS:
        if pick(config, section) is None or not used(config) or any(k == section or k.startswith(section + ".")
                                                                    for k in refused):
            continue
        built = convert(config, section, found, _reference_section(config) if section.endswith(".ref") else None)
        optim = getattr(built, "optim", None) if section in (ACTOR, "critic") else None
        if hasattr(optim, "optimizer_impl"):
            check_optimizer(config, f"{section}.optim", optim, found)
    if numbers_ok and not typed and len(found) == before and not any(
            k.startswith((ACTOR, "critic")) for k in refused):
        _validate_config(config, found)
    return not typed


class _Recording:
    """A tokenizer (or processor) recording its chat template's error (verl's filter drops such a row) or the
    prompt's length in tokens, per prompt verl's dataset hands it."""

    def __init__(self, wrapped):
        self.__dict__.update(wrapped=wrapped, calls=[])

    def __getattr__(self, name):
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def apply_chat_template(self, *args, **kwargs):
        try:
            result = self.wrapped.apply_chat_template(*args, **kwargs)
        except Exception as e:
            self.calls.append(e)
            raise
        ids = result.get("input_ids", result) if hasattr(result, "get") else result
        self.calls.append(len(ids) if isinstance(ids, (list, tuple)) and kwargs.get("tokenize", True) else None)
        return result


def _stamp(paths) -> tuple:
    """The files at ``paths`` (a folder: the files in it) as they are now: name, modification time, size."""
    files = [f for p in map(Path, paths) if p.exists() for f in (p.iterdir() if p.is_dir() else [p])]
    return tuple(sorted((str(f), f.lstat().st_mtime_ns, f.lstat().st_size) for f in files))


#: what :func:`dataset_problems` found in this process, by its inputs (the files stamped)
_DATASETS: dict[tuple, list[Problem]] = {}


def check_model_and_data(config: DictConfig, found: list[Problem]) -> None:
    """verl's model config (``HFModelConfig``), then :func:`dataset_problems` of every data file, each once."""
    refused = {p.key for p in found}
    path = str(pick(config, f"{MODEL}.path", "") or "")
    if not Path(path).is_dir() or any(k == MODEL or k.startswith(MODEL + ".") for k in refused):
        return
    folders = [str(pick(config, f"{MODEL}.{k}", "") or path) for k in ("path", "hf_config_path", "tokenizer_path")]
    with contextlib.redirect_stdout(io.StringIO()):  # what the tokenizer's loading prints
        model = convert(config, MODEL, found, files=_stamp(set(folders)))
    if model is None:
        return
    data = OmegaConf.to_yaml(pick(config, "data"), resolve=True)
    for key, train in (("data.train_files", True), ("data.val_files", False)):
        files = pick(config, key)
        paths = [str(f) for f in (files if isinstance(files, ListConfig) else [files])]
        if key not in refused and all(Path(p).is_file() for p in paths):  # a key named once (the prompt length)
            inputs = (key, _stamp(paths), data, id(model))  # a converted model lives as long as the process
            if inputs not in _DATASETS:
                _DATASETS[inputs] = dataset_problems(config, key, paths, model, train)
            found += [p for p in _DATASETS[inputs] if p.key not in {q.key for q in found}]


def dataset_problems(config: DictConfig, key: str, paths: list[str], model, train: bool) -> list[Problem]:
    """verl's dataset (``create_rl_dataset``) built on the first :data:`SAMPLE_ROWS` rows of each of
    ``paths`` with the model's tokenizer, every row read and collated as the data loader does."""
    import datasets  # the dataset's libraries and verl only where a check runs
    import pyarrow as pa
    import pyarrow.parquet as pq
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn

    prompt_key = str(pick(config, "data.prompt_key", "prompt"))
    recording = _Recording(model.processor if model.processor is not None else model.tokenizer)
    data_config = OmegaConf.create(OmegaConf.to_container(pick(config, "data"), resolve=True))
    with open_dict(data_config):
        data_config.filter_overlong_prompts_workers = None  # in this process (1 would fork one): a handful of rows
    where, cache = [], datasets.config.HF_DATASETS_CACHE
    with tempfile.TemporaryDirectory(prefix="stapo_preflight_") as tmp, \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        samples = []
        for i, path in enumerate(paths):
            first = next(pq.ParquetFile(path).iter_batches(batch_size=SAMPLE_ROWS))
            samples.append(str(Path(tmp) / f"{i}_{Path(path).name}"))
            pq.write_table(pa.Table.from_batches([first]), samples[-1])
            where += [(path, row) for row in range(first.num_rows)]
        datasets.config.HF_DATASETS_CACHE = tmp  # the sample's cache goes with it
        try:
            tokenizer, processor = ((model.tokenizer, recording) if model.processor is not None
                                    else (recording, None))
            dataset = create_rl_dataset(samples, data_config, tokenizer, processor, is_train=train)
            collate_fn([dataset[i] for i in range(len(dataset))])
        except Exception as e:  # noqa: BLE001  (what the dataset raises stops the trainer after Ray)
            return [Problem(key, f"verl's dataset refuses the first rows of {', '.join(paths)}: {_words(e)}",
                            "correct the file (python -m recipe.stapo.data.prepare writes verl's format)")]
        finally:
            datasets.config.HF_DATASETS_CACHE = cache
    errors = [(where[i], e) for i, e in enumerate(recording.calls) if isinstance(e, Exception)]
    if errors:
        (path, row), error = errors[0]
        return [Problem(key, f"{path}, column {prompt_key}: the model's chat template fails on row {row} "
                        f"({type(error).__name__}: {error}) and on {len(errors) - 1} more of the first {len(where)} "
                        "rows; verl's dataset drops such a row as if it were too long"
                        + (", leaving none: the trainer would stop after Ray with 'num_samples=0'" if not len(dataset)
                           else ""), f"write {prompt_key} as a list of chat messages, [{{'role': 'user', 'content': "
                        "...}] (python -m recipe.stapo.data.prepare writes it so)")]
    if not len(dataset) and pick(config, "data.filter_overlong_prompts"):
        lengths = [n for n in recording.calls if isinstance(n, int)]
        return [Problem("data.max_prompt_length", f"none of the first {len(where)} rows of {', '.join(paths)} is "
                        f"within it once the model's chat template is applied (the shortest: {min(lengths, default=0)} "
                        "tokens): verl's dataset drops every longer prompt (data.filter_overlong_prompts), and the "
                        "trainer would stop after Ray with 'num_samples=0'",
                        f"raise data.max_prompt_length to at least {min(lengths, default=0)}, or shorten the prompts",
                        pick(config, "data.max_prompt_length"))]
    return []
