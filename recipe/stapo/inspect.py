"""Inspect the spurious tokens S2T saw during training: ``report.md`` and ``report.html``.

CLI::

    python -m recipe.stapo.inspect RUN_DIR [--out DIR] [--top K] [--seed S]

Reads the token dump of ``RUN_DIR`` (``s2t_tokens/step_*.jsonl``, :mod:`stapo_core.token_records`) and
writes both reports into ``DIR`` (default ``RUN_DIR/inspect``); docs/inspect.md describes each section.
The HTML file is self-contained (inline CSS, no script); every dumped string is HTML-escaped.
"""

from __future__ import annotations

import argparse
import html
import random
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from recipe.stapo.eval.tables import markdown_table
from recipe.stapo.plots import stopped_message
from stapo_core.fileio import atomic_write, check_output_folder, cli_path
from stapo_core.token_records import QUADRANTS, TOKEN_DUMP_DIR, read_dump

QUADRANT_LABELS = {
    "lowp_lowh": "low p, low H (spurious: what STAPO silences)",
    "lowp_highh": "low p, high H (exploratory: what STAPO keeps)",
    "highp_lowh": "high p, low H (confident)",
    "highp_highh": "high p, high H",
}


# --------------------------------------------------------------------------------------------
# aggregation (pure functions over validated records)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSummary:
    step: int
    methods: tuple
    responses: int
    positive_responses: int
    tokens: int
    candidates: int
    silenced: int
    tau_p: tuple
    tau_h_min: Optional[float]
    tau_h_max: Optional[float]


def step_summaries(tokens: list, responses: list) -> list[StepSummary]:
    """One :class:`StepSummary` per step seen in either kind of record, ascending."""
    by_step_tok, by_step_resp = defaultdict(list), defaultdict(list)
    for t in tokens:
        by_step_tok[t["step"]].append(t)
    for r in responses:
        by_step_resp[r["step"]].append(r)
    out = []
    for step in sorted(set(by_step_tok) | set(by_step_resp)):
        toks, resps = by_step_tok[step], by_step_resp[step]
        taus = [r["tau_h"] for r in resps if r["tau_h"] is not None]
        out.append(StepSummary(
            step=step, methods=tuple(sorted({x["method"] for x in toks + resps})), responses=len(resps),
            positive_responses=sum(r["advantage"] > 0 for r in resps), tokens=sum(r["n_tokens"] for r in resps),
            candidates=sum(t["candidate"] for t in toks), silenced=sum(t["silenced"] for t in toks),
            tau_p=tuple(sorted({r["tau_p"] for r in resps})),
            tau_h_min=min(taus) if taus else None, tau_h_max=max(taus) if taus else None,
        ))
    return out


def sample_tokens(tokens: list, k: int, seed: int = 0) -> tuple[list, list]:
    """``(silenced, kept candidates)``: up to ``k`` of each, drawn without replacement with ``seed``,
    in (step, uid, response_index, position) order."""
    def draw(pool):
        chosen = random.Random(seed).sample(pool, min(k, len(pool)))
        return sorted(chosen, key=lambda t: (t["step"], t["uid"], t["response_index"], t["position"]))

    return (draw([t for t in tokens if t["silenced"]]),
            draw([t for t in tokens if t["candidate"] and not t["silenced"]]))


@dataclass(frozen=True)
class TokenFrequency:
    token: str
    token_id: int
    count: int
    mean_prob: float
    mean_entropy: float


def frequent_silenced(tokens: list, k: int) -> list[TokenFrequency]:
    """The ``k`` most frequent silenced token ids (ties: smaller id first)."""
    groups: dict[int, list] = defaultdict(list)
    for t in tokens:
        if t["silenced"]:
            groups[t["token_id"]].append(t)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:k]
    return [TokenFrequency(token=g[0]["token"], token_id=tid, count=len(g),
                           mean_prob=sum(t["prob"] for t in g) / len(g),
                           mean_entropy=sum(t["entropy"] for t in g) / len(g)) for tid, g in ranked]


@dataclass(frozen=True)
class QuadrantRow:
    """One quadrant over the positive-advantage responses: token count, share, mean gradient norm,
    and the mean ``dlogp`` over the tokens of the responses that carry it (None: none does),
    with ``dlogp_count`` such tokens."""

    name: str
    count: int
    share: float
    mean_grad_norm: float
    mean_dlogp: Optional[float] = None
    dlogp_count: int = 0


def quadrant_table(responses: list) -> list[QuadrantRow]:
    """The four quadrants summed over response records with advantage > 0 (in :data:`QUADRANTS` order).

    share = count / total count (0 when there is none); mean_grad_norm = grad_norm_sum / count
    (0 for an empty quadrant); mean_dlogp = dlogp_sum / count over the records that measured it
    (None when none did, or their quadrant is empty).
    """
    counts = {q: 0 for q in QUADRANTS}
    sums = {q: 0.0 for q in QUADRANTS}
    dlogp_sums, dlogp_counts = {q: 0.0 for q in QUADRANTS}, {q: 0 for q in QUADRANTS}
    for r in responses:
        if r["advantage"] > 0:
            for q in QUADRANTS:
                stats = r["quadrants"][q]
                counts[q] += stats["count"]
                sums[q] += stats["grad_norm_sum"]
                if stats.get("dlogp_sum") is not None:
                    dlogp_sums[q] += stats["dlogp_sum"]
                    dlogp_counts[q] += stats["count"]
    total = sum(counts.values())
    return [QuadrantRow(q, counts[q], counts[q] / total if total else 0.0, sums[q] / counts[q] if counts[q] else 0.0,
                        dlogp_sums[q] / dlogp_counts[q] if dlogp_counts[q] else None, dlogp_counts[q])
            for q in QUADRANTS]


@dataclass(frozen=True)
class EffectRow:
    """The mean ``dlogp`` of one set of dumped candidate tokens (None: no token of the set has one)."""

    name: str
    count: int
    mean_dlogp: Optional[float]


#: the candidate sets of :func:`candidate_effects`
EFFECT_LABELS = {
    "silenced": "silenced (no gradient in the update)",
    "kept": "kept candidates (in the update)",
}


def candidate_effects(tokens: list) -> list[EffectRow]:
    """Mean change of the dumped candidates' log-probability across their update: silenced ones and
    kept ones (records without ``dlogp`` are left out)."""
    rows = []
    for name, wanted in (("silenced", True), ("kept", False)):
        values = [t["dlogp"] for t in tokens if t.get("dlogp") is not None and t["silenced"] is wanted]
        rows.append(EffectRow(name, len(values), sum(values) / len(values) if values else None))
    return rows


@dataclass(frozen=True)
class Report:
    run_dir: str
    steps: list
    silenced_sample: list
    kept_sample: list
    frequent: list
    quadrants: list
    effects: list
    n_tokens: int
    n_responses: int
    skipped: tuple = ()
    notes: tuple = ()


def _read(run_dir: str | Path):
    """:func:`read_dump`, with a damaged step file named with what to do, and the last lines a cut copy
    left (read_dump's warnings) listed as skipped: ``(dump, skipped)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dump = read_dump(run_dir)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise DamagedDumpError(f"{exc}: a step file that cannot be read (a folder in its place, or its "
                                   f"permissions); move it out of {TOKEN_DUMP_DIR}/ to inspect the other steps") from None
        except ValueError as exc:
            raise DamagedDumpError(f"{exc}. The token dump writes each step file whole, so this one was damaged or "
                                   f"written by something else (another program, another version of the recipe): "
                                   f"move it out of {TOKEN_DUMP_DIR}/ to inspect the other steps") from None
    cut = []
    for w in caught:
        path, _, reason = str(w.message).partition(": ")
        line = re.search(r"truncated last line (\d+)", reason)
        if line:
            cut.append((path, f"last line {line.group(1)} cut short (a copy or write that did not finish): left out, "
                              "the file's other records are read"))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return dump, list(dump.skipped) + cut


def build_report(run_dir: str | Path, top: int = 20, seed: int = 0) -> Report:
    """Read the dump of ``run_dir`` and aggregate it (FileNotFoundError without a dump,
    :class:`DamagedDumpError` for a step file the dump did not write as it is)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top={top!r} is invalid: expected a positive integer")
    dump, skipped = _read(run_dir)
    tokens, responses = dump.tokens, dump.responses
    for path, reason in skipped:
        print(f"warning: skipped {path}: {reason}", file=sys.stderr)
    if not tokens and not responses:
        raise NoRecordsError(f"{run_dir}: the dump holds no usable record ({len(skipped)} file(s) skipped: "
                             + "; ".join(f"{p}: {r}" for p, r in skipped) + ")")
    notes = _mixed_methods_note(tokens + responses)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    silenced, kept = sample_tokens(tokens, top, seed)
    return Report(run_dir=str(run_dir), steps=step_summaries(tokens, responses), silenced_sample=silenced,
                  kept_sample=kept, frequent=frequent_silenced(tokens, top), quadrants=quadrant_table(responses),
                  effects=candidate_effects(tokens), n_tokens=len(tokens), n_responses=len(responses),
                  skipped=tuple(skipped), notes=tuple(notes))


def _mixed_methods_note(records: list) -> list[str]:
    """A note when the records come from more than one method (a run folder that another run's dump
    went to as well): the samples and the taxonomy pool them."""
    steps_of: dict = defaultdict(set)
    for r in records:
        steps_of[r["method"]].add(r["step"])
    if len(steps_of) < 2:
        return []
    listed = "; ".join(f"{m}: steps {', '.join(map(str, sorted(s)[:8]))}{' ...' if len(s) > 8 else ''}"
                       for m, s in sorted(steps_of.items()))
    return [f"the dump holds records of {len(steps_of)} methods ({listed}): the samples, the frequent tokens and the "
            "taxonomy pool them; give each run its own recipe.token_dump.dir to inspect one method"]


class NoRecordsError(ValueError):
    """The dump exists but holds no usable record."""


class DamagedDumpError(ValueError):
    """A step file of the dump that the dump did not write as it is (the message names the file, the
    line and what to do)."""


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


def _num(x: Optional[float], digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _tau_range(s: StepSummary) -> str:
    if s.tau_h_min is None:
        return "-"
    return _num(s.tau_h_min) if s.tau_h_min == s.tau_h_max else f"{_num(s.tau_h_min)} .. {_num(s.tau_h_max)}"


def _top5_text(t: dict) -> str:
    return ", ".join(f"{tok!r} {p:.3g}" for tok, p in t["top5"])


def _step_rows(report: Report) -> list[list[str]]:
    return [[str(s.step), ", ".join(s.methods), str(s.responses), str(s.positive_responses), str(s.tokens),
             str(s.candidates), str(s.silenced), str(s.candidates - s.silenced), ", ".join(map(_num, s.tau_p)) or "-",
             _tau_range(s)] for s in report.steps]


STEP_HEADER = ["step", "method", "responses", "A>0", "tokens", "candidates", "silenced", "kept cand.", "tau_p",
               "tau_h"]
FREQ_HEADER = ["token", "id", "count", "mean p", "mean H"]
QUAD_HEADER = ["quadrant", "meaning", "count", "share", "mean grad norm", "mean dlogp (update)"]
EFFECT_HEADER = ["candidates", "count", "mean dlogp (update)"]
SAMPLE_HEADER = ["step", "response", "pos", "context", "p", "H", "A", "grad norm", "dlogp", "top-5"]
#: what dlogp is, in both reports
DLOGP_NOTE = ("dlogp: the change of the token's log-probability across the update of its mini-batch "
              "(log p after the update - log p before it, same forward).")


def _md_escape(text: str) -> str:
    """Text safe inside a Markdown table cell: HTML-escaped, pipes and backslashes escaped, newlines shown."""
    text = html.escape(text, quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("`", "\\`").replace("*", "\\*").replace("_", "\\_")


def _md_sample_rows(sample: list) -> list[list[str]]:
    return [[str(t["step"]), _md_escape(f"{t['uid']}#{t['response_index']}"), str(t["position"]),
             _md_escape(t["context_before"]) + " **[" + _md_escape(t["token"]) + "]** " + _md_escape(t["context_after"]),
             _num(t["prob"]), _num(t["entropy"]), _num(t["advantage"]), _num(t["grad_norm"]), _num(t.get("dlogp")),
             _md_escape(_top5_text(t))] for t in sample]


def render_markdown(report: Report) -> str:
    """The Markdown report (GitHub-flavoured tables; dumped strings escaped)."""
    parts = [
        f"# S2T spurious-token report\n\nRun: `{report.run_dir}`. {report.n_tokens} token records, "
        f"{report.n_responses} response records.",
        *(["## Notes\n\n" + "\n".join(f"- {_md_escape(n)}" for n in report.notes)] if report.notes else []),
        "## Summary per step\n\n" + markdown_table(STEP_HEADER, _step_rows(report)),
        *(["## Skipped files\n\n" + "\n".join(f"- `{p}`: {r}" for p, r in report.skipped)] if report.skipped else []),
        "## Sample of silenced tokens\n\n" + markdown_table(SAMPLE_HEADER, _md_sample_rows(report.silenced_sample)),
        "## Sample of kept candidates\n\n" + markdown_table(SAMPLE_HEADER, _md_sample_rows(report.kept_sample)),
        "## Most frequent silenced tokens\n\n" + markdown_table(FREQ_HEADER, [
            [_md_escape(repr(f.token)), str(f.token_id), str(f.count), _num(f.mean_prob), _num(f.mean_entropy)]
            for f in report.frequent]),
        "## Four-quadrant taxonomy (tokens of positive-advantage responses)\n\n"
        "Low p: p < tau_p. Low H: H < tau_h of the step (or the response's median entropy when tau_h is "
        f"undefined). Gradient norm: sqrt(1 - 2p + sum p^2) per unit weight. {DLOGP_NOTE}\n\n" + markdown_table(QUAD_HEADER, [
            [q.name, QUADRANT_LABELS[q.name], str(q.count), f"{100 * q.share:.2f}%", _num(q.mean_grad_norm),
             _num(q.mean_dlogp)] for q in report.quadrants]),
        "## Update effect on the dumped candidates\n\n" + markdown_table(EFFECT_HEADER, [
            [EFFECT_LABELS[e.name], str(e.count), _num(e.mean_dlogp)] for e in report.effects]),
    ]
    return "\n\n".join(parts) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 7px; vertical-align: top; text-align: left; }
th { background: #f2f2f2; }
.ctx { font-family: ui-monospace, monospace; white-space: pre-wrap; max-width: 60em; }
.tok { padding: 0 1px; border-radius: 3px; outline: 1px solid #888; }
.silenced { background: #f8b4b4; }
.kept { background: #b4f0bc; }
"""


def _h(text) -> str:
    return html.escape(str(text), quote=True)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    """``rows`` are already-escaped HTML cell contents."""
    head = "".join(f"<th>{_h(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _token_span(t: dict) -> str:
    css = "silenced" if t["silenced"] else "kept"
    tip = (f"p={t['prob']:.4g}  H={t['entropy']:.4g}  A={t['advantage']:.4g}  grad norm={t['grad_norm']:.4g}\n"
           f"top-5: {_top5_text(t)}")
    return (f'<span class="ctx">{_h(t["context_before"])}<span class="tok {css}" title="{_h(tip)}">'
            f'{_h(t["token"])}</span>{_h(t["context_after"])}</span>')


def _html_sample_rows(sample: list) -> list[list[str]]:
    return [[_h(t["step"]), _h(f"{t['uid']}#{t['response_index']}"), _h(t["position"]), _token_span(t),
             _h(_num(t["prob"])), _h(_num(t["entropy"])), _h(_num(t["advantage"])), _h(_num(t["grad_norm"])),
             _h(_num(t.get("dlogp"))), "<br>".join(f"<code>{_h(repr(tok))}</code> {p:.3g}" for tok, p in t["top5"])] for t in sample]


def render_html(report: Report) -> str:
    """The self-contained HTML report (inline CSS, no script, all dumped strings escaped)."""
    sections = [
        *([("Notes", "<ul>" + "".join(f"<li>{_h(n)}</li>" for n in report.notes) + "</ul>")] if report.notes else []),
        ("Summary per step", _html_table(STEP_HEADER, [[_h(c) for c in row] for row in _step_rows(report)])),
        *([("Skipped files", "<ul>" + "".join(f"<li><code>{_h(p)}</code>: {_h(r)}</li>" for p, r in report.skipped)
            + "</ul>")] if report.skipped else []),
        ("Sample of silenced tokens", _html_table(SAMPLE_HEADER, _html_sample_rows(report.silenced_sample))),
        ("Sample of kept candidates", _html_table(SAMPLE_HEADER, _html_sample_rows(report.kept_sample))),
        ("Most frequent silenced tokens", _html_table(FREQ_HEADER, [
            [f"<code>{_h(repr(f.token))}</code>", _h(f.token_id), _h(f.count), _h(_num(f.mean_prob)),
             _h(_num(f.mean_entropy))] for f in report.frequent])),
        ("Four-quadrant taxonomy (tokens of positive-advantage responses)",
         "<p>Low p: p &lt; tau_p. Low H: H &lt; tau_h of the step (or the response's median entropy when tau_h "
         f"is undefined). Gradient norm: sqrt(1 - 2p + &Sigma; p<sup>2</sup>) per unit weight. {_h(DLOGP_NOTE)}</p>"
         + _html_table(QUAD_HEADER, [[_h(q.name), _h(QUADRANT_LABELS[q.name]), _h(q.count),
                                      _h(f"{100 * q.share:.2f}%"), _h(_num(q.mean_grad_norm)), _h(_num(q.mean_dlogp))]
                                     for q in report.quadrants])),
        ("Update effect on the dumped candidates",
         _html_table(EFFECT_HEADER, [[_h(EFFECT_LABELS[e.name]), _h(e.count), _h(_num(e.mean_dlogp))]
                                     for e in report.effects])),
    ]
    body = "".join(f"<h2>{_h(title)}</h2>{content}" for title, content in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>S2T spurious-token report</title>'
            f"<style>{_CSS}</style></head><body><h1>S2T spurious-token report</h1>"
            f"<p>Run: <code>{_h(report.run_dir)}</code>. {report.n_tokens} token records, {report.n_responses} "
            f"response records. Silenced tokens are <span class=\"tok silenced\">red</span>, kept candidates "
            f"<span class=\"tok kept\">green</span>; hover a token for its numbers.</p>{body}</body></html>\n")


def write_report(run_dir: str | Path, out_dir: Optional[str | Path] = None, top: int = 20,
                 seed: int = 0) -> tuple[Path, Path]:
    """Build the report of ``run_dir`` and write ``report.md`` and ``report.html`` to ``out_dir``
    (default ``run_dir/inspect``), each atomically. Returns their paths."""
    report = build_report(run_dir, top=top, seed=seed)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "inspect"
    return (atomic_write(out / "report.md", render_markdown(report)),
            atomic_write(out / "report.html", render_html(report)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="run folder holding s2t_tokens/")
    parser.add_argument("--out", type=cli_path, default=None, help="output folder (default RUN_DIR/inspect)")
    parser.add_argument("--top", type=int, default=20, help="tokens per sample and frequent-token rows (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token samples (default 0)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be a positive integer, got {args.top}")
    stopped = stopped_message(args.run_dir)  # a run the quickstart stopped at its limit: its dump ends there
    try:
        check_output_folder("--out", args.out if args.out is not None else args.run_dir / "inspect")  # before any reading
        paths = write_report(args.run_dir, args.out, top=args.top, seed=args.seed)
    except (NoRecordsError, FileNotFoundError) as exc:  # no usable dump: a stopped run says why instead
        if stopped is not None:
            print(f"error: {args.run_dir}: no token dump to inspect: {stopped}, before the dump's first step",
                  file=sys.stderr)
            return 1
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NoRecordsError) else 2
    except (OSError, ValueError) as exc:  # an OSError's message names its file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if stopped is not None:
        print(f"note: {stopped}; the report covers the steps before the stop", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
