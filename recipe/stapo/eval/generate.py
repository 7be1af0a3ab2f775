"""Resumable sampling of N completions per problem, appended to a JSONL file as they come.

One line per (problem, sample), flushed and fsynced after every batch. A rerun reads the file,
skips every (problem, sample) already there and generates only the rest; a truncated last line
(a crash mid-write) is ignored when reading and cut off the file before the next append. Each
sample has its own seed, derived from (base seed, benchmark, decoding, problem id, sample index),
so a resumed run produces exactly what an uninterrupted one would. Saved samples belong to
problems by identity (id and prompt hash), never by row position: docs/eval.md ("Resuming on
other data") has the cases and the record schema.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tqdm import tqdm

from recipe.stapo.data.prepare import PROMPT_FORMS, PROMPT_SUFFIX, prompt_form
from recipe.stapo.eval.backends import GenerationBackend, SamplingConfig
from stapo_core.fileio import append, append_lines, open_regular, read_bytes


@dataclass(frozen=True)
class Problem:
    """One benchmark problem: ``index`` is its 0-based row, ``messages`` the verl ``prompt``
    column, ``question`` the user message (what an LLM verifier is shown)."""

    index: int
    problem_id: str
    messages: tuple
    ground_truth: str
    question: str
    prompt_sha256: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_sha256", messages_sha256(self.messages))


def text_sha256(text: str) -> str:
    """Hex sha256 of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def json_sha256(obj: Any) -> str:
    """Hex sha256 of an object's canonical JSON (keys sorted)."""
    return text_sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False))


def messages_sha256(messages: Sequence[dict]) -> str:
    """Hex sha256 of chat messages (canonical JSON: keys sorted, list order kept)."""
    return json_sha256([dict(m) for m in messages])


def problems_sha256(problems: Sequence[Problem]) -> str:
    """Hex sha256 of a benchmark's content: every problem's id, prompt and reference answer, in
    id order (the same problems in another row order, or the same file prepared again, hash the
    same)."""
    return json_sha256(sorted((p.problem_id, p.prompt_sha256, text_sha256(p.ground_truth)) for p in problems))


class ResumeMismatch(ValueError):
    """Saved records in an output folder do not belong to the benchmark data of this run."""


NEW_OUT_HINT = (
    "Use the --benchmarks-dir this --out folder was made with, or evaluate into a new --out folder "
    "(nothing in this one was changed)"
)
FINISH_REASONS = ("stop", "length")


DECODINGS = {"train": (1.0, 1.0), "justrl": (0.7, 0.9)}  # name -> (temperature, top_p)


def store(out: Path, kind: str, benchmark: str, decoding: str) -> "JsonlStore":
    """The store of one (benchmark, decoding) under ``OUT/<kind>/`` (``generations``, ``grades``, ``verifier``)."""
    return JsonlStore(out / kind / f"{benchmark}__{decoding}.jsonl")


def sample_seed(base_seed: int, benchmark: str, decoding: str, problem_id: str, sample: int) -> int:
    """Deterministic 31-bit seed of one sample (stable across runs, platforms and batchings)."""
    key = f"{base_seed}|{benchmark}|{decoding}|{problem_id}|{sample}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


class JsonlStore:
    """Append-only JSONL file of records keyed by ``(problem_index, sample)``, created on first
    append. Reading never changes the file; :meth:`append` first repairs its last line."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict[tuple[int, int], dict]:
        """Records on disk keyed by ``(problem_index, sample)`` (the last one wins); see :meth:`read`."""
        return {(record["problem_index"], record["sample"]): record for _, record in self.read()}

    def read(self) -> list[tuple[int, dict]]:
        """``(1-based line, record)`` of every record on disk, in file order. A truncated last line
        is left out; any other bad line raises ValueError naming the file and line."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[tuple[int, dict]], int, bool]:
        """``(records, bytes of the good prefix, last record lacks only its newline)``."""
        if not self.path.exists():
            return [], 0, False
        raw = read_bytes(self.path)
        lines = raw.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline
        records: list[tuple[int, dict]] = []
        good_bytes = 0
        for number, line in enumerate(complete, start=1):
            record = self._parse(line)
            if record is None:
                if number == len(complete) and not tail.strip():
                    tail = line  # the last line itself is corrupt: treat it as the truncated one
                    break
                raise ValueError(f"{self.path}: line {number} is not a valid record; fix or delete that line")
            records.append((number, record))
            good_bytes += len(line) + 1
        if tail.strip():
            record = self._parse(tail)
            if record is not None:  # complete record that only lacks its newline
                records.append((len(complete) + 1, record))
                return records, good_bytes + len(tail), True
        return records, good_bytes, False

    def _last_line_ok(self) -> bool:
        """Whether the file is empty or ends with a newline after a valid record (reads only the
        last line)."""
        with os.fdopen(open_regular(self.path, os.O_RDONLY), "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return True
            handle.seek(size - 1)
            if handle.read(1) != b"\n":
                return False
            start, chunk = size - 1, b""
            while start > 0 and b"\n" not in chunk:
                step = min(start, 1 << 16)
                start -= step
                handle.seek(start)
                chunk = handle.read(step) + chunk
            return self._parse(chunk[:-1].rsplit(b"\n", 1)[-1]) is not None

    def repair(self) -> None:
        """Cut a truncated last line off the file, or add the newline a complete last record lacks."""
        if not self.path.exists() or self._last_line_ok():
            return
        _, good_bytes, needs_newline = self._scan()
        append(self.path, b"\n" if needs_newline else b"", at=None if needs_newline else good_bytes)

    @staticmethod
    def _parse(line: bytes) -> Optional[dict]:
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(record, dict) or "problem_index" not in record or "sample" not in record:
            return None
        return record

    def append(self, records: Sequence[dict]) -> None:
        """Append records, one line each, then flush and fsync (:func:`stapo_core.fileio.append_lines`)."""
        if not records:
            return
        self.repair()
        append_lines(self.path, [json.dumps(record, ensure_ascii=False) for record in records])


def check_generation_record(record: dict, where: str) -> None:
    """Raise :class:`ResumeMismatch` naming ``where`` when a saved generation record lacks a
    field or has one of the wrong type."""
    if not isinstance(record.get("problem_id"), str) or not isinstance(record.get("prompt_sha256"), str):
        raise ResumeMismatch(
            f"{where}: saved sample has no problem identity (problem_id and prompt_sha256; written by an "
            "older version), so it cannot be checked against the benchmark data. Evaluate into a new --out "
            "folder (this one was not changed)"
        )
    checks = (
        ("sample", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
        ("seed", lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        ("response", lambda v: isinstance(v, str), "a string"),
        ("num_tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
        ("finish_reason", lambda v: v in FINISH_REASONS, "'stop' or 'length'"),
    )
    for name, ok, expected in checks:
        if name not in record or not ok(record[name]):
            found = "has no" if name not in record else f"has {name}={record[name]!r} in"
            raise ResumeMismatch(
                f"{where}: the saved sample of problem {record['problem_id']!r} {found} field {name!r} "
                f"(expected {expected}): the line was edited by hand or written by another version. Delete that "
                "line (its sample is generated again on the next run) or evaluate into a new --out folder "
                "(nothing was changed)"
            )


def saved_samples(
    store: JsonlStore,
    catalog: Sequence[Problem],
    benchmark: str,
    decoding: str,
    base_seed: int,
    data_label: str = "the benchmark data",
) -> dict[tuple[str, int], dict]:
    """Saved records of ``store`` keyed by ``(problem_id, sample)``, each checked against
    ``catalog`` (every problem of the data, not only a ``--limit``'s): the first record that is
    malformed, of an unknown problem, of another prompt or with another seed raises
    :class:`ResumeMismatch` naming file, line, benchmark and problem."""
    by_id = {p.problem_id: p for p in catalog}
    saved: dict[tuple[str, int], dict] = {}
    for line, record in store.read():
        where = f"{store.path}: line {line}: benchmark {benchmark}"
        check_generation_record(record, where)
        problem, sample = by_id.get(record["problem_id"]), record["sample"]
        if problem is None:
            raise ResumeMismatch(
                f"{where}: saved samples are for problem {record['problem_id']!r}, which is not in {data_label}: "
                f"this folder was generated from other data. {NEW_OUT_HINT}"
            )
        if problem.prompt_sha256 != record["prompt_sha256"]:
            form = saved_prompt_form(problem, record["prompt_sha256"])
            why = ("this folder was generated from other data" if form is None else
                   f"its saved samples were generated from the same problem in the prompt form {form!r} "
                   f"({PROMPT_FORMS[form]!r} between problem and instruction), the data now has "
                   f"{prompt_form(problem.question)!r}: samples of two prompt forms are never mixed in one folder")
            raise ResumeMismatch(
                f"{where}: problem {problem.problem_id!r} (row {problem.index} of {data_label}) has another prompt "
                f"than the one its saved samples were generated for: {why}. {NEW_OUT_HINT}"
            )
        expected = sample_seed(base_seed, benchmark, decoding, problem.problem_id, sample)
        if record["seed"] != expected:
            raise ResumeMismatch(
                f"{where}: problem {problem.problem_id!r} sample {sample} has seed {record['seed']!r}, not "
                f"{expected} ({benchmark}/{decoding}, seed {base_seed}): the file belongs to another benchmark, "
                f"decoding or seed. {NEW_OUT_HINT}"
            )
        saved[problem.problem_id, sample] = record
    return saved


def saved_prompt_form(problem: Problem, saved_sha256: str) -> Optional[str]:
    """The prompt form (:data:`recipe.stapo.data.prepare.PROMPT_FORMS`) in which ``problem``'s
    prompt hashes to ``saved_sha256``, when that is not its form now; None otherwise."""
    now = prompt_form(problem.question)
    if now not in PROMPT_FORMS:
        return None
    bare = problem.question[: -len(PROMPT_FORMS[now] + PROMPT_SUFFIX)]
    for name, joiner in PROMPT_FORMS.items():
        messages = [dict(m, content=bare + joiner + PROMPT_SUFFIX) if m["content"] == problem.question else dict(m)
                    for m in problem.messages]
        if name != now and messages_sha256(messages) == saved_sha256:
            return name
    return None


def pending_items(problems: Sequence[Problem], n_samples: int, saved: dict[tuple[str, int], Any]) -> list[tuple[Problem, int]]:
    """``(problem, sample)`` of ``problems`` x ``range(n_samples)`` not in ``saved`` (keys
    ``(problem_id, sample)``), in the order one worker generates them."""
    return [(p, s) for p in problems for s in range(n_samples) if (p.problem_id, s) not in saved]


def generation_record(problem: Problem, sample: int, seed: int, completion: Any) -> dict:
    """The saved record of one completion."""
    return {
        "problem_index": problem.index,
        "problem_id": problem.problem_id,
        "prompt_sha256": problem.prompt_sha256,
        "sample": sample,
        "seed": seed,
        "response": completion.text,
        "num_tokens": completion.num_tokens,
        "finish_reason": completion.finish_reason,
    }


def generate_items(
    backend: GenerationBackend,
    items: Sequence[tuple[Problem, int]],
    sampling: SamplingConfig,
    store: JsonlStore,
    benchmark: str,
    decoding: str,
    base_seed: int = 0,
    batch_size: int = 256,
    after_batch: Optional[Callable[[list[dict]], None]] = None,
    total: Optional[int] = None,
) -> list[dict]:
    """Generate ``items`` (``(problem, sample)`` pairs) in batches, appending each batch to
    ``store`` before the next starts. Returns the new records."""
    total = len(items) if total is None else total
    made: list[dict] = []
    with tqdm(total=total, initial=total - len(items), desc=f"{benchmark}/{decoding}", unit="sample") as bar:
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            seeds = [sample_seed(base_seed, benchmark, decoding, p.problem_id, s) for p, s in batch]
            completions = backend.generate([backend.render(p.messages) for p, _ in batch], seeds, sampling)
            records = [generation_record(p, s, seed, c) for (p, s), seed, c in zip(batch, seeds, completions)]
            store.append(records)
            made += records
            bar.update(len(records))
            if after_batch is not None:
                after_batch(records)
    return made


def collect_records(problems: Sequence[Problem], n_samples: int, saved: dict[tuple[str, int], dict]) -> dict[tuple[int, int], dict]:
    """The records of ``problems`` x ``range(n_samples)`` from ``saved`` (keys ``(problem_id,
    sample)``), keyed by ``(problem.index, sample)`` of the current data; ValueError if one is missing."""
    out = {}
    for p in problems:
        for s in range(n_samples):
            record = saved.get((p.problem_id, s))
            if record is None:
                raise ValueError(f"problem {p.problem_id!r} sample {s} has not been generated")
            out[p.index, s] = dict(record, problem_index=p.index)
    return out


def merge_parts(
    main: JsonlStore,
    parts: Sequence[JsonlStore],
    catalog: Sequence[Problem],
    benchmark: str,
    decoding: str,
    base_seed: int,
    data_label: str = "the benchmark data",
) -> int:
    """Move the records of workers' part files into ``main``, then delete the parts.

    Every part record is checked like a saved sample (:func:`saved_samples`); those ``main``
    lacks are appended in catalog order (problem row, then sample), the order one worker writes
    them, and the part files are removed only once that is on disk, so an interrupted merge is
    simply done again. Returns the number of records appended.
    """
    have = saved_samples(main, catalog, benchmark, decoding, base_seed, data_label)
    new: dict[tuple[str, int], dict] = {}
    for part in parts:
        for key, record in saved_samples(part, catalog, benchmark, decoding, base_seed, data_label).items():
            if key not in have:
                new[key] = record
    row = {p.problem_id: p.index for p in catalog}
    ordered = sorted(new.values(), key=lambda r: (row[r["problem_id"]], r["sample"]))
    main.append([dict(r, problem_index=row[r["problem_id"]]) for r in ordered])
    for part in parts:
        part.path.unlink(missing_ok=True)
    return len(ordered)


class ResultCache:
    """Per-sample grading results (answer grades, verifier verdicts) on disk, each record carrying
    the identity of everything that decided it.

    A result is reused only when every field of :meth:`identity` matches now, whatever the
    problem's row is (docs/eval.md, "Every cached grade is keyed by what decides it").
    ``records`` are the generation records keyed by ``(problem.index, sample)``; ``decided_by``
    is the JSON identity of the answer grader or verifier.
    """

    def __init__(self, store: JsonlStore, problems: Sequence[Problem], records: dict[tuple[int, int], dict],
                 decided_by: dict):
        self.store, self.records = store, records
        self.by_index = {p.index: p for p in problems}
        self.by_id = {p.problem_id: p for p in problems}
        self.decided_by_sha256 = json_sha256(decided_by)

    def identity(self, index: int, sample: int) -> dict:
        """Identity fields of the result on sample ``sample`` of the problem at row ``index``."""
        problem = self.by_index[index]
        return {
            "problem_id": problem.problem_id,
            "prompt_sha256": problem.prompt_sha256,
            "answer_sha256": text_sha256(problem.ground_truth),
            "response_sha256": text_sha256(self.records[index, sample]["response"]),
            "decided_by_sha256": self.decided_by_sha256,
        }

    def load(self) -> dict[tuple[int, int], dict]:
        """Valid cached results keyed by ``(problem.index, sample)`` of the current data."""
        check_cache_records(self.store)
        results = {}
        for _, record in self.store.read():
            problem = self.by_id.get(record["problem_id"])
            key = None if problem is None else (problem.index, record["sample"])
            if key in self.records and all(record.get(k) == v for k, v in self.identity(*key).items()):
                results[key] = dict(record, problem_index=problem.index)
        return results

    def append(self, results: Sequence[dict]) -> None:
        """Append results (keys ``problem_index``/``sample`` of the current data) with their identity."""
        self.store.append([{**r, **self.identity(r["problem_index"], r["sample"])} for r in results])


def check_cache_records(store: JsonlStore) -> None:
    """Raise :class:`ResumeMismatch` on the first cached result without problem identity (written
    by an older version), naming the file and line."""
    for line, record in store.read():
        if not isinstance(record.get("problem_id"), str) or "answer_sha256" not in record:
            raise ResumeMismatch(
                f"{store.path}: line {line}: cached result has no problem identity (written by an older "
                "version). Evaluate into a new --out folder (this one was not changed)"
            )
