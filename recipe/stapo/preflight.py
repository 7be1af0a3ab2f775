"""Preflight: what would fail on the cluster (some of it hours in) or run silently wrong, refused in
the driver before Ray starts, every refusal naming the key or path and the fix (docs/preflight.md).

:func:`check` runs on a config whose interpolations are resolved and whose local paths are absolute
(:func:`recipe.stapo.config_utils.prepare` calls it, so ``--check`` / ``STAPO_DRY_RUN=check`` and a
real launch run the same checks, the latter also in a submitted job's own driver on the head node):

- numbers: positive integers for nodes, GPUs, lengths, batch sizes and budgets; ``rollout.n >= 2``
  for group-normalised advantages; batch, mini-batch, micro-batch and world-size divisibility as
  verl checks them without dynamic batching; token budgets that hold the longest sequence;
- names: the policy loss is registered, the token-selection settings are valid, the advantage
  estimator exists, the reward function resolves in its module;
- identity: a method's run selects the method's tokens (``method=stapo``: S2T), unless the
  experiment name says what it runs instead;
- paths: data files are parquet with the columns the run reads; the model folder has a config, a
  tokenizer and weights; the checkpoint folder (and the token dump's) can be created and written
  (a probe file, removed with any folder made for it); the token dump's settings;
- GPU memory: :mod:`recipe.stapo.memory_model`'s estimate per pass, with its margin, against
  ``recipe.gpu_mem_gb`` (``GPU_MEM_GB``: GiB as CUDA reports them, default 79.1 for an 80 GB card).

With ``LAUNCH=submit`` the launching machine may not see the cluster's storage: a path it cannot see
is reported as a note, not refused (the job's driver checks it on the head node).

Importing this module imports no verl.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from recipe.stapo import memory_model
from recipe.stapo.config_checks import check_values
from recipe.stapo.methods import methods
from recipe.stapo.policy_loss import POLICY_LOSS, settings_of
from stapo_core.rules import NO_SELECTION, RULES

ACTOR, ROLLOUT, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
#: the token selection each method runs (docs/method.md); another one needs a name that says so
#: advantage estimators that normalise rewards within each prompt's group of rollout.n responses
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
                    "reinforce_plus_plus_baseline", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo")
#: columns every row of a data file needs (beside ``data.prompt_key`` and ``data.reward_fn_key``)
REWARD_MODEL_COLUMN, GROUND_TRUTH_FIELD = "reward_model", "ground_truth"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
#: folders the run writes to (the checkpoint folder always; the others when set)
OUTPUT_DIR_KEYS = ("trainer.default_local_dir", "recipe.token_dump.dir", "trainer.validation_data_dir",
                   "trainer.rollout_data_dir")
MEMORY_CHECK_MODES = ("refuse", "warn", "off")
#: the launcher's environment variable naming submit mode (run_scripts/common.sh)
LAUNCH_ENV = "LAUNCH"


_NO_VALUE = object()


@dataclass(frozen=True)
class Problem:
    """One refusal: what (``key``: a config key, or a path; ``value``: its value, when it is the
    problem), what is wrong, and how to fix it."""

    key: str
    problem: str
    fix: str
    value: object = _NO_VALUE

    def __str__(self) -> str:
        head = self.key if self.value is _NO_VALUE else f"{self.key}={self.value!r}"
        return f"{head}: {self.problem}. Fix: {self.fix}"


class PreflightError(ValueError):
    """Every problem the preflight found (``problems``), in one message."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"preflight refused the config ({n} problem{'s' if n != 1 else ''}; nothing was "
                         f"started):\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Report:
    """What a passing preflight has to say: notes (things not checked here, and why) and the memory table."""

    notes: list[str] = field(default_factory=list)
    memory_table: Optional[str] = None

    def text(self) -> str:
        lines = ["[stapo] preflight passed"]
        lines += [f"[stapo] note: {n}" for n in self.notes]
        if self.memory_table:
            lines.append("[stapo] " + self.memory_table)
        return "\n".join(lines)


def _pick(config: DictConfig, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------
# numbers
# ------------------------------------------------------------------------------------------------


class _Numbers:
    """Collects integer settings, recording a problem for each one that is not a whole number >= 1."""

    def __init__(self, config: DictConfig, found: list[Problem]):
        self.config, self.found, self.ok = config, found, True

    def get(self, key: str, what: str, fix: str, minimum: int = 1) -> Optional[int]:
        value = _pick(self.config, key)
        if _is_int(value) and value >= minimum:
            return value
        self.ok = False
        self.found.append(Problem(key, f"{what} must be a whole number >= {minimum}", fix, value))
        return None


def check_numbers(config: DictConfig, found: list[Problem]) -> bool:
    """Positive integers, group size, divisibility, token budgets; True when every number is usable."""
    n = _Numbers(config, found)
    nnodes = n.get("trainer.nnodes", "the number of nodes", "set trainer.nnodes (NNODES in the run scripts), "
                   "e.g. 8 for the paper's 64 GPUs")
    gpus = n.get("trainer.n_gpus_per_node", "the GPUs per node", "set trainer.n_gpus_per_node (GPUS_PER_NODE in "
                 "the run scripts), e.g. 8")
    rollout_n = n.get(f"{ROLLOUT}.n", "the responses per prompt", f"set {ROLLOUT}.n (the paper: 8)")
    batch = n.get("data.train_batch_size", "the prompts per step", "set data.train_batch_size (the paper: 256)")
    mini = n.get(f"{ACTOR}.ppo_mini_batch_size", "the prompts per update",
                 f"set {ACTOR}.ppo_mini_batch_size (the paper: 64)")
    prompt = n.get("data.max_prompt_length", "the prompt length", "set data.max_prompt_length (the paper: 1024)")
    response = n.get("data.max_response_length", "the response length",
                     "set data.max_response_length (the paper: 15360)")
    sp = n.get(f"{ACTOR}.ulysses_sequence_parallel_size", "the sequence parallel size",
               f"set {ACTOR}.ulysses_sequence_parallel_size (1: none)")
    tp = n.get(f"{ROLLOUT}.tensor_model_parallel_size", "vLLM's tensor parallel size",
               f"set {ROLLOUT}.tensor_model_parallel_size")

    estimator = str(_pick(config, "algorithm.adv_estimator", "grpo"))
    if rollout_n is not None and rollout_n < 2 and estimator in GROUP_ESTIMATORS:
        found.append(Problem(
            f"{ROLLOUT}.n", f"algorithm.adv_estimator={estimator} normalises each reward within its "
            "prompt's group of rollout.n responses, and a group of one leaves the raw +-1 reward as the advantage "
            "(REINFORCE without a baseline; S2T's candidates become every rare token of every correct response)",
            f"set {ROLLOUT}.n >= 2 (the paper: 8)", rollout_n))
        n.ok = False

    world = nnodes * gpus if nnodes and gpus else None
    if world and sp and world % sp:
        found.append(Problem(f"{ACTOR}.ulysses_sequence_parallel_size", f"does not divide the {world} GPUs",
                             "choose a divisor of the GPU count", sp))
        n.ok = False
    if world and tp:
        infer = tp * int(_pick(config, f"{ROLLOUT}.data_parallel_size", 1) or 1) * int(
            _pick(config, f"{ROLLOUT}.pipeline_model_parallel_size", 1) or 1)
        if world % infer:
            found.append(Problem(f"{ROLLOUT}.tensor_model_parallel_size",
                                 f"vLLM's {infer} GPUs per replica do not divide the {world} GPUs (verl asserts it when "
                                 "the workers start)", "choose a divisor of the GPU count (the paper's configs: 1, 2 "
                                 "or 4)", tp))
            n.ok = False
    if world and batch and rollout_n:
        step = world // math.gcd(world, rollout_n)
        if (batch * rollout_n) % world:
            found.append(Problem(
                "data.train_batch_size", f"{batch} prompts x {rollout_n} responses = {batch * rollout_n} "
                f"sequences per step do not split evenly over the {world} GPUs (verl's own check, skipped with "
                "dynamic batching)", f"use a multiple of {step}, e.g. data.train_batch_size="
                f"{max(step, batch // step * step) if batch >= step else step}", batch))
            n.ok = False
    if batch and mini:
        if mini > batch or batch % mini:
            found.append(Problem(
                f"{ACTOR}.ppo_mini_batch_size", f"does not divide data.train_batch_size={batch}: every PPO update "
                "takes one mini-batch of the step's prompts", f"choose a divisor of {batch} (the paper: 64, 4 updates "
                "per step)", mini))
            n.ok = False
    if world and sp and mini and rollout_n and world % sp == 0:
        dp = world // sp
        if (mini * rollout_n) % dp:
            found.append(Problem(
                f"{ACTOR}.ppo_mini_batch_size", f"{mini} prompts x {rollout_n} responses = "
                f"{mini * rollout_n} sequences per update do not split evenly over the {dp} data-parallel ranks "
                "(verl's train_mini_batch asserts it)",
                f"make {ACTOR}.ppo_mini_batch_size x {ROLLOUT}.n a multiple of {dp}", mini))
            n.ok = False
        elif not _pick(config, f"{ACTOR}.use_dynamic_bsz", False):
            micro = n.get(f"{ACTOR}.ppo_micro_batch_size_per_gpu", "the sequences per micro-batch",
                          f"set {ACTOR}.ppo_micro_batch_size_per_gpu")
            per_rank = mini * rollout_n // dp
            if micro and per_rank % micro:
                found.append(Problem(f"{ACTOR}.ppo_micro_batch_size_per_gpu",
                                     f"does not divide the {per_rank} sequences of a mini-batch on each rank",
                                     f"choose a divisor of {per_rank}", micro))
                n.ok = False

    dynamic = _pick(config, f"{ACTOR}.use_dynamic_bsz", False)
    if bool(_pick(config, f"{ROLLOUT}.log_prob_use_dynamic_bsz", False)) != bool(dynamic):
        found.append(Problem(f"{ROLLOUT}.log_prob_use_dynamic_bsz",
                             f"differs from {ACTOR}.use_dynamic_bsz={dynamic} (verl's worker asserts they agree)",
                             "set both to the same value"))
        n.ok = False
    longest = prompt + response if prompt and response else None
    passes = [(f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_gpu",
               f"{ACTOR}.ppo_micro_batch_size_per_gpu", sp),
              (f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
               f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", sp)]
    if uses_reference(config):
        ref_sp = n.get(f"{REF}.ulysses_sequence_parallel_size", "the reference's sequence parallel size",
                       f"set {REF}.ulysses_sequence_parallel_size")
        passes.append((f"{REF}.log_prob_use_dynamic_bsz", f"{REF}.log_prob_max_token_len_per_gpu",
                       f"{REF}.log_prob_micro_batch_size_per_gpu", ref_sp))
    for dynamic_key, budget_key, micro_key, size in passes:
        if _pick(config, dynamic_key, False):
            budget = n.get(budget_key, "a token budget", f"set {budget_key}")
            if budget and longest and size and budget * size < longest:
                need = math.ceil(longest / size)
                found.append(Problem(
                    budget_key, f"less than the longest sequence, data.max_prompt_length + "
                    f"data.max_response_length = {longest} tokens" + (f" (over sequence parallel size {size}: "
                                                                       f"{need} per GPU)" if size > 1 else "")
                    + " (verl refuses such a micro-batch at the first long response)",
                    f"set {budget_key} >= {need}, or raise the sequence parallel size", budget))
                n.ok = False
        elif micro_key != f"{ACTOR}.ppo_micro_batch_size_per_gpu":
            n.get(micro_key, "the sequences per micro-batch", f"set {micro_key}")
    gpu_mem = _pick(config, "recipe.gpu_mem_gb")
    try:
        if float(gpu_mem) <= 0 or not math.isfinite(float(gpu_mem)):
            raise ValueError
    except (TypeError, ValueError):
        found.append(Problem("recipe.gpu_mem_gb", "the target GPU's memory in GB must be a positive number",
                             "set GPU_MEM_GB (or recipe.gpu_mem_gb), e.g. 80", gpu_mem))
        n.ok = False
    mode = _pick(config, "recipe.memory_check", "refuse")
    if mode not in MEMORY_CHECK_MODES:
        found.append(Problem("recipe.memory_check", "unknown mode", f"use one of {list(MEMORY_CHECK_MODES)}", mode))
        n.ok = False
    return n.ok


def uses_reference(config: DictConfig) -> bool:
    """verl builds a reference model for a KL loss or a KL penalty in the reward."""
    return bool(_pick(config, f"{ACTOR}.use_kl_loss", False)) or bool(_pick(config, "algorithm.use_kl_in_reward", False))


# ------------------------------------------------------------------------------------------------
# names and identity
# ------------------------------------------------------------------------------------------------


def token_selection(config: DictConfig) -> str:
    """The token selection a config runs (``none`` without the recipe's policy-loss config)."""
    policy_loss = _pick(config, POLICY_LOSS)
    if policy_loss is None or not str(policy_loss.get("_target_", "")).endswith("TokenSelectionLossConfig"):
        return "none"
    return str(policy_loss.get("token_selection", "none"))


def check_names(config: DictConfig, found: list[Problem]) -> None:
    """Policy loss, token-selection settings, advantage estimator, reward function."""
    # verl loads only after VERL_USE_EXTERNAL_MODULES is set (importing this module imports no verl)
    import verl_patches  # noqa: F401  (the patches every worker runs with)
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    mode = _pick(config, f"{POLICY_LOSS}.loss_mode", "vanilla")
    if mode not in POLICY_LOSS_REGISTRY:
        found.append(Problem(f"{POLICY_LOSS}.loss_mode", "not a registered policy loss",
                             f"use one of {sorted(POLICY_LOSS_REGISTRY)}", mode))
    try:
        settings_of(config)
    except ValueError as e:
        found.append(Problem(POLICY_LOSS, str(e), "use the values docs/method.md lists for these keys"))
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator  # verl: as above

    estimator = str(_pick(config, "algorithm.adv_estimator", "grpo"))
    known = sorted(set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator})
    if estimator not in known:
        found.append(Problem("algorithm.adv_estimator", "not one of verl's advantage estimators",
                             f"use one of {known}", estimator))
    check_reward_function(config, found)
    check_sequence_parallel(config, found)


def check_sequence_parallel(config: DictConfig, found: list[Problem]) -> None:
    """Ulysses sequence parallelism with a current-policy forward of the recipe's: verl's
    ``TrainingWorker.infer_batch`` returns its output to one rank of each sequence-parallel group
    only, and the loss's own statistics would be one rank's slice, so the recipe refuses it here
    rather than on some ranks hours in."""
    sp = _pick(config, f"{ACTOR}.ulysses_sequence_parallel_size", 1)
    if not (_is_int(sp) and sp > 1):
        return
    try:
        cfg = settings_of(config)
    except ValueError:  # check_names reports an invalid policy-loss config
        return
    if cfg is None:
        return
    uses = []
    if cfg.selects_tokens and cfg.statistics_source == "current":
        uses.append(f"{cfg.token_selection} from the current policy (stats_from=current"
                    + (", entropy_topk_reading=authors_code" if cfg.authors_code_reading else "") + ")")
    if cfg.monitor_forwards_current_policy:
        uses.append("the S2T monitor with stats_from=current")
    if cfg.measures_update_effect:
        uses.append(f"update_effect_responses={cfg.update_effect_responses}")
    if uses:
        found.append(Problem(
            f"{ACTOR}.ulysses_sequence_parallel_size",
            f"sequence parallelism is not supported with {', '.join(uses)}: the recipe's current-policy forwards "
            "need every rank's full output",
            f"set {ACTOR}.ulysses_sequence_parallel_size=1 (and a token budget that holds the longest sequence), "
            f"or {POLICY_LOSS}.stats_from=rollout (and update_effect_responses=0)", sp))


def check_reward_function(config: DictConfig, found: list[Problem]) -> None:
    """The reward function resolves in its module, as verl's reward loop will load it."""
    path = _pick(config, "reward.custom_reward_function.path")
    name = _pick(config, "reward.custom_reward_function.name")
    if not path:
        return
    key = "reward.custom_reward_function"
    from verl.utils.import_utils import load_module  # verl loads only after VERL_USE_EXTERNAL_MODULES is set

    try:
        module = load_module(str(path))
    except Exception as e:  # noqa: BLE001  (anything the import raises is the problem to report)
        found.append(Problem(f"{key}.path", f"cannot be imported ({type(e).__name__}: {e})",
                             "point it to an importable module (pkg://package.module) or an existing .py file", path))
        return
    fn = getattr(module, str(name), None) if name else None
    if callable(fn):
        return
    candidates = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
    close = difflib.get_close_matches(str(name), candidates, n=1)
    hint = f"did you mean {key}.name={close[0]}? " if close else ""
    found.append(Problem(f"{key}.name", f"not a function of {path}",
                         f"{hint}functions there: {', '.join(candidates) or 'none'}", name))


def check_identity(config: DictConfig, found: list[Problem]) -> None:
    """A method's run selects that method's tokens, or its experiment name says what it runs instead."""
    method = str(_pick(config, "recipe.method", ""))
    expected = methods()[method].token_selection if method in methods() else None
    actual = token_selection(config)
    name = str(_pick(config, "trainer.experiment_name", ""))
    if expected is None or actual == expected or actual.lower() in name.lower():
        return
    found.append(Problem(
        f"{POLICY_LOSS}.token_selection",
        f"method={method} selects {expected!r}, and the experiment name {name!r} does not say "
        f"otherwise: the run would be filed as {method} without {method}'s token selection",
        f"drop the override, or name the run after what it runs: trainer.experiment_name={name}_{actual} "
        f"(EXPERIMENT in the run scripts)", actual))


# ------------------------------------------------------------------------------------------------
# paths
# ------------------------------------------------------------------------------------------------


def _paths(value) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, (ListConfig, list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def probe_writable(path: Path) -> Optional[str]:
    """None when ``path`` can be created (if missing) and a file written in it; else the reason.
    Writes and removes one probe file, and removes every folder it had to create."""
    missing, existing = [], path
    while not existing.exists():
        missing.append(existing)
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} exists and is not a folder"
    created = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
        probe = path / f".stapo_preflight_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"preflight")
        probe.unlink()
    except OSError as e:
        return f"{e.strerror or e} ({e.filename or path})"
    finally:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass
    return None


def _existing_local(key: str, path: str, fix: str, found: list[Problem], notes: list[str], submit: bool) -> Optional[Path]:
    """``path`` as a ``Path`` when it is local and exists here; otherwise None, with a note (a remote
    path; with ``LAUNCH=submit``, a path not visible on this machine) or a problem (it does not exist)."""
    if "://" in path:
        notes.append(f"{key}: {path} is remote, not checked here")
        return None
    p = Path(path)
    if p.exists():
        return p
    if submit:
        notes.append(f"{key}: {path} is not visible here (LAUNCH=submit): the job's driver checks it on the head node")
    else:
        found.append(Problem(key, f"{path} does not exist", fix))
    return None


def _data_file(config: DictConfig, key: str, path: str, found: list[Problem], notes: list[str], submit: bool) -> None:
    prepare_cmd = ("python -m recipe.stapo.data.prepare " + ("train" if key == "data.train_files" else "bench")
                   + " --out-dir <folder>, then set STAPO_DATA_DIR=<folder> (or " + key + ")")
    p = _existing_local(key, path, prepare_cmd, found, notes, submit)
    if p is None:
        return
    if not p.is_file():
        found.append(Problem(key, f"{path} is not a file", "point it to a parquet file"))
        return
    import pyarrow.parquet as pq  # pyarrow (half a second to import) only when a data file is checked

    try:
        meta = pq.read_metadata(p)
        schema = meta.schema.to_arrow_schema()
    except Exception as e:  # noqa: BLE001
        found.append(Problem(key, f"{path} is not a parquet file ({type(e).__name__}: {e})", prepare_cmd))
        return
    if meta.num_rows == 0:  # before the columns: a file without rows may have none either
        found.append(Problem(key, f"{path} has no rows", prepare_cmd))
        return
    prompt_key = str(_pick(config, "data.prompt_key", "prompt"))
    source_key = str(_pick(config, "data.reward_fn_key", "data_source"))
    missing = [c for c in (prompt_key, source_key, REWARD_MODEL_COLUMN) if c not in schema.names]
    if not missing:
        import pyarrow as pa  # as pyarrow.parquet above

        reward = schema.field(REWARD_MODEL_COLUMN).type
        if not pa.types.is_struct(reward) or reward.get_field_index(GROUND_TRUTH_FIELD) < 0:
            missing.append(f"{REWARD_MODEL_COLUMN}.{GROUND_TRUTH_FIELD}")
    if missing:
        found.append(Problem(key, f"{path} has no column {', '.join(missing)} (it has {', '.join(schema.names)}); "
                             f"the run reads {prompt_key}, {source_key} and {REWARD_MODEL_COLUMN}.{GROUND_TRUTH_FIELD}",
                             prepare_cmd))


def _model_folder(config: DictConfig, found: list[Problem], notes: list[str], submit: bool) -> None:
    key = "actor_rollout_ref.model.path"
    path = str(_pick(config, key, "") or "")
    download = (f"download it (hf download Qwen/<model> --local-dir <folder>) and set STAPO_MODEL_DIR "
                f"(or {key}) to the folder holding it")
    if not path:
        found.append(Problem(key, "is empty", download))
        return
    if "://" not in path and not path.startswith("/"):  # the driver made every local path absolute: a hub id
        return                                          # (logged by resolve_paths)
    folder = _existing_local(key, path, download, found, notes, submit)
    if folder is None:
        return
    if not folder.is_dir() or not any(folder.iterdir()):
        found.append(Problem(key, f"{path} is {'empty' if folder.is_dir() else 'not a folder'}", download))
        return
    try:
        config_json = json.loads((folder / "config.json").read_text())
        if not isinstance(config_json, dict) or "model_type" not in config_json:
            raise ValueError("no model_type")
    except (OSError, ValueError) as e:
        found.append(Problem(key, f"{path} has no readable Hugging Face config.json ({e})", download))
    tokenizer = Path(str(_pick(config, "actor_rollout_ref.model.tokenizer_path", "") or path))
    if not any((tokenizer / f).is_file() for f in TOKENIZER_FILES):
        found.append(Problem("actor_rollout_ref.model.tokenizer_path" if tokenizer != folder else key,
                             f"{tokenizer} has no tokenizer ({' / '.join(TOKENIZER_FILES)})", download))
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        found.append(Problem(key, f"{path} has no weights ({' / '.join(WEIGHT_PATTERNS[:2])})", download))


def check_paths(config: DictConfig, found: list[Problem], notes: list[str], submit: bool = False) -> None:
    """Data files, the model folder, the folders the run writes to, a checkpoint to resume from."""
    for key in ("data.train_files", "data.val_files"):
        paths = _paths(_pick(config, key))
        if not paths:
            found.append(Problem(key, "is empty", "set it to the parquet file(s) of recipe.stapo.data.prepare"))
        for path in paths:
            _data_file(config, key, path, found, notes, submit)
    _model_folder(config, found, notes, submit)
    for key in OUTPUT_DIR_KEYS:
        value = _pick(config, key)
        if not value:
            if key == "trainer.default_local_dir":
                found.append(Problem(key, "is empty", "set CKPT_DIR (or trainer.default_local_dir)"))
            continue
        path = str(value)
        if "://" in path:
            notes.append(f"{key}: {path} is remote, not checked here")
            continue
        if submit and not Path(path).exists():
            notes.append(f"{key}: {path} is not visible here (LAUNCH=submit): the job's driver probes it on the head node")
            continue
        reason = probe_writable(Path(path))
        if reason:
            found.append(Problem(key, f"{path} cannot be created or written: {reason}",
                                 "choose a folder this user can write, on storage every node sees"
                                 + (" (CKPT_DIR in the run scripts)" if key == "trainer.default_local_dir" else "")))
    if _pick(config, "trainer.resume_mode") == "resume_path":
        resume = str(_pick(config, "trainer.resume_from_path", "") or "")
        if not resume or not (Path(resume).is_dir() or (submit or "://" in resume)):
            found.append(Problem("trainer.resume_from_path", f"{resume!r} is not a checkpoint folder "
                                 "(trainer.resume_mode=resume_path)", "point it to a global_step_<k> folder, or use "
                                 "trainer.resume_mode=auto"))


def check_token_dump(config: DictConfig, found: list[Problem]) -> None:
    """The token dump's settings, read as every actor will read them (only when the dump is on)."""
    env_vars = _pick(config, "ray_kwargs.ray_init.runtime_env.env_vars") or {}
    env = {str(k): "" if v is None else str(v) for k, v in dict(env_vars).items()}
    # importing verl_patches applies the patches, which imports verl: only after VERL_USE_EXTERNAL_MODULES is set
    from verl_patches.token_dump import settings as dump

    if not env.get(dump.DIR_ENV):
        return
    for variable, key, fix in ((dump.RESPONSES_ENV, "recipe.token_dump.responses", "a whole number >= 1 (default 4)"),
                               (dump.CONTEXT_ENV, "recipe.token_dump.context", "a whole number >= 0 (default 16)"),
                               (dump.IDS_ENV, "recipe.token_dump.ids", "true or false")):
        only = {dump.DIR_ENV: env[dump.DIR_ENV], variable: env.get(variable, "")}
        try:
            dump.settings_from_env(only)
        except ValueError as e:
            found.append(Problem(key, str(e), f"set {key} to {fix}"))


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------


def model_shape(config: DictConfig, notes: list[str]) -> Optional[memory_model.ModelShape]:
    """The model's shape from its config.json, or the built-in shape of a paper model the launching
    machine cannot read (None, with a note, when neither exists)."""
    path = str(_pick(config, "actor_rollout_ref.model.hf_config_path", "") or _pick(config, "actor_rollout_ref.model.path", ""))
    try:
        return memory_model.load_shape(path)
    except ValueError:
        shape = memory_model.builtin_shape(path)
        if shape is None:
            notes.append(f"GPU memory not estimated: no readable config.json in {path} and no built-in shape for it")
        return shape


def check_memory(config: DictConfig, found: list[Problem], notes: list[str]) -> Optional[str]:
    """The memory table for the target GPU; a problem per pass that does not fit (``recipe.memory_check``:
    ``refuse``; ``warn`` makes them notes, ``off`` skips the estimate)."""
    mode = _pick(config, "recipe.memory_check", "refuse")
    if mode == "off":
        notes.append("GPU memory not checked (recipe.memory_check=off)")
        return None
    if str(_pick(config, "trainer.device", "cuda")) == "cpu" or _pick(config, f"{ROLLOUT}.name") not in ("vllm", "sglang"):
        notes.append("GPU memory not estimated: the CPU path (trainer.device=cpu) or a rollout other than vLLM/SGLang")
        return None
    shape = model_shape(config, notes)
    if shape is None:
        return None
    gpu = float(_pick(config, "recipe.gpu_mem_gb")) * memory_model.GIB
    try:
        settings = memory_model.settings_from_config(config)
    except ValueError as e:  # the policy-loss block, refused by check_names
        notes.append(f"GPU memory not estimated: {e}")
        return None
    estimate = memory_model.estimate(shape, settings, gpu)
    longest = int(_pick(config, "data.max_prompt_length")) + int(_pick(config, "data.max_response_length"))
    sp = int(_pick(config, f"{ACTOR}.ulysses_sequence_parallel_size", 1))
    gpus_per_node = int(_pick(config, "trainer.n_gpus_per_node", 8))
    accept_tight = _pick(config, "recipe.memory_accept_tight", False)
    if not isinstance(accept_tight, bool):
        found.append(Problem("recipe.memory_accept_tight", "must be true or false",
                             "set recipe.memory_accept_tight=true to run a TIGHT pass, else leave it false", accept_tight))
        accept_tight = False
    passes = {p.name: p for p in estimate.passes}
    for name, setting, problem, fix in memory_model.problems(estimate, gpu, longest, sp, gpus_per_node):
        tight = memory_model.verdict(passes[name], gpu) == "TIGHT"
        if mode == "warn" or (tight and accept_tight):
            flag = "recipe.memory_check=warn" if mode == "warn" else "recipe.memory_accept_tight=true"
            notes.append(f"GPU memory ({flag}): pass '{name}' {problem}; {fix}")
        else:
            found.append(Problem(f"GPU memory, pass '{name}' ({setting})", problem,
                                 f"{fix}; or set GPU_MEM_GB to your GPU's memory as CUDA reports it"
                                 + (", or recipe.memory_accept_tight=true to run inside the margin" if tight else "")
                                 + ", or recipe.memory_check=warn if you know the estimate is wrong for your setup "
                                 "(docs/memory.md)"))
    return memory_model.table(estimate, gpu)


# ------------------------------------------------------------------------------------------------
# all of it
# ------------------------------------------------------------------------------------------------


def check(config: DictConfig, environ: Optional[Mapping[str, str]] = None, problems: Optional[list[Problem]] = None,
          log: Callable[[str], None] = print) -> Report:
    """Run every check on a resolved config; raise :class:`PreflightError` listing every problem
    (``problems``: ones the caller found before), else return the :class:`Report` (also logged)."""
    environ = os.environ if environ is None else environ
    submit = environ.get(LAUNCH_ENV, "") == "submit"
    found = list(problems or [])
    report = Report()
    if submit:
        report.notes.append("LAUNCH=submit: paths this machine cannot see are left to the job's driver, which runs "
                            "the same checks on the head node before Ray starts")
    numbers_ok = check_numbers(config, found)
    found += [Problem(*finding) for finding in check_values(config)]  # types and ranges verl checks after Ray
    check_names(config, found)
    check_identity(config, found)
    check_paths(config, found, report.notes, submit)
    check_token_dump(config, found)
    if numbers_ok:
        report.memory_table = check_memory(config, found, report.notes)
    if found:
        raise PreflightError(found)
    log(report.text())
    return report


def summary(config: DictConfig) -> str:
    """What a config runs, in ``key = value`` lines: the method and its token selection, the reward,
    paths, the GPUs and how each step's batch splits over them, lengths and token budgets."""
    pick = lambda key: _pick(config, key)  # noqa: E731
    lines = [("recipe.method", pick("recipe.method")), ("recipe.model", pick("recipe.model")),
             (f"{POLICY_LOSS}.loss_mode", pick(f"{POLICY_LOSS}.loss_mode") or "vanilla"),
             (f"{POLICY_LOSS}.token_selection", token_selection(config))]
    selection = token_selection(config)
    if selection in RULES:
        lines += [(f"{POLICY_LOSS}.{k}", pick(f"{POLICY_LOSS}.{k}")) for k in RULES[selection].fields]
    if selection != NO_SELECTION:
        lines += [(f"{POLICY_LOSS}.stats_from", pick(f"{POLICY_LOSS}.stats_from")),
                  (f"{POLICY_LOSS}.scope", pick(f"{POLICY_LOSS}.scope") or "mini_batch")]
    lines += [("reward.custom_reward_function", f"{pick('reward.custom_reward_function.path')}:"
               f"{pick('reward.custom_reward_function.name')}"),
              ("algorithm.adv_estimator", pick("algorithm.adv_estimator"))]
    lines += [(k, pick(k)) for k in ("actor_rollout_ref.model.path", "data.train_files", "data.val_files",
                                     "trainer.default_local_dir")]
    nnodes, gpus = pick("trainer.nnodes"), pick("trainer.n_gpus_per_node")
    lines += [("trainer.nnodes", nnodes), ("trainer.n_gpus_per_node", gpus)]
    try:
        world = int(nnodes) * int(gpus)
        n, batch, mini = int(pick(f"{ROLLOUT}.n")), int(pick("data.train_batch_size")), int(pick(f"{ACTOR}.ppo_mini_batch_size"))
        sp = int(pick(f"{ACTOR}.ulysses_sequence_parallel_size") or 1)
        lines += [("GPUs", world), (f"{ROLLOUT}.n", n),
                  ("data.train_batch_size", f"{batch} prompts = {batch * n} sequences per step"),
                  (f"{ACTOR}.ppo_mini_batch_size", f"{mini} prompts = {mini * n} sequences per update, "
                   f"{batch // mini} updates per step, {mini * n // max(1, world // sp)} sequences per "
                   f"data-parallel rank")]
    except (TypeError, ValueError, ZeroDivisionError):
        pass
    prompt, response = pick("data.max_prompt_length"), pick("data.max_response_length")
    lines.append(("data.max_prompt_length + data.max_response_length", f"{prompt} + {response}"))
    if pick(f"{ACTOR}.use_dynamic_bsz"):
        budgets = [f"update {pick(f'{ACTOR}.ppo_max_token_len_per_gpu')}",
                   f"log-prob {pick(f'{ROLLOUT}.log_prob_max_token_len_per_gpu')}"]
        if uses_reference(config):
            budgets.append(f"reference {pick(f'{REF}.log_prob_max_token_len_per_gpu')}")
        lines.append(("token budgets per GPU", ", ".join(budgets)
                      + f" (sequence parallel {pick(f'{ACTOR}.ulysses_sequence_parallel_size')})"))
    else:
        lines.append((f"{ACTOR}.ppo_micro_batch_size_per_gpu", pick(f"{ACTOR}.ppo_micro_batch_size_per_gpu")))
    lines += [(k, pick(k)) for k in ("actor_rollout_ref.rollout.gpu_memory_utilization", "recipe.gpu_mem_gb",
                                     "trainer.logger", "trainer.project_name", "trainer.experiment_name",
                                     "trainer.max_actor_ckpt_to_keep")]
    return "\n".join(f"  {key} = {value}" for key, value in lines)
