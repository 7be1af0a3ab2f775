"""Resumable sampling of N completions per problem, appended to a JSONL file as they come.

One line per (problem, sample), flushed and fsynced after every batch. A rerun reads the file,
skips every (problem, sample) already there and generates only the rest; a truncated last line
(a crash mid-write) is dropped and cut off the file before appending. Each sample has its own
seed, derived from (base seed, benchmark, decoding, problem id, sample index), so a resumed run
produces exactly what an uninterrupted one would.

Record schema (one JSON object per line)::

    {"problem_index": int, "problem_id": str, "sample": int, "seed": int,
     "response": str, "num_tokens": int, "finish_reason": "stop" | "length"}
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
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
    """

    index: int
    problem_id: str
    messages: tuple
    ground_truth: str
    question: str


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
        """Records on disk, repairing a truncated last line (it is removed from the file).

        Raises:
            ValueError: a line other than the last is not valid JSON or lacks the key fields
                (names the file and the 1-based line).
        """
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline
        records: dict[tuple[int, int], dict] = {}
        good_bytes = 0
        for number, line in enumerate(complete, start=1):
            record = self._parse(line)
            if record is None:
                if number == len(complete) and not tail.strip():
                    tail = line  # the last line itself is corrupt: treat it as the truncated one
                    break
                raise ValueError(f"{self.path}: line {number} is not a valid record; fix or delete the file")
            records[(record["problem_index"], record["sample"])] = record
            good_bytes += len(line) + 1
        if tail.strip():
            record = self._parse(tail)
            if record is not None:  # complete record that only lacks its newline
                records[(record["problem_index"], record["sample"])] = record
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
    Returns:
        All records, keyed by ``(problem_index, sample)``.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    done = store.load()
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
