"""Evaluate a checkpoint on the six benchmarks under both decoding settings (mean@N).

CLI::

    python -m recipe.stapo.eval.run_eval --model CKPT --benchmarks-dir DIR --out OUT \\
        [--decoding both|train|justrl] [--backend vllm|hf] [--verifier none|compass] \\
        [--benchmarks aime24,aime25,...] [--n-samples 32 | --n-samples aime24=64,math500=8] \\
        [--max-new-tokens 20480] [--seed 0] [--scale 8B --method STAPO]

``DIR`` holds ``<benchmark>.parquet`` files written by ``python -m recipe.stapo.data.prepare bench``.
Outputs under ``OUT``: ``generations/<bench>__<decoding>.jsonl`` (one line per sample, appended
and flushed as generated), ``verifier/<bench>__<decoding>.jsonl`` (verifier cache),
``run_config.json``, ``summary.json`` and ``summary.md``. Rerunning the same command resumes: only
missing samples are generated; a run on a different model or setting in the same ``OUT`` is
refused (``run_config.json`` names the key that differs). Saved samples are matched to problems by
problem id and prompt hash, not by row: a resume on data with other problems (or records written
by an older version, without that identity) is refused before anything is generated, naming the
benchmark and the first problem that differs; the same problems reordered or with problems added
resume correctly. ``run_config.json`` records the sha256 of each benchmark file and of the data's
``manifest.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from stapo_core.fileio import atomic_write_json, atomic_write_text, sha256_file
from recipe.stapo.data.prepare import BENCHMARK_SPECS, MANIFEST_NAME
from recipe.stapo.eval.backends import GenerationBackend, SamplingConfig, build_backend
from recipe.stapo.eval.generate import JsonlStore, Problem, VerdictCache, generate_samples, saved_samples
from recipe.stapo.eval.grade import apply_verifier, grade_rule, mean_at_n
from recipe.stapo.eval.verifier import AnswerVerifier, build_verifier

BENCHMARKS: tuple[str, ...] = tuple(BENCHMARK_SPECS)
"""Benchmark names in the paper's column order."""
DEFAULT_N_SAMPLES = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}
DECODINGS = {"train": (1.0, 1.0), "justrl": (0.7, 0.9)}
"""Decoding settings: name -> (temperature, top_p). "train" = 1.0/1.0, "justrl" = 0.7/0.9."""
DEFAULT_MAX_NEW_TOKENS = 20480
_FINGERPRINT_KEYS = ("model", "max_new_tokens", "seed", "backend")


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
    verifier: str = "none"
    verifier_model: Optional[str] = None
    verifier_prompt_file: Optional[str] = None
    batch_size: int = 1024
    limit: Optional[int] = None
    scale: Optional[str] = None
    method: Optional[str] = None
    reward_timeout_s: float = 5.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        bad = [d for d in self.decodings if d not in DECODINGS]
        if bad or not self.decodings:
            raise ValueError(f"--decoding: unknown {bad or 'empty'}; known {list(DECODINGS)} or 'both'")
        bad = [b for b in self.benchmarks if b not in BENCHMARK_SPECS]
        if bad or not self.benchmarks:
            raise ValueError(f"--benchmarks: unknown {bad or 'empty'}; known {list(BENCHMARK_SPECS)}")
        for name in self.benchmarks:
            if self.n_samples.get(name, 0) < 1:
                raise ValueError(f"--n-samples: {name} needs a count >= 1, got {self.n_samples.get(name)}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("--max-new-tokens and --batch-size must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")


def load_problems(path: Path, limit: Optional[int] = None) -> list[Problem]:
    """Problems of one prepared benchmark parquet (verl schema, see recipe.stapo.data.prepare).

    Raises:
        FileNotFoundError: the file is missing (names it and the prepare command).
        ValueError: a needed column or a row's field is missing, or two rows share a problem id
            (names file and rows).
    """
    import pandas as pd

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `python -m recipe.stapo.data.prepare bench --out-dir {path.parent}`")
    frame = pd.read_parquet(path)
    missing = [c for c in ("prompt", "reward_model", "extra_info") if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
    problems: list[Problem] = []
    first_row: dict[str, int] = {}
    for index, row in enumerate(frame.to_dict(orient="records")):
        try:
            messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in row["prompt"])
            truth = str(row["reward_model"]["ground_truth"])
            extra = row["extra_info"] or {}
            problem_id = str(extra.get("id", index))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: row {index}: malformed prompt/reward_model/extra_info ({exc})") from exc
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


def check_run_config(out: Path, config: EvalConfig, data: Optional[dict] = None, write: bool = True) -> None:
    """Check that a resumed run matches ``run_config.json``, then (``write``) write it.

    Args:
        out: the output folder.
        config: this run's settings.
        data: :func:`data_fingerprint` of this run's benchmark data (recorded; a benchmark whose
            file hash changed since the folder was made gets a note on stderr -- the saved samples
            were already checked problem by problem).
        write: False only checks.
    Raises:
        ValueError: a key in ``_FINGERPRINT_KEYS`` differs from the stored run (names it).
    """
    import json

    path = out / "run_config.json"
    current = {k: getattr(config, k) for k in _FINGERPRINT_KEYS}
    stored = json.loads(path.read_text()) if path.exists() else {}
    for key in _FINGERPRINT_KEYS:
        if key in stored and stored[key] != current[key]:
            raise ValueError(
                f"{path}: this output folder was made with {key}={stored[key]!r}, not {current[key]!r}; "
                "use another --out or delete the folder"
            )
    if not write:
        return
    if data is not None:
        data = dict(data, data={**stored.get("data", {}), **data["data"]})  # benchmarks of other runs are kept
        for bench, entry in data["data"].items():
            before = stored.get("data", {}).get(bench, {}).get("sha256")
            if before is not None and before != entry["sha256"]:
                print(
                    f"note: {bench}: {entry['file']} differs from the file this folder was started with "
                    f"(sha256 {before[:12]}... -> {entry['sha256'][:12]}...); its saved samples matched the "
                    "problems of the new file by id and prompt",
                    file=sys.stderr,
                )
        current.update(data)
    atomic_write_json(path, current)


class _LazyBackend:
    """Builds the backend on first use, so a fully generated run never loads the model."""

    def __init__(self, factory: Callable[[], GenerationBackend]):
        self._factory = factory
        self.backend: Optional[GenerationBackend] = None

    def get(self) -> GenerationBackend:
        if self.backend is None:
            self.backend = self._factory()
        return self.backend

    def release(self) -> None:
        self.backend = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass


class _DeferredBackend(GenerationBackend):
    """A GenerationBackend facade over :class:`_LazyBackend` (render and generate load it)."""

    def __init__(self, lazy: _LazyBackend):
        self._lazy = lazy

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        return self._lazy.get().tokenizer

    def render(self, messages):
        return self._lazy.get().render(messages)

    def generate(self, prompts, seeds, sampling):
        return self._lazy.get().generate(prompts, seeds, sampling)


def _store(out: Path, kind: str, benchmark: str, decoding: str) -> JsonlStore:
    return JsonlStore(out / kind / f"{benchmark}__{decoding}.jsonl")


def run_evaluation(
    config: EvalConfig,
    backend_factory: Optional[Callable[[], GenerationBackend]] = None,
    verifier: Optional[AnswerVerifier] = None,
    after_batch: Optional[Callable[[list[dict]], None]] = None,
) -> dict:
    """Generate (resumably), grade and summarise; returns the summary written to ``OUT``.

    Args:
        config: run settings.
        backend_factory: builds the generation backend (default: from ``config.backend``).
        verifier: an LLM verifier for rule failures (default: from ``config.verifier``).
        after_batch: hook called after each written generation batch.
    """
    config.validate()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    check_run_config(out, config, write=False)
    data_dir = Path(config.benchmarks_dir)
    catalogs = {b: load_problems(data_dir / f"{b}.parquet") for b in config.benchmarks}
    problems = {b: catalog[: config.limit] for b, catalog in catalogs.items()}
    for decoding in config.decodings:  # every saved sample must belong to this data, before any work
        for bench in config.benchmarks:
            saved_samples(_store(out, "generations", bench, decoding), catalogs[bench], bench, decoding, config.seed, str(data_dir / f"{bench}.parquet"))
            if verifier is not None or config.verifier != "none":
                VerdictCache(_store(out, "verifier", bench, decoding), [], {}).load()  # refuses old-format verdicts
    check_run_config(out, config, data_fingerprint(data_dir, catalogs))
    lazy = _LazyBackend(backend_factory or (lambda: build_backend(config.backend, config.model)))
    backend = _DeferredBackend(lazy)
    records = {}
    for decoding in config.decodings:
        temperature, top_p = DECODINGS[decoding]
        sampling = SamplingConfig(temperature, top_p, config.max_new_tokens)
        for bench in config.benchmarks:
            records[bench, decoding] = generate_samples(
                backend, problems[bench], config.n_samples[bench], sampling, _store(out, "generations", bench, decoding),
                bench, decoding, config.seed, config.batch_size, after_batch,
                catalog=catalogs[bench], data_label=str(data_dir / f"{bench}.parquet"),
            )
    lazy.release()
    if verifier is None and config.verifier != "none":  # built only now: the policy's GPU memory is free
        verifier = build_verifier(config.verifier, config.verifier_model, config.verifier_prompt_file)
    summary = summarise(config, problems, records, verifier, out)
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "summary.md", summary_markdown(summary))
    return summary


def summarise(config: EvalConfig, problems: dict, records: dict, verifier: Optional[AnswerVerifier], out: Path) -> dict:
    """Grade every (benchmark, decoding) and build the summary dict (schema in docs/eval.md)."""
    summary: dict[str, Any] = {
        "model": config.model,
        "scale": config.scale,
        "method": config.method,
        "verifier": config.verifier if verifier is None else getattr(verifier, "name", "custom"),
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
        "limit": config.limit,
        "decodings": {},
    }
    for decoding in config.decodings:
        temperature, top_p = DECODINGS[decoding]
        benches = {}
        for bench in config.benchmarks:
            recs, probs, n = records[bench, decoding], problems[bench], config.n_samples[bench]
            graded = grade_rule(recs, probs, config.reward_timeout_s, desc=f"grade {bench}/{decoding}")
            if verifier is not None:
                cache = VerdictCache(_store(out, "verifier", bench, decoding), probs, recs)
                graded = apply_verifier(graded, recs, probs, verifier, cache)  # type: ignore[arg-type]
            used = [recs[p.index, s] for p in probs for s in range(n)]
            benches[bench] = {
                "mean_at_n": mean_at_n(graded, probs, n),
                "rule_mean_at_n": mean_at_n(graded, probs, n, use_verifier=False),
                "n_samples": n,
                "problems": len(probs),
                "truncated_fraction": sum(r["finish_reason"] == "length" for r in used) / len(used),
                "mean_response_tokens": sum(r["num_tokens"] for r in used) / len(used),
            }
        summary["decodings"][decoding] = {
            "temperature": temperature,
            "top_p": top_p,
            "benchmarks": benches,
            "avg": sum(b["mean_at_n"] for b in benches.values()) / len(benches),
            "complete": set(benches) == set(BENCHMARKS) and config.limit is None,
        }
    return summary


def summary_markdown(summary: dict) -> str:
    """Markdown table of a summary: one row per decoding setting, mean@N in percent."""
    benches = [b for b in BENCHMARKS if any(b in d["benchmarks"] for d in summary["decodings"].values())]
    head = "| decoding | " + " | ".join(benches) + " | Avg |"
    lines = [f"# {summary['model']}", "", head, "|" + "---|" * (len(benches) + 2)]
    for name, dec in summary["decodings"].items():
        cells = [f"{dec['benchmarks'][b]['mean_at_n']:.2f}" if b in dec["benchmarks"] else "-" for b in benches]
        lines.append(f"| {name} ({dec['temperature']}/{dec['top_p']}) | " + " | ".join(cells) + f" | {dec['avg']:.2f} |")
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
            if name.strip() not in DEFAULT_N_SAMPLES:
                raise ValueError(f"unknown benchmark {name.strip()!r}")
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
    parser.add_argument("--verifier", default="none", choices=["none", "compass"])
    parser.add_argument("--verifier-model", default=None, help="verifier checkpoint (default opencompass/CompassVerifier-3B)")
    parser.add_argument("--verifier-prompt-file", default=None, help="prompt template with {question} {gold_answer} {llm_response}")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    parser.add_argument("--n-samples", default=None, help="N for all benchmarks, or NAME=N,... (default 32 for AIME24/25, AMC23; 4 otherwise)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per backend call (each batch is saved)")
    parser.add_argument("--limit", type=int, default=None, help="only the first K problems per benchmark (smoke tests)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm only")
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
        batch_size=args.batch_size,
        limit=args.limit,
        scale=args.scale,
        method=args.method,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        factory = None
        if args.backend == "vllm":
            factory = lambda: build_backend(  # noqa: E731
                "vllm", config.model, tensor_parallel_size=args.tensor_parallel_size,
                gpu_memory_utilization=args.gpu_memory_utilization,
            )
        summary = run_evaluation(config, factory)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary_markdown(summary))
    print(f"summary: {Path(config.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
