"""What an evaluation reports: the grading it used (:func:`grading_info`), every block graded into
``summary.json`` (:func:`summarise`, schema in docs/eval.md) and its Markdown table (:func:`summary_markdown`)."""

from __future__ import annotations

import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from recipe.stapo.data.prepare import BENCHMARK_SPECS, prompt_form
from recipe.stapo.eval.generate import DECODINGS, Problem, ResultCache, json_sha256, problems_sha256, store
from recipe.stapo.eval.grade import apply_verifier, grade_answers, grader_identity, mean_at_n
from recipe.stapo.eval.protocols import DEFAULT_PROTOCOL, get_protocol
from recipe.stapo.eval.tables import markdown_table
from recipe.stapo.eval.verifier import DEFAULT_PROMPT_NAME, AnswerVerifier, CompassVerifier

BENCHMARKS: tuple[str, ...] = tuple(BENCHMARK_SPECS)
"""Benchmark names in the paper's column order."""


@dataclass
class Block:
    """One (decoding, benchmark) to summarise: its problems, N and the saved samples."""

    decoding: str
    bench: str
    n_samples: int
    limit: Optional[int]
    problems: list[Problem]
    current: bool  # asked for by this invocation (else evaluated earlier in this folder)


def benchmark_order(names) -> list[str]:
    """``names`` with the paper's six first, in Table 2's column order, then any others sorted."""
    return [b for b in BENCHMARKS if b in names] + sorted(b for b in names if b not in BENCHMARKS)


def block_prompt_form(problems: Sequence[Problem]) -> str:
    """The prompt form of a benchmark's problems (:func:`recipe.stapo.data.prepare.prompt_form`:
    ``justrl-eval``, JustRL's evaluation prompt and Table 2's, ``train``, or ``custom``), or
    ``mixed`` when its problems do not share one."""
    return _shared({prompt_form(p.question) for p in problems})


def grading_info(verifier: Optional[AnswerVerifier], timeout_s: float, protocol: str = DEFAULT_PROTOCOL) -> dict:
    """The ``grading`` block of a summary: the protocol's name, label (``rule-only`` or
    ``rule+verifier``), both identities, a description, and ``key``, a hash of both identities."""
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


def summarise(config, blocks: Sequence[Block], records: dict, verifier: Optional[AnswerVerifier], out: Path) -> dict:
    """Grade every block of ``config`` (the run's :class:`~recipe.stapo.eval.run_eval.EvalConfig`) and build
    the summary dict (schema in docs/eval.md)."""
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
            grader_cache = ResultCache(store(out, "grades", block.bench, decoding), probs, recs, grading["grader"])
            graded = grade_answers(recs, probs, config.reward_timeout_s, desc=f"grade {block.bench}/{decoding}",
                                   cache=grader_cache, grader=grading["grader"]["grader"])
            judged_now = 0
            if verifier is not None:
                cache = ResultCache(store(out, "verifier", block.bench, decoding), probs, recs, grading["verifier"])
                graded, judged_now = apply_verifier(graded, recs, probs, verifier, cache)
            used = [recs[p.index, s] for p in probs for s in range(n)]
            failures = [g for g in graded.values() if not g.grader_correct]
            used_grades = [graded[p.index, s] for p in probs for s in range(n)]
            mean, standard_error = mean_at_n(graded, probs, n)
            benches[block.bench] = {
                "mean_at_n": mean,
                "mean_at_n_se": standard_error,
                "grader_mean_at_n": mean_at_n(graded, probs, n, use_verifier=False)[0],
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
    label = grading.get("label", "")
    gradings = [(label, "mean_at_n", "avg")] + ([("rule-only", "grader_mean_at_n", "grader_avg")] if label == "rule+verifier" else [])
    rows = [[f"{name} ({dec['temperature']}/{dec['top_p']})", row_label,
             *(f"{dec['benchmarks'][b][key]:.2f}" if b in dec["benchmarks"] else "-" for b in benches), f"{dec[avg]:.2f}"]
            for name, dec in summary["decodings"].items() for row_label, key, avg in gradings]
    lines = [f"# {summary['model']}", "", f"Grading: {grading.get('description', summary.get('verifier'))}",
             f"Prompt form: {summary.get('prompt_form', 'unrecorded')}", "",
             markdown_table(["decoding", "grading", *benches, "Avg"], rows)]
    ungraded = sum(dec.get("ungraded", 0) for dec in summary["decodings"].values())
    if ungraded:
        lines += ["", f"**Not finished: {ungraded} answers are ungraded** (their check could not run); rerun the same "
                      "command to grade them."]
    return "\n".join(lines) + "\n"
