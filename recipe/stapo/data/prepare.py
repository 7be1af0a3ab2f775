"""Prepare STAPO's training set and the six evaluation benchmarks as verl parquet files.

A bad source row is refused by name rather than skipped, and the manifest and parquet files are
written so that an error or a kill leaves them consistent: docs/eval.md ("Prepare the data") has
the sources, the refused rows and the manifest.

Output schema (one row per problem; what verl's RLHFDataset reads)::

    data_source: str                      "math_dapo" for training, the benchmark name otherwise
    prompt:      [{"role": "user", "content": problem + joiner + PROMPT_SUFFIX}]
    ability:     "math"
    reward_model: {"style": "rule", "ground_truth": answer}
    extra_info:  {"index": int (row in this file), "id": str (source id), "split": str}
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from tqdm import tqdm

from stapo_core.fileio import atomic_write, atomic_write_json, check_output_folder, cli_path, open_regular, read_bytes, sha256_file
from recipe.stapo.reward.answers import ground_truth_conversion, ground_truth_problem, unicode_problem

PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
# the joiner between problem and instruction, by prompt form (docs/eval.md, "Prepare the data")
PROMPT_FORMS = {"justrl-eval": " ", "train": "\n\n"}
MANIFEST_NAME = "manifest.json"
TRAIN_DATA_SOURCE = "math_dapo"
VALIDATION_BENCHMARKS = ("aime24", "aime25", "amc23")  # also written as <name>_val.parquet, training form
# problem, answer and id fields of verl's row layout, read from every source after the dataset's own
VERL_FIELDS = (("prompt",), ("reward_model.ground_truth",), ("extra_info.id", "extra_info.index"))

# DAPO-Math-17k wraps each problem in its own "Answer:" instruction; STAPO uses \boxed{} instead.
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


@dataclass(frozen=True)
class SourceSpec:
    """Where one dataset comes from and which fields (dotted paths into a row, the first present
    one used) hold what; without an id field the row number is the id."""

    name: str
    hf_id: str
    split: str
    problem_fields: tuple[str, ...]
    answer_fields: tuple[str, ...]
    id_fields: tuple[str, ...] = ()
    hf_config: Optional[str] = None
    strip_prefix: str = ""
    strip_suffix: str = ""
    dedupe: bool = False  # drop exact repeats of (problem, answer): DAPO-Math-17k ships ~100x copies
    strip_dollars: bool = False  # remove an answer's surrounding $ (training answers; JustRL grades benchmarks' as written)
    expected_rows: Optional[int] = None  # rows of the default source (a preparation notes another count)

    def fields(self, role: int) -> tuple[str, ...]:
        """The candidate fields of ``role`` (0 problem, 1 answer, 2 id): the dataset's, then verl's."""
        own = (self.problem_fields, self.answer_fields, self.id_fields)[role]
        return own + tuple(f for f in VERL_FIELDS[role] if f not in own)


TRAIN_SPEC = SourceSpec(
    name="train",
    hf_id="BytedTsinghua-SIA/DAPO-Math-17k",
    split="train",
    problem_fields=("prompt", "problem", "question"),
    answer_fields=("reward_model.ground_truth", "answer"),  # never "solution": a worked solution is no answer
    id_fields=("extra_info.index", "id"),
    strip_prefix=DAPO_PREFIX,
    strip_suffix=DAPO_SUFFIX,
    dedupe=True,
    strip_dollars=True,
)

BENCHMARK_SPECS: dict[str, SourceSpec] = {
    spec.name: spec
    for spec in (
        SourceSpec("aime24", "HuggingFaceH4/aime_2024", "train", ("problem",), ("answer",), ("id",), expected_rows=30),
        SourceSpec("aime25", "yentinglin/aime_2025", "train", ("problem",), ("answer",), ("id",), expected_rows=30),
        SourceSpec("amc23", "math-ai/amc23", "test", ("question", "problem"), ("answer",), ("id",), expected_rows=40),
        SourceSpec(
            "math500", "HuggingFaceH4/MATH-500", "test", ("problem",), ("answer",), ("unique_id", "id"), expected_rows=500
        ),
        SourceSpec("minerva", "math-ai/minervamath", "test", ("question", "problem"), ("answer",), ("id",), expected_rows=272),
        SourceSpec(
            "olympiadbench",
            "math-ai/olympiadbench",
            "test",
            ("question", "problem"),
            ("final_answer", "answer"),
            ("id",),
            expected_rows=675,
        ),
    )
}


@dataclass
class PrepareResult:
    """What one preparation wrote (also its manifest entry)."""

    name: str
    output: str
    rows: int
    output_sha256: str
    source: str
    source_sha256: str
    source_rows: int
    dropped_invalid: int = 0
    duplicates_removed: int = 0
    invalid_examples: list[str] = field(default_factory=list)
    prompt_form: str = "justrl-eval"

    def manifest_entry(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "name"}


# ----------------------------------------------------------------------------------------------
# reading sources
# ----------------------------------------------------------------------------------------------
def _is_local(source: str) -> bool:
    return Path(source).suffix.lower() in {".parquet", ".jsonl", ".json"} or Path(source).exists()


def iter_local_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number_1_based, row)`` from a parquet / jsonl / json file; a bad JSONL line is
    yielded as a ``_BadRow`` so that validation reports it like any other bad row."""
    if not path.is_file():
        raise FileNotFoundError(f"source file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pandas as pd  # pandas (a second to import) only for a file to read, not for --help

        try:
            frame = pd.read_parquet(path)
        except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{path}: cannot be read as a parquet file ({type(exc).__name__}: {exc})") from None
        yield from enumerate(frame.to_dict(orient="records"), start=1)
    elif suffix == ".jsonl":
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield number, _BadRow(
                        f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line); "
                        "re-save the file as UTF-8"
                    )
                    continue
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield number, _BadRow(f"not valid JSON ({exc.msg})")
    elif suffix == ".json":
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); re-save it as UTF-8"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
        if isinstance(data, dict):
            data = next((v for v in data.values() if isinstance(v, list)), None)
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json source must hold a list of rows (or a dict with one)")
        yield from enumerate(data, start=1)
    else:
        raise ValueError(f"{path}: unsupported source file type {suffix!r} (use .parquet, .jsonl or .json)")


def iter_hf_rows(spec: SourceSpec, hf_id: str) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number_1_based, row)`` from a Hugging Face dataset (needs the hub)."""
    import datasets  # datasets (seconds to import) only for a Hugging Face source

    dataset = datasets.load_dataset(hf_id, name=spec.hf_config, split=spec.split)
    yield from enumerate(dataset, start=1)


class _BadRow:
    def __init__(self, message: str):
        self.message = message


def _lookup(row: Any, dotted: str) -> Any:
    """Follow a dotted path (``"prompt.0.content"``) into dicts and sequences; None if absent."""
    node = row
    for part in dotted.split("."):
        if isinstance(node, dict):
            if part not in node:
                return None
            node = node[part]
        elif part.isdigit() and hasattr(node, "__len__") and not isinstance(node, str):
            index = int(part)
            if index >= len(node):
                return None
            node = node[index]
        else:
            return None
    return node


def _is_missing(value: Any) -> bool:
    """None, a float NaN or a pandas NA: how a parquet file's empty cell reads."""
    return value is None or (isinstance(value, float) and math.isnan(value)) or type(value).__name__ in ("NAType", "NaTType")


def _first_present(row: Any, paths: Sequence[str]) -> tuple[Optional[str], Any]:
    """The first of ``paths`` whose value is not missing (:func:`_is_missing`), with its value.
    When every one is missing: the first that holds a NaN (so that an error can name it), else
    ``(None, None)``."""
    empty_cell: tuple[Optional[str], Any] = (None, None)
    for path in paths:
        value = _lookup(row, path)
        if not _is_missing(value):
            return path, value
        if value is not None and empty_cell[0] is None:
            empty_cell = (path, value)
    return empty_cell


def answer_to_text(value: Any, strip_dollars: bool = False) -> str:
    """Ground truth as written to the parquet file: the rewards' text of it
    (:func:`recipe.stapo.reward.answers.ground_truth_conversion`), with surrounding spaces stripped,
    and surrounding ``$`` too when ``strip_dollars``."""
    text, why = ground_truth_conversion(value)
    if text is None:
        raise ValueError(why)
    return text.strip().strip("$").strip() if strip_dollars else text.strip()


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def _user_message(value: Any) -> Any:
    """The content of the last user message when ``value`` is a list of chat messages (verl's
    ``prompt``), else ``value``."""
    if isinstance(value, (str, dict)) or not hasattr(value, "__len__"):
        return value
    users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users else value


def _problem_text(value: Any, field: str) -> tuple[Optional[str], Optional[str]]:
    """``(problem, None)`` for a text, else ``(None, why)``: a problem is never a number, a dict..."""
    if not isinstance(value, str):
        hint = "; an empty parquet cell reads as NaN" if isinstance(value, float) and math.isnan(value) else ""
        return None, f"problem (field {field}) is not text (got {_describe(value)}{hint})"
    bad = unicode_problem(value)
    return (None, f"problem (field {field}) has {bad}") if bad else (value, None)


def _id_text(value: Any, field: Optional[str], number: int) -> tuple[Optional[str], Optional[str]]:
    """``(id, None)``: a string, an integer (``3.0`` -> ``"3"``), or the row number when there is none."""
    if field is None or _is_missing(value):
        return str(number), None
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None, f"id (field {field}) is not a string or an integer (got {_describe(value)})"
    bad = unicode_problem(value) if isinstance(value, str) else None
    return (None, f"id (field {field}) has {bad}") if bad else (str(value), None)


# ----------------------------------------------------------------------------------------------
# validation and conversion
# ----------------------------------------------------------------------------------------------
@dataclass
class _Record:
    problem: str
    answer: str
    source_id: str


def _extract(spec: SourceSpec, number: int, row: Any) -> tuple[Optional[_Record], Optional[str]]:
    """Turn one source row into a record, or return the reason it is invalid."""
    if isinstance(row, _BadRow):
        return None, row.message
    if not isinstance(row, dict):
        return None, f"not an object (got {type(row).__name__})"
    problem_path, problem = _first_present(row, spec.fields(0))
    if problem is None:
        return None, f"missing problem (looked for {', '.join(spec.fields(0))})"
    problem, why = _problem_text(_user_message(problem), problem_path)
    if problem is None:
        return None, why
    if spec.strip_prefix and problem.startswith(spec.strip_prefix):
        problem = problem[len(spec.strip_prefix) :]
    if spec.strip_suffix and problem.endswith(spec.strip_suffix):
        problem = problem[: -len(spec.strip_suffix)]
    if prompt_form(problem) != "custom":  # a prepared file as the source: its instruction is added again
        problem = problem[: -len(PROMPT_FORMS[prompt_form(problem)] + PROMPT_SUFFIX)]
    problem = problem.strip()
    if not problem:
        return None, f"empty problem (field {problem_path})"
    answer_path, answer = _first_present(row, spec.fields(1))
    if answer is None:
        return None, f"missing answer (looked for {', '.join(spec.fields(1))})"
    try:
        answer = answer_to_text(answer, spec.strip_dollars)
    except ValueError as exc:
        return None, f"invalid answer (field {answer_path}): {exc}"
    if not answer:
        return None, f"empty answer (field {answer_path})"
    unusable = ground_truth_problem(answer)  # e.g. longer than MAX_GROUND_TRUTH_CHARS: a solution, not an answer
    if unusable:
        return None, f"invalid answer (field {answer_path}): {unusable}"
    id_path, source_id = _first_present(row, spec.fields(2))
    source_id, why = _id_text(source_id, id_path, number)
    if source_id is None:
        return None, why
    return _Record(problem, answer, source_id), None


def collect_records(
    spec: SourceSpec, rows: Iterable[tuple[int, Any]], source_label: str, drop_invalid: bool
) -> tuple[list[_Record], int, int, list[str]]:
    """Validate rows; return ``(records, source_rows, duplicates_removed, invalid_messages)``."""
    records: list[_Record] = []
    seen_ids: dict[str, int] = {}
    seen_pairs: set[tuple[str, str]] = set()
    invalid: list[str] = []
    duplicates = 0
    source_rows = 0
    # a bar on a terminal only: in a log (stderr not a terminal) its cursor escapes are noise
    for number, row in tqdm(rows, desc=f"read {spec.name}", unit=" rows", leave=False, disable=None):
        source_rows += 1
        record, reason = _extract(spec, number, row)
        if record is not None and spec.dedupe:
            if (record.problem, record.answer) in seen_pairs:
                duplicates += 1
                continue
            seen_pairs.add((record.problem, record.answer))
        if record is not None and record.source_id in seen_ids:
            record, reason = None, f"duplicate id {record.source_id!r} (first at row {seen_ids[record.source_id]})"
        if record is None:
            invalid.append(f"{source_label}: row {number}: {reason}")
            continue
        seen_ids[record.source_id] = number
        records.append(record)
    if invalid and not drop_invalid:
        shown = "\n  ".join(invalid[:20])
        more = f"\n  ... and {len(invalid) - 20} more" if len(invalid) > 20 else ""
        raise ValueError(
            f"{len(invalid)} invalid row(s) in {source_label} (rows are 1-based; pass --drop-invalid "
            f"to drop them):\n  {shown}{more}"
        )
    if not records:
        raise ValueError(f"{source_label}: no valid rows")
    return records, source_rows, duplicates, invalid


def prompt_form(user_message: str) -> str:
    """The prompt form of a user message: ``justrl-eval`` or ``train`` (:data:`PROMPT_FORMS`) when it
    is a problem followed by that form's joiner and :data:`PROMPT_SUFFIX`, else ``custom``."""
    for name, joiner in PROMPT_FORMS.items():
        if user_message.endswith(joiner + PROMPT_SUFFIX) and len(user_message) > len(joiner + PROMPT_SUFFIX):
            return name
    return "custom"


def build_row(record: _Record, index: int, data_source: str, split: str, form: str = "justrl-eval") -> dict:
    """One verl row (see the module docstring for the schema) with the prompt form ``form``."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": record.problem + PROMPT_FORMS[form] + PROMPT_SUFFIX}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": record.answer},
        "extra_info": {"index": index, "id": record.source_id, "split": split},
    }


def _rows_sha256(rows: Iterable[tuple[int, Any]]) -> tuple[list[tuple[int, Any]], str]:
    """Materialise rows and hash their canonical JSON (content hash of a hub dataset)."""
    digest = hashlib.sha256()
    materialised = []
    for number, row in rows:
        materialised.append((number, row))
        digest.update(json.dumps(row, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return materialised, digest.hexdigest()


def prepare_dataset(
    spec: SourceSpec,
    out_path: Path,
    source: Optional[str] = None,
    drop_invalid: bool = False,
    data_source: Optional[str] = None,
    split: str = "test",
    manifest_dir: Optional[Path] = None,
    form: str = "justrl-eval",
) -> PrepareResult:
    """Read, validate and write one dataset atomically to ``out_path`` (parquet) from ``source``
    (a local file or hub id, default ``spec.hf_id``), and record it in ``manifest_dir/manifest.json``
    when given; an error at any point leaves both files as they were."""
    import pandas as pd  # pandas (a second to import) only when a dataset is written, not for --help

    check_output_folder("--out-dir", out_path.parent)
    if manifest_dir is not None:
        read_manifest(manifest_dir)  # a corrupt manifest fails before the source is read
    source = source or spec.hf_id
    if _is_local(source):
        label = str(Path(source).resolve())
        rows = iter_local_rows(Path(source))
        source_hash = sha256_file(source) if Path(source).is_file() else ""
    else:
        label = f"hf:{source}[{spec.split}]"
        rows, source_hash = _rows_sha256(iter_hf_rows(spec, source))
    records, source_rows, duplicates, invalid = collect_records(spec, rows, label, drop_invalid)
    table = [build_row(r, i, data_source or spec.name, split, form) for i, r in enumerate(records)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(out_path.parent):
        # under the folder's lock: another preparation into this folder waits here, and the
        # manifest is read now, so an entry it wrote meanwhile is kept
        previous = read_manifest(manifest_dir, _locked=True) if manifest_dir is not None else None
        remove_stale_temps(out_path.parent)
        results, pending = [], []

        def record(tmp: str) -> None:
            results.append(PrepareResult(
                name=spec.name,
                output=out_path.name,
                rows=len(records),
                output_sha256=sha256_file(tmp),
                source=label,
                source_sha256=source_hash,
                source_rows=source_rows,
                dropped_invalid=len(invalid),
                duplicates_removed=duplicates,
                invalid_examples=invalid[:20],
                prompt_form=form,
            ))
            if manifest_dir is not None:
                # the entry names its temp file as pending: a kill before the rename is finished
                # by the next reader of the manifest (:func:`read_manifest`)
                _write_manifest(manifest_dir, previous, results, pending={out_path.name: Path(tmp).name})
                pending.append(tmp)

        try:
            atomic_write(out_path, lambda tmp: pd.DataFrame(table).to_parquet(tmp, index=False), record)
        except BaseException:  # the manifest is put back as it was
            if pending and previous is None:
                (Path(manifest_dir) / MANIFEST_NAME).unlink(missing_ok=True)
            elif pending:
                atomic_write_json(Path(manifest_dir) / MANIFEST_NAME, previous)
            raise
        if manifest_dir is not None:
            _write_manifest(manifest_dir, previous, results)
    if spec.expected_rows is not None and len(records) != spec.expected_rows:
        print(f"[prepare] note: {spec.name} has {len(records)} rows, its default source has {spec.expected_rows} "
              "(docs/eval.md)", file=sys.stderr)
    return results[0]


LOCK_NAME = ".prepare.lock"  # one preparation at a time writes a folder's parquet files and manifest


@contextmanager
def _folder_lock(out_dir: Path) -> Iterator[None]:
    """Hold the output folder's lock (:data:`LOCK_NAME`; waits for another preparation's write)."""
    fd = open_regular(Path(out_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # which releases the lock


def read_manifest(out_dir: Path, _locked: bool = False) -> Optional[dict]:
    """``out_dir/manifest.json`` as a dict, or None when there is none; the ``pending`` renames a
    killed preparation left are completed first, under the folder's lock (:func:`_finish_pending`)."""
    manifest = _read_manifest_file(out_dir)
    if manifest is not None and manifest.get("pending") and not _locked and Path(out_dir).is_dir():
        with _folder_lock(Path(out_dir)):
            return read_manifest(out_dir, _locked=True)
    if manifest is not None and manifest.get("pending"):
        manifest = _finish_pending(Path(out_dir), manifest)
    return manifest


def remove_stale_temps(out_dir: Path) -> list[Path]:
    """Remove the temp files a killed preparation left in ``out_dir`` (a parquet file's, before its
    rename; the manifest's, before its own rename) and return them. Called with the folder's lock
    held and after :func:`read_manifest` finished any pending rename, so no temp file there belongs
    to a running preparation or holds the only copy of a recorded dataset."""
    stale = sorted(out_dir.glob(".*.parquet.*.tmp")) + sorted(out_dir.glob(f".{MANIFEST_NAME}.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _finish_pending(out_dir: Path, manifest: dict) -> dict:
    """Complete the pending renames of ``manifest`` (the lock is held): a pending temp file whose hash
    is the one recorded is renamed into place, an entry whose file matches neither is dropped; then
    every stale temp file is removed and ``pending`` dropped, so the manifest and the files agree."""
    pending = manifest.pop("pending") or {}
    for output, tmp_name in pending.items() if isinstance(pending, dict) else ():
        tmp, final = out_dir / str(tmp_name), out_dir / str(output)
        name, entry = next(((n, e) for n, e in manifest.get("datasets", {}).items()
                            if isinstance(e, dict) and e.get("output") == output), (None, None))
        if entry is None:
            continue
        if tmp.is_file() and sha256_file(tmp) == entry.get("output_sha256"):
            os.replace(tmp, final)
            print(f"[prepare] {final}: finished the rename a killed preparation left", file=sys.stderr)
        elif not final.is_file() or sha256_file(final) != entry.get("output_sha256"):
            del manifest["datasets"][name]
            print(f"[prepare] warning: {out_dir / MANIFEST_NAME}: the entry of {name} did not match {final} and its "
                  "pending copy is gone; entry removed, rerun the preparation of that dataset", file=sys.stderr)
    remove_stale_temps(out_dir)
    atomic_write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest


def _read_manifest_file(out_dir: Path) -> Optional[dict]:
    """``out_dir/manifest.json`` as it is on disk (see :func:`read_manifest`)."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    fix = ("move it aside (the next preparation then writes a new manifest that records only the datasets "
           "it prepares) or restore it from a copy; nothing was written")
    try:
        manifest = json.loads(read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: corrupt manifest, not UTF-8 JSON ({exc}); {fix}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the manifest ({exc}); {fix}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("datasets", {}), dict):
        raise ValueError(f"{path}: corrupt manifest (expected a JSON object whose 'datasets' is an object); {fix}")
    return manifest


def _write_manifest(out_dir: Path, previous: Optional[dict], results: Sequence[PrepareResult],
                    pending: Optional[dict[str, str]] = None) -> Path:
    manifest = json.loads(json.dumps(previous)) if previous else {}
    manifest.setdefault("datasets", {})
    manifest.pop("pending", None)
    for result in results:
        manifest["datasets"][result.name] = result.manifest_entry()
    manifest["prompt_suffix"] = PROMPT_SUFFIX
    if pending:
        manifest["pending"] = pending
    return atomic_write_json(Path(out_dir) / MANIFEST_NAME, manifest)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def _override_fields(spec: SourceSpec, args: argparse.Namespace) -> SourceSpec:
    changes = {}
    for role in ("problem", "answer", "id"):
        value = getattr(args, f"{role}_field", None)
        if value:
            changes[f"{role}_fields"] = tuple(value.split(","))
    if getattr(args, "split", None):
        changes["split"] = args.split
    return replace(spec, **changes) if changes else spec


def _parse_sources(pairs: Sequence[str]) -> dict[str, str]:
    sources = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in BENCHMARK_SPECS:
            raise ValueError(f"--source expects NAME=PATH_OR_ID with NAME in {list(BENCHMARK_SPECS)}, got {pair!r}")
        sources[name] = value
    return sources


def run_train(args: argparse.Namespace) -> list[PrepareResult]:
    out_dir = Path(args.out_dir)
    return [prepare_dataset(_override_fields(TRAIN_SPEC, args), out_dir / "train.parquet", args.source, args.drop_invalid,
                            TRAIN_DATA_SOURCE, "train", manifest_dir=out_dir, form="train")]


def run_bench(args: argparse.Namespace) -> list[PrepareResult]:
    names = [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--benchmarks {args.benchmarks!r} names no benchmark; pass some of {','.join(BENCHMARK_SPECS)} "
                         "(or leave --benchmarks out for all six)")
    unknown = [n for n in names if n not in BENCHMARK_SPECS]
    if unknown:
        raise ValueError(f"--benchmarks: unknown {unknown}; known: {list(BENCHMARK_SPECS)}")
    sources = _parse_sources(args.source or [])
    out_dir = Path(args.out_dir)
    results = []  # prepare_dataset checks the folder and its manifest before it reads a source
    for name in tqdm(names, desc="benchmarks", unit="bench"):
        # recorded in the manifest with its parquet, so a later failure loses nothing
        spec = BENCHMARK_SPECS[name]
        results.append(prepare_dataset(spec, out_dir / f"{name}.parquet", sources.get(name), args.drop_invalid,
                                       manifest_dir=out_dir))
        if name in VALIDATION_BENCHMARKS:  # the trainer's validation copy, in JustRL's training prompt
            validation = replace(spec, name=f"{name}_val", expected_rows=None)
            results.append(prepare_dataset(validation, out_dir / f"{validation.name}.parquet", sources.get(name),
                                           args.drop_invalid, name, manifest_dir=out_dir, form="train"))
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.data.prepare", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="DAPO-Math-17k -> OUT/train.parquet")
    train.add_argument("--out-dir", type=cli_path, required=True)
    train.add_argument("--source", default=None, help=f"hub id or local file (default {TRAIN_SPEC.hf_id})")
    train.add_argument("--split", default=None, help="hub split (default train)")
    for role in ("problem", "answer", "id"):
        train.add_argument(f"--{role}-field", default=None, help=f"dotted field path(s) of the {role}, comma-separated")
    bench = sub.add_parser("bench", help="the six benchmarks -> OUT/<name>.parquet (and OUT/<name>_val.parquet for training)")
    bench.add_argument("--out-dir", type=cli_path, required=True)
    bench.add_argument("--benchmarks", default=",".join(BENCHMARK_SPECS))
    bench.add_argument("--source", action="append", help="NAME=PATH_OR_ID (repeatable), overrides the default hub id")
    for sub_parser in (train, bench):
        sub_parser.add_argument("--drop-invalid", action="store_true", help="drop and count invalid rows instead of failing")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = run_train(args) if args.command == "train" else run_bench(args)
    except (ValueError, OSError) as exc:  # OSError's message names its file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in results:
        print(
            f"{r.name}: {r.rows} rows -> {Path(args.out_dir) / r.output} "
            f"(dropped {r.dropped_invalid} invalid, removed {r.duplicates_removed} duplicates)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
