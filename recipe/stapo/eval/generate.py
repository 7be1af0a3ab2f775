"""Resumable sampling of N completions per problem, appended to a JSONL file as they come.

One line per (problem, sample), flushed and fsynced after every batch. A rerun reads the file,
skips every (problem, sample) already there and generates only the rest; a truncated last line
(a crash mid-write) is dropped and cut off the file before appending. Each sample has its own
seed, derived from (base seed, benchmark, decoding, problem id, sample index), so a resumed run
produces exactly what an uninterrupted one would.

Saved samples belong to problems by identity, never by row position: every record carries the
problem's id and ``prompt_sha256`` (hash of its prompt messages, :func:`messages_sha256`). On a
resume each saved record is matched to the problem with that id in the current benchmark data;
a record whose problem is missing from the data, whose prompt differs, whose seed is not the one
its (benchmark, decoding, problem, sample) gets, or which has no identity at all (written by an
older version) stops the run with a :class:`ResumeMismatch` naming the file, line, benchmark and
problem -- nothing is generated and nothing on disk changes. Data with the same problems in
another order, or with problems added, resumes correctly (only the missing samples are made).

Record schema (one JSON object per line)::

    {"problem_index": int, "problem_id": str, "prompt_sha256": str, "sample": int, "seed": int,
     "response": str, "num_tokens": int, "finish_reason": "stop" | "length"}

``problem_index`` is the row at the time the record was written (informative only).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from tqdm import tqdm

from recipe.stapo.eval.backends import GenerationBackend, SamplingConfig


@dataclass(frozen=True)
class Problem:
    """One benchmark problem.

    Attributes:
        index: position in the benchmark file (0-based).
        problem_id: id from the source dataset.
        messages: chat messages of the prompt (verl ``prompt`` column).
        ground_truth: reference answer.
        question: the user message content (for an LLM verifier).
        prompt_sha256: hash of ``messages`` (computed; the problem's identity with ``problem_id``).
    """

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


def messages_sha256(messages: Sequence[dict]) -> str:
    """Hex sha256 of chat messages (canonical JSON: keys sorted, list order kept)."""
    return text_sha256(json.dumps([dict(m) for m in messages], sort_keys=True, ensure_ascii=False))


class ResumeMismatch(ValueError):
    """Saved records in an output folder do not belong to the benchmark data of this run."""


NEW_OUT_HINT = (
    "Use the --benchmarks-dir this --out folder was made with, or evaluate into a new --out folder "
    "(nothing in this one was changed)"
)


def sample_seed(base_seed: int, benchmark: str, decoding: str, problem_id: str, sample: int) -> int:
    """Deterministic 31-bit seed of one sample (stable across runs, platforms and batchings)."""
    key = f"{base_seed}|{benchmark}|{decoding}|{problem_id}|{sample}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


class JsonlStore:
    """Append-only JSONL file of records keyed by ``(problem_index, sample)``.

    Args:
        path: the JSONL file (created on first append).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict[tuple[int, int], dict]:
        """Records on disk keyed by ``(problem_index, sample)`` (the last one wins); see :meth:`read`."""
        return {(record["problem_index"], record["sample"]): record for _, record in self.read()}

    def read(self) -> list[tuple[int, dict]]:
        """``(1-based line, record)`` of every record on disk, in file order, repairing a
        truncated last line (it is removed from the file).

        Raises:
            ValueError: a line other than the last is not valid JSON or lacks the key fields
                (names the file and the 1-based line).
        """
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
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
                raise ValueError(f"{self.path}: line {number} is not a valid record; fix or delete the file")
            records.append((number, record))
            good_bytes += len(line) + 1
        if tail.strip():
            record = self._parse(tail)
            if record is not None:  # complete record that only lacks its newline
                records.append((len(complete) + 1, record))
                with open(self.path, "ab") as handle:
                    handle.write(b"\n")
                return records
        if good_bytes != len(raw):
            with open(self.path, "r+b") as handle:
                handle.truncate(good_bytes)
        return records

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
        """Append records, one line each, then flush and fsync."""
        if not records:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def saved_samples(
    store: JsonlStore,
    catalog: Sequence[Problem],
    benchmark: str,
    decoding: str,
    base_seed: int,
    data_label: str = "the benchmark data",
) -> dict[tuple[str, int], dict]:
    """Saved records of ``store`` keyed by ``(problem_id, sample)``, each checked against ``catalog``.

    Args:
        store: the generations file of (benchmark, decoding).
        catalog: every problem of the benchmark's data (not only those of a ``--limit``).
        benchmark, decoding, base_seed: what the records' seeds must derive from.
        data_label: how error messages name the data (e.g. its parquet path).
    Raises:
        ResumeMismatch: the first record (file order) without identity fields, for a problem id
            not in ``catalog``, for another prompt than the catalog's problem of that id, or with
            another seed; names file, line, benchmark and problem.
    """
    by_id = {p.problem_id: p for p in catalog}
    saved: dict[tuple[str, int], dict] = {}
    for line, record in store.read():
        where = f"{store.path}: line {line}: benchmark {benchmark}"
        if not isinstance(record.get("problem_id"), str) or not isinstance(record.get("prompt_sha256"), str):
            raise ResumeMismatch(
                f"{where}: saved sample has no problem identity (problem_id and prompt_sha256; written by an "
                f"older version), so it cannot be checked against {data_label}. Evaluate into a new --out "
                "folder (this one was not changed)"
            )
        problem, sample = by_id.get(record["problem_id"]), record["sample"]
        if problem is None:
            raise ResumeMismatch(
                f"{where}: saved samples are for problem {record['problem_id']!r}, which is not in {data_label}: "
                f"this folder was generated from other data. {NEW_OUT_HINT}"
            )
        if problem.prompt_sha256 != record["prompt_sha256"]:
            raise ResumeMismatch(
                f"{where}: problem {problem.problem_id!r} (row {problem.index} of {data_label}) has another prompt "
                f"than the one its saved samples were generated for: this folder was generated from other data. "
                f"{NEW_OUT_HINT}"
            )
        expected = sample_seed(base_seed, benchmark, decoding, problem.problem_id, sample)
        if record.get("seed") != expected:
            raise ResumeMismatch(
                f"{where}: problem {problem.problem_id!r} sample {sample} has seed {record.get('seed')!r}, not "
                f"{expected} ({benchmark}/{decoding}, seed {base_seed}): the file belongs to another benchmark, "
                f"decoding or seed. {NEW_OUT_HINT}"
            )
        saved[problem.problem_id, sample] = record
    return saved


def _pending(problems: Sequence[Problem], n_samples: int, done: dict) -> Iterator[tuple[Problem, int]]:
    for problem in problems:
        for sample in range(n_samples):
            if (problem.index, sample) not in done:
                yield problem, sample


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def generate_samples(
    backend: GenerationBackend,
    problems: Sequence[Problem],
    n_samples: int,
    sampling: SamplingConfig,
    store: JsonlStore,
    benchmark: str,
    decoding: str,
    base_seed: int = 0,
    batch_size: int = 256,
    after_batch: Optional[Callable[[list[dict]], None]] = None,
    catalog: Optional[Sequence[Problem]] = None,
    data_label: str = "the benchmark data",
) -> dict[tuple[int, int], dict]:
    """Generate every missing (problem, sample) and append it to ``store``.

    Args:
        backend: generation backend.
        problems: the benchmark's problems.
        n_samples: samples per problem (N of mean@N).
        sampling: decoding settings.
        store: where records go (and are resumed from).
        benchmark, decoding: names used for seeds and progress bars.
        base_seed: run seed.
        batch_size: (problem, sample) requests per backend call; each batch is on disk before the
            next starts.
        after_batch: called with each written batch (progress hooks; tests interrupt here).
        catalog: every problem of the benchmark data, against which saved records are checked
            (default ``problems``; pass the whole file when ``problems`` is a ``--limit`` prefix).
        data_label: how error messages name the data.
    Returns:
        The records of ``problems`` x ``range(n_samples)``, keyed by ``(problem.index, sample)``
        with ``problem.index`` the problem's row in the current data (saved records are matched by
        problem id and prompt hash, see the module docstring).
    Raises:
        ResumeMismatch: a saved record does not belong to the data (see :func:`saved_samples`).
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    saved = saved_samples(store, catalog if catalog is not None else problems, benchmark, decoding, base_seed, data_label)
    done = {
        (p.index, s): dict(saved[p.problem_id, s], problem_index=p.index)
        for p in problems
        for s in range(n_samples)
        if (p.problem_id, s) in saved
    }
    todo = list(_pending(problems, n_samples, done))
    total = len(problems) * n_samples
    with tqdm(total=total, initial=total - len(todo), desc=f"{benchmark}/{decoding}", unit="sample") as bar:
        for batch in _chunks(todo, batch_size):
            seeds = [sample_seed(base_seed, benchmark, decoding, p.problem_id, s) for p, s in batch]
            completions = backend.generate([backend.render(p.messages) for p, _ in batch], seeds, sampling)
            records = [
                {
                    "problem_index": p.index,
                    "problem_id": p.problem_id,
                    "prompt_sha256": p.prompt_sha256,
                    "sample": s,
                    "seed": seed,
                    "response": c.text,
                    "num_tokens": c.num_tokens,
                    "finish_reason": c.finish_reason,
                }
                for (p, s), seed, c in zip(batch, seeds, completions)
            ]
            store.append(records)
            done.update({(r["problem_index"], r["sample"]): r for r in records})
            bar.update(len(records))
            if after_batch is not None:
                after_batch(records)
    return done


class VerdictCache:
    """The verifier's verdict cache seen through problem identity (what ``apply_verifier`` reads).

    On disk a :class:`JsonlStore` of ``{"problem_index", "sample", "verifier_correct"}`` records,
    each also carrying ``problem_id``, ``prompt_sha256``, ``answer_sha256`` (the reference answer)
    and ``response_sha256`` (the judged response): a verdict is reused only for the same problem,
    reference answer and response, whatever the problem's row is now; a stale one (e.g. the
    reference answer was corrected) is ignored, so that sample is judged again.

    Args:
        store: the cache file.
        problems: the problems graded in this run.
        records: their generation records, keyed by ``(problem.index, sample)``.
    """

    def __init__(self, store: JsonlStore, problems: Sequence[Problem], records: dict[tuple[int, int], dict]):
        self.store, self.records = store, records
        self.by_index = {p.index: p for p in problems}
        self.by_id = {p.problem_id: p for p in problems}

    def identity(self, index: int, sample: int) -> dict:
        """Identity fields of the verdict on sample ``sample`` of the problem at row ``index``."""
        problem = self.by_index[index]
        return {
            "problem_id": problem.problem_id,
            "prompt_sha256": problem.prompt_sha256,
            "answer_sha256": text_sha256(problem.ground_truth),
            "response_sha256": text_sha256(self.records[index, sample]["response"]),
        }

    def load(self) -> dict[tuple[int, int], dict]:
        """Valid cached verdicts keyed by ``(problem.index, sample)`` of the current data.

        Raises:
            ResumeMismatch: a verdict without identity fields (written by an older version).
        """
        verdicts = {}
        for line, record in self.store.read():
            if not isinstance(record.get("problem_id"), str) or "answer_sha256" not in record:
                raise ResumeMismatch(
                    f"{self.store.path}: line {line}: cached verdict has no problem identity (written by an older "
                    "version). Evaluate into a new --out folder (this one was not changed)"
                )
            problem = self.by_id.get(record["problem_id"])
            key = None if problem is None else (problem.index, record["sample"])
            if key in self.records and all(record.get(k) == v for k, v in self.identity(*key).items()):
                verdicts[key] = dict(record, problem_index=problem.index)
        return verdicts

    def append(self, records: Sequence[dict]) -> None:
        """Append verdicts (keys ``problem_index``/``sample`` of the current data) with their identity."""
        self.store.append([{**r, **self.identity(r["problem_index"], r["sample"])} for r in records])
