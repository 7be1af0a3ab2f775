"""Table 2 and the headline number, checked against the paper's table (fixture copy of spec 7)."""

import json
import re
from pathlib import Path

import pytest

from recipe.stapo.data import prepare
from recipe.stapo.eval import tables
from recipe.stapo.eval.tables import COLUMNS, headline, inconsistent_rows, load_inputs, parse_markdown_table, render

PAPER = Path(prepare.__file__).parent / "fixtures" / "paper_table2.md"
BASELINES = ("GRPO", "20-Entropy", "JustRL")


def _raw_cells():
    """The fixture parsed independently of tables.py: {(scale, method): [(a, b), ...x7]}."""
    out = {}
    for line in PAPER.read_text().splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 9 and parts[2][0].isdigit():
            out[parts[0], parts[1]] = [tuple(float(x) for x in c.replace("(", " ").replace(")", " ").split()) for c in parts[2:]]
    return out


def test_parse_reads_all_twelve_rows():
    rows = parse_markdown_table(PAPER.read_text())
    raw = _raw_cells()
    assert len(rows) == len(raw) == 12
    for row in rows:
        cells = raw[row.scale, row.method]
        for column, (a, b) in zip((*COLUMNS, "Avg"), cells):
            assert row.value("train", column) == a and row.value("justrl", column) == b


def test_exactly_the_14b_stapo_train_row_is_inconsistent():
    rows = parse_markdown_table(PAPER.read_text())
    bad = inconsistent_rows(rows, tol=0.01)
    assert [(s, m, d) for s, m, d, _, _ in bad] == [("14B", "STAPO", "train")]
    _, _, _, printed, recomputed = bad[0]
    cells = _raw_cells()["14B", "STAPO"]
    assert printed == cells[6][0]
    assert recomputed == pytest.approx(sum(c[0] for c in cells[:6]) / 6)
    assert abs(printed - recomputed) > 0.5  # one cell is off by about 3 points (6 x 0.525)


def _expected_headline(decoding_slot, use_printed):
    raw = _raw_cells()
    gains = []
    for scale in ("1.7B", "8B", "14B"):
        def avg(method):
            cells = raw[scale, method]
            return cells[6][decoding_slot] if use_printed else sum(c[decoding_slot] for c in cells[:6]) / 6

        best = max(avg(m) for m in BASELINES)
        gains.append((avg("STAPO") - best) / best * 100)
    return sum(gains) / len(gains)


def test_headline_reproduces_the_paper_with_printed_averages():
    rows = parse_markdown_table(PAPER.read_text())
    train, train_gains = headline(rows, "train")
    justrl, _ = headline(rows, "justrl")
    assert train == pytest.approx(_expected_headline(0, True), abs=1e-9)
    assert justrl == pytest.approx(_expected_headline(1, True), abs=1e-9)
    # the paper's +7.13% comes from the printed Avg column ...
    assert abs(train - 7.13) < 0.01
    # ... recomputed averages (with the inconsistent 14B cell) would give +7.41%
    recomputed, _ = headline(rows, "train", printed=False)
    assert abs(recomputed - 7.13) > 0.25 and recomputed == pytest.approx(_expected_headline(0, False))
    # 0.7/0.9: the table gives +3.71% whichever averages are used; the paper prints +3.69%
    assert abs(justrl - 3.71) < 0.01
    assert headline(rows, "justrl", printed=False)[0] == pytest.approx(3.715, abs=0.01)
    assert [g.best_method for g in train_gains] == ["20-Entropy"] * 3


def test_render_bolds_best_per_column_and_scale():
    rows = parse_markdown_table(PAPER.read_text())
    md = render(rows, "markdown")
    line = next(l for l in md.splitlines() if l.startswith("| 1.7B | STAPO"))
    assert "**17.40** (**16.04**)" in line and "28.22 (29.42)" in line  # GRPO has the best Minerva
    grpo = next(l for l in md.splitlines() if l.startswith("| 1.7B | GRPO"))
    assert "**32.44** (**32.53**)" in grpo
    assert parse_markdown_table(md.replace("**", ""))[0].values == rows[0].values  # round trip
    latex = render(rows, "latex")
    assert "\\textbf{17.40} (\\textbf{16.04})" in latex and latex.count("\\midrule") == 3


def _summary(scale, method, train, justrl):
    names = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
    block = lambda vals: {"benchmarks": {n: {"mean_at_n": v} for n, v in zip(names, vals)}}  # noqa: E731
    return {"scale": scale, "method": method, "prompt_form": "justrl-eval",
            "decodings": {"train": block(train), "justrl": block(justrl)}}


def test_summaries_build_the_table_and_headline(tmp_path):
    paths = []
    specs = [("1.7B", "JustRL", 10.0, 20.0), ("1.7B", "STAPO", 12.0, 21.0), ("8B", "JustRL", 40.0, 50.0), ("8B", "STAPO", 50.0, 50.0)]
    for scale, method, a, b in specs:
        path = tmp_path / f"{scale}_{method}.json"
        path.write_text(json.dumps(_summary(scale, method, [a] * 6, [b] * 6)))
        paths.append(str(path))
    rows = load_inputs(paths)
    assert headline(rows, "train")[0] == pytest.approx((20.0 + 25.0) / 2)
    assert headline(rows, "justrl")[0] == pytest.approx((5.0 + 0.0) / 2)
    out = tmp_path / "table.md"
    assert tables.main(paths + ["--out", str(out)]) == 0
    assert "+22.50%" in out.read_text()
    # relabelling and errors
    unlabeled = tmp_path / "u.json"
    unlabeled.write_text(json.dumps(_summary(None, None, [10.0] * 6, [10.0] * 6)))
    with pytest.raises(ValueError, match="SCALE:METHOD"):
        load_inputs([str(unlabeled)])
    assert load_inputs([f"14B:GRPO={unlabeled}"])[0].method == "GRPO"
    with pytest.raises(ValueError, match="duplicate row"):
        load_inputs([paths[0], paths[0]])
    assert tables.main([str(tmp_path / "missing.json")]) == 2


def test_bad_cell_is_named(tmp_path):
    bad = tmp_path / "t.md"
    bad.write_text("| model | method | AIME24 |\n|---|---|---|\n| 8B | X | 1.0 (oops) |\n")
    with pytest.raises(ValueError, match=r"line 3, column AIME24"):
        parse_markdown_table(bad.read_text(), str(bad))


# ----------------------------------------------------------------------------------------------
# partial, incomplete and non-finite inputs: refused, or (--allow-partial) marked and left out
# ----------------------------------------------------------------------------------------------
def _write(tmp_path, name, summary):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(summary))  # json writes float("nan") as NaN, which json.loads reads back
    return str(path)


def _eight_b(tmp_path, grpo):
    """8B: JustRL 40, STAPO 50 (both complete) and a GRPO summary at 45 given by ``grpo``."""
    return [
        _write(tmp_path, "justrl", _summary("8B", "JustRL", [40.0] * 6, [40.0] * 6)),
        _write(tmp_path, "stapo", _summary("8B", "STAPO", [50.0] * 6, [50.0] * 6)),
        _write(tmp_path, "grpo", grpo),
    ]


def _headline_line(text, label):
    return next(l for l in text.splitlines() if l.startswith(f"Headline {label}"))


def test_baseline_missing_a_benchmark_is_refused_or_named(tmp_path, capsys):
    grpo = _summary("8B", "GRPO", [45.0] * 6, [45.0] * 6)
    del grpo["decodings"]["train"]["benchmarks"]["aime25"]
    paths = _eight_b(tmp_path, grpo)
    with pytest.raises(ValueError, match=r"grpo\.json.*AIME25.*--allow-partial"):
        load_inputs(paths)
    assert tables.main(paths) == 2
    assert "AIME25" in capsys.readouterr().err
    rows = load_inputs(paths, allow_partial=True)
    # the strongest complete baseline is JustRL: 50 vs 40 -> +25%, and GRPO is named as left out
    assert headline(rows, "train")[0] == pytest.approx(25.0)
    text = tables.report(rows)
    line = _headline_line(text, "1.0/1.0")
    assert "+25.00%" in line and "left out" in line and "8B GRPO" in line and "AIME25" in line
    grpo_line = next(l for l in text.splitlines() if l.startswith("| 8B | GRPO"))
    assert "†" in grpo_line and "**" not in grpo_line


def test_smoke_summary_with_limit_is_refused_or_marked(tmp_path):
    smoke = _summary("8B", "GRPO", [99.0] * 6, [99.0] * 6)
    smoke["limit"] = 5
    for block in smoke["decodings"].values():
        block["complete"] = False
    paths = _eight_b(tmp_path, smoke)
    with pytest.raises(ValueError, match=r"grpo\.json.*limit=5"):
        load_inputs(paths)
    out = tmp_path / "t.md"
    assert tables.main(paths + ["--allow-partial", "--out", str(out)]) == 0
    text = out.read_text()
    for label in ("1.0/1.0", "0.7/0.9"):  # the smoke row is not the "strongest baseline"
        line = _headline_line(text, label)
        assert "+25.00%" in line and "8B GRPO" in line and "limit=5" in line
    assert "**99.00**" not in text  # a smoke row is never bolded as the best


def test_summary_marked_incomplete_is_refused(tmp_path):
    grpo = _summary("8B", "GRPO", [45.0] * 6, [45.0] * 6)
    grpo["decodings"]["justrl"]["complete"] = False
    with pytest.raises(ValueError, match=r"grpo\.json.*complete"):
        load_inputs(_eight_b(tmp_path, grpo))


def test_missing_decoding_is_refused(tmp_path):
    grpo = _summary("8B", "GRPO", [45.0] * 6, [45.0] * 6)
    del grpo["decodings"]["justrl"]
    paths = _eight_b(tmp_path, grpo)
    with pytest.raises(ValueError, match=r"grpo\.json.*0\.7/0\.9"):
        load_inputs(paths)
    rows = load_inputs(paths, allow_partial=True)
    # its complete 1.0/1.0 results still count there: 50 vs 45
    assert headline(rows, "train")[0] == pytest.approx(100 * 5 / 45)
    assert headline(rows, "justrl")[0] == pytest.approx(25.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "12.5"])
def test_non_finite_value_is_refused_and_never_printed(tmp_path, bad):
    stapo = _summary("8B", "STAPO", [50.0] * 6, [50.0] * 6)
    stapo["decodings"]["train"]["benchmarks"]["minerva"]["mean_at_n"] = bad
    paths = [
        _write(tmp_path, "justrl", _summary("8B", "JustRL", [40.0] * 6, [40.0] * 6)),
        _write(tmp_path, "stapo", stapo),
    ]
    with pytest.raises(ValueError, match=r"stapo\.json.*Minerva"):
        load_inputs(paths)
    out = tmp_path / "t.md"
    assert tables.main(paths + ["--allow-partial", "--out", str(out)]) == 0
    text = out.read_text()
    assert "nan" not in text.lower() and "inf" not in text.lower()
    assert "n/a" in _headline_line(text, "1.0/1.0") and "8B STAPO" in _headline_line(text, "1.0/1.0")
    assert "+25.00%" in _headline_line(text, "0.7/0.9")


def test_markdown_row_with_a_missing_cell_is_refused(tmp_path):
    table = PAPER.read_text().splitlines()
    index = next(i for i, l in enumerate(table) if l.startswith("| 8B | 20-Entropy"))
    cells = table[index].split("|")
    cells[3] = " - (-) "  # AIME24 cell of the strongest 8B baseline
    table[index] = "|".join(cells)
    path = tmp_path / "t.md"
    path.write_text("\n".join(table) + "\n")
    with pytest.raises(ValueError, match=r"8B 20-Entropy.*AIME24"):
        load_inputs([str(path)])
    rows = load_inputs([str(path)], allow_partial=True)
    assert "8B 20-Entropy" in _headline_line(tables.report(rows), "1.0/1.0")


# ----------------------------------------------------------------------------------------------
# one protocol per table: N, decoding, max_new_tokens, grading; values are percentages
# ----------------------------------------------------------------------------------------------
NAMES = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
N_PAPER = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}


def _run_summary(scale, method, value, grading=None, n=None, max_new_tokens=20480, temps=None):
    """A summary shaped like run_eval's, with its protocol fields."""
    from recipe.stapo.eval.summary import grading_info

    n = {**N_PAPER, **(n or {})}
    temps = temps or {"train": (1.0, 1.0), "justrl": (0.7, 0.9)}
    decodings = {}
    for decoding, (t, p) in temps.items():
        benches = {b: {"mean_at_n": value, "grader_mean_at_n": value - 5.0, "n_samples": n[b], "problems": 30,
                       "limit": None, "data_sha256": "ab" * 32} for b in NAMES}
        decodings[decoding] = {"temperature": t, "top_p": p, "benchmarks": benches, "complete": True}
    return {"scale": scale, "method": method, "max_new_tokens": max_new_tokens, "limit": None, "prompt_form": "justrl-eval",
            "grading": grading if grading is not None else grading_info(None, 5.0), "decodings": decodings}


def _verified():
    from recipe.stapo.eval.verifier import AnswerVerifier

    class Judge(AnswerVerifier):
        name = "judge"

        def verify(self, items):
            return [True] * len(items)

    from recipe.stapo.eval.summary import grading_info

    return grading_info(Judge(), 5.0)


def _eight_b_rows(tmp_path, grpo):
    return [
        _write(tmp_path, "justrl", _run_summary("8B", "JustRL", 40.0)),
        _write(tmp_path, "stapo", _run_summary("8B", "STAPO", 50.0)),
        _write(tmp_path, "grpo", grpo),
    ]


@pytest.mark.parametrize("grpo, field", [
    (dict(n={"aime24": 1}), "N (AIME24, 1.0/1.0) is 1, the table's is 32"),
    (dict(max_new_tokens=8192), "max_new_tokens is 8192, the table's is 20480"),
    (dict(temps={"train": (1.0, 1.0), "justrl": (0.6, 0.95)}), "decoding 0.7/0.9 is temperature 0.6, top-p 0.95"),
])
def test_a_row_of_another_protocol_is_refused_or_marked(tmp_path, grpo, field):
    paths = _eight_b_rows(tmp_path, _run_summary("8B", "GRPO", 45.0, **grpo))
    with pytest.raises(ValueError, match=r"grpo\.json: 8B GRPO: .*" + re.escape(field) + r".*--allow-mixed-protocol"):
        load_inputs(paths)
    out = tmp_path / "t.md"
    assert tables.main(paths + ["--allow-mixed-protocol", "--out", str(out)]) == 0
    text = out.read_text()
    grpo_line = next(l for l in text.splitlines() if l.startswith("| 8B | GRPO"))
    assert "‡" in grpo_line and "**" not in grpo_line
    assert f"‡ 8B GRPO has another protocol: {field}" in text
    line = _headline_line(text, "1.0/1.0")
    assert "+25.00%" in line and "8B GRPO" in line  # vs JustRL; GRPO left out, named


def test_a_benchmark_outside_the_six_gets_its_column_after_avg(tmp_path):
    """The paper's rows and one with another benchmark (the tiny task's ``val``): its column comes after
    Avg, outside it; only that row has a cell there; its protocol (N, problems) is compared too."""
    with_val = _run_summary("8B", "GRPO", 45.0)
    for decoding in with_val["decodings"].values():
        decoding["benchmarks"]["val"] = {"mean_at_n": 60.94, "n_samples": 4, "problems": 64, "limit": None}
    paths = _eight_b_rows(tmp_path, with_val)
    rows = load_inputs(paths)
    text = render(rows)
    assert text.splitlines()[0] == "| model | method | AIME24 | AIME25 | AMC23 | MATH500 | Minerva | Olympiad | Avg | val |"
    grpo = next(line for line in text.splitlines() if line.startswith("| 8B | GRPO"))
    assert grpo.endswith("| 45.00 (45.00) | **60.94** (**60.94**) |")  # Avg of the six, then val (its best)
    stapo = next(line for line in text.splitlines() if line.startswith("| 8B | STAPO"))
    assert stapo.endswith("| **50.00** (**50.00**) | - (-) |")
    assert rows[2].protocol["N (val, 0.7/0.9)"] == 4 and rows[2].protocol["problems (val)"] == "64"


def test_rows_of_one_protocol_pass(tmp_path):
    paths = _eight_b_rows(tmp_path, _run_summary("8B", "GRPO", 45.0))
    rows = load_inputs(paths)
    assert not any(r.protocol_issues for r in rows)
    assert headline(rows, "train")[0] == pytest.approx(100 * 5 / 45)
    assert "Grading: justrl protocol: JustRL's grader only (no verifier)" in tables.report(rows)


def test_rule_only_rows_are_never_mixed_with_verified_ones(tmp_path):
    paths = [
        _write(tmp_path, "justrl", _run_summary("8B", "JustRL", 40.0, grading=_verified())),
        _write(tmp_path, "stapo", _run_summary("8B", "STAPO", 50.0, grading=_verified())),
        _write(tmp_path, "grpo", _run_summary("8B", "GRPO", 45.0)),  # rule-only
    ]
    for flags in ([], ["--allow-mixed-protocol"], ["--allow-mixed-protocol", "--allow-partial"]):
        with pytest.raises(ValueError, match=r"rule-only and verifier-graded rows are never mixed.*grpo\.json: 8B GRPO: rule-only"):
            load_inputs(paths, allow_partial="--allow-partial" in flags, allow_mixed_protocol="--allow-mixed-protocol" in flags)
    # a rule-only table of all three, from the rule-only mean@N each summary carries
    rows = load_inputs(paths, grading="rule-only")
    assert [r.value("train", "AIME24") for r in rows] == [35.0, 45.0, 40.0]
    report = tables.report(rows)
    assert "Grading: rule-only: JustRL's grader, no verifier (not the paper's grading)" in report
    assert headline(rows, "train")[0] == pytest.approx(100 * 5 / 40)


def test_another_verifier_is_another_protocol(tmp_path):
    other = dict(_verified(), key="f" * 64)
    paths = [
        _write(tmp_path, "justrl", _run_summary("8B", "JustRL", 40.0, grading=_verified())),
        _write(tmp_path, "stapo", _run_summary("8B", "STAPO", 50.0, grading=_verified())),
        _write(tmp_path, "grpo", _run_summary("8B", "GRPO", 45.0, grading=other)),
    ]
    with pytest.raises(ValueError, match=r"8B GRPO: grading is rule\+verifier ffffffffffff"):
        load_inputs(paths)
    assert load_inputs(paths, allow_mixed_protocol=True)[2].protocol_issues


@pytest.mark.parametrize("value, message", [
    (5500.0, "AIME24 (1.0/1.0) = 5500 is not a percentage in [0, 100]"),
    (-3.0, "AIME24 (1.0/1.0) = -3 is not a percentage in [0, 100]"),
])
def test_a_value_outside_0_100_is_refused(tmp_path, value, message):
    stapo = _run_summary("8B", "STAPO", 50.0)
    stapo["decodings"]["train"]["benchmarks"]["aime24"]["mean_at_n"] = value
    paths = [_write(tmp_path, "justrl", _run_summary("8B", "JustRL", 40.0)), _write(tmp_path, "stapo", stapo)]
    with pytest.raises(ValueError, match=re.escape(message)):
        load_inputs(paths)
    text = tables.report(load_inputs(paths, allow_partial=True))
    assert "5500" not in text.split("\n\n")[0] and "+1922" not in text  # never in a cell or a headline
    assert "n/a" in _headline_line(text, "1.0/1.0")


def test_fractions_instead_of_percentages_are_refused(tmp_path):
    paths = [_write(tmp_path, "justrl", _run_summary("8B", "JustRL", 0.40)),
             _write(tmp_path, "stapo", _run_summary("8B", "STAPO", 50.0))]
    with pytest.raises(ValueError, match=r"justrl\.json: 8B JustRL: every nonzero value is <= 1: fractions"):
        load_inputs(paths)


def test_a_markdown_row_outside_0_100_is_refused(tmp_path):
    table = PAPER.read_text().replace("| 8B | STAPO | ", "| 8B | STAPO | 5500 (1) | ", 1)
    table = re.sub(r"(\| 8B \| STAPO \| 5500 \(1\) \| )[^|]+\| ", r"\1", table)
    path = tmp_path / "t.md"
    path.write_text(table)
    with pytest.raises(ValueError, match=r"8B STAPO: AIME24 \(1\.0/1\.0\) = 5500 is not a percentage"):
        load_inputs([str(path)])


def test_a_printed_table_beside_run_summaries_is_another_protocol(tmp_path):
    paths = [str(PAPER), _write(tmp_path, "x", _run_summary("32B", "STAPO", 50.0))]
    with pytest.raises(ValueError, match=r"32B STAPO: .*protocol"):
        load_inputs(paths)


def test_summary_from_run_eval_carries_its_protocol(tmp_path):
    """The fields the table compares come from a real run_eval summary."""

    from tests.helpers.eval_models import ScriptedBackend, answers, bench_dir, fixture_rows, scripted_config
    from recipe.stapo.eval.run_eval import run_evaluation

    bench = bench_dir(tmp_path / "bench", fixture_rows())
    summary = run_evaluation(scripted_config(bench, tmp_path / "out", scale="8B", method="STAPO"),
                             lambda: ScriptedBackend(answers(bench)))
    protocol = tables.protocol_of(summary)
    assert protocol["max_new_tokens"] == 6 and protocol["N (AIME24, 1.0/1.0)"] == 6
    assert protocol["decoding 1.0/1.0"] == "temperature 1.0, top-p 1.0"
    assert protocol["grading"].startswith("rule-only ") and protocol["problems (AIME24)"].startswith("5 [")


@pytest.mark.parametrize("value", [0.55, 1.0, 0.3])
def test_one_fraction_cell_among_percentages_is_refused(tmp_path, value):
    stapo = _run_summary("8B", "STAPO", 50.0)
    stapo["decodings"]["train"]["benchmarks"]["aime24"]["mean_at_n"] = value
    paths = [_write(tmp_path, "justrl", _run_summary("8B", "JustRL", 40.0)), _write(tmp_path, "stapo", stapo)]
    with pytest.raises(ValueError, match=rf"stapo\.json: 8B STAPO: AIME24 \(1\.0/1\.0\) = {value:g} is <= 1 among percentages"):
        load_inputs(paths)
    text = tables.report(load_inputs(paths, allow_partial=True))
    assert "n/a" in _headline_line(text, "1.0/1.0")  # the row never makes a headline


def test_a_small_whole_number_of_correct_samples_is_a_percentage(tmp_path):
    stapo = _run_summary("8B", "STAPO", 50.0)  # 30 problems, N=32 on AIME24: 960 samples
    stapo["decodings"]["train"]["benchmarks"]["aime24"]["mean_at_n"] = 100.0 * 8 / 960  # 0.83: 8 correct samples
    stapo["decodings"]["train"]["benchmarks"]["aime25"]["mean_at_n"] = 0.0
    paths = [_write(tmp_path, "justrl", _run_summary("8B", "JustRL", 40.0)), _write(tmp_path, "stapo", stapo)]
    assert not load_inputs(paths)[1].partial()


def test_a_fraction_cell_in_a_printed_table_is_refused(tmp_path):
    path = tmp_path / "t.md"
    path.write_text(PAPER.read_text().replace("| 8B | STAPO | 33.44 (39.48)", "| 8B | STAPO | 0.33 (39.48)", 1))
    with pytest.raises(ValueError, match=r"8B STAPO: AIME24 \(1\.0/1\.0\) = 0\.33 is <= 1 among percentages"):
        load_inputs([str(path)])


@pytest.mark.parametrize("decodings, words", [
    ({"train": None}, "decodings.train is null (NoneType), not an object"),
    ({"train": [1, 2]}, "decodings.train is [1, 2] (list), not an object"),
    ({"train": {"benchmarks": [50.0]}}, "decodings.train.benchmarks is [50.0] (list), not an object"),
    ([{"train": {}}], "'decodings' is a list, not an object"),
])
def test_a_summary_of_the_wrong_shape_is_a_named_error(tmp_path, capsys, decodings, words):
    path = _write(tmp_path, "odd", {"scale": "8B", "method": "STAPO", "decodings": decodings})
    assert tables.main([path]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: {words}" in err and "Traceback" not in err


def test_a_non_utf8_summary_is_named(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_bytes(b'{"scale": "8B\xff"}')
    assert tables.main([str(path)]) == 2
    assert f"error: {path}: not UTF-8 text" in capsys.readouterr().err


def test_out_at_a_folder_or_below_a_file_is_a_named_error_written_nowhere(tmp_path, capsys):
    paths = _eight_b(tmp_path, _summary("8B", "GRPO", [45.0] * 6, [45.0] * 6))
    folder = tmp_path / "reports"
    folder.mkdir()
    assert tables.main(paths + ["--out", str(folder)]) == 2
    assert f"error: --out {folder} is a folder" in capsys.readouterr().err
    assert list(folder.iterdir()) == []
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert tables.main(paths + ["--out", str(afile / "t.md")]) == 2
    assert f"{afile} is a file, not a folder" in capsys.readouterr().err and afile.read_text() == "keep"
    assert tables.main(paths + ["--out", str(afile)]) == 0  # an existing file is replaced
    assert "Headline" in afile.read_text()


@pytest.mark.parametrize("kind", ["character device", "FIFO (named pipe)", "symbolic link"])
def test_out_at_a_device_a_fifo_or_a_link_is_refused_and_left_as_it_was(tmp_path, capsys, kind):
    """As root, --out at a device node replaced the node with the report."""
    import os
    import stat

    paths = _eight_b(tmp_path, _summary("8B", "GRPO", [45.0] * 6, [45.0] * 6))
    out, target = tmp_path / "out", tmp_path / "target.md"
    target.write_text("keep")
    if kind == "character device":
        if os.geteuid() != 0:
            out = Path("/dev/null")  # a process that cannot make a device node is given the machine's
        else:
            os.mknod(out, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    elif kind == "FIFO (named pipe)":
        os.mkfifo(out)
    else:
        out.symlink_to(target)
    before = os.lstat(out)
    assert tables.main(paths + ["--out", str(out)]) == 2
    assert f"error: --out {out} is a {kind}, not a regular file" in capsys.readouterr().err
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino) and target.read_text() == "keep"


def test_two_rows_that_differ_are_both_marked_whatever_their_order(tmp_path):
    one = _write(tmp_path, "one", _run_summary("8B", "JustRL", 40.0, n={"aime24": 1}))
    many = _write(tmp_path, "many", _run_summary("8B", "STAPO", 50.0))
    for paths in ([one, many], [many, one]):
        rows = load_inputs(paths, allow_mixed_protocol=True)
        assert all(r.protocol_issues for r in rows)
        text = tables.report(rows)
        assert "**" not in text.split("\n\n")[0]  # no row is bolded against another protocol
        assert "N (AIME24, 1.0/1.0) is 1, other rows have 32 (no value shared by most rows)" in text
        assert "N (AIME24, 1.0/1.0) is 32, other rows have 1" in text


def test_a_text_n_beside_a_number_shows_both_types(tmp_path):
    odd = _run_summary("8B", "GRPO", 45.0)
    odd["decodings"]["train"]["benchmarks"]["aime24"]["n_samples"] = "32"
    paths = _eight_b_rows(tmp_path, odd)
    with pytest.raises(ValueError, match=re.escape("N (AIME24, 1.0/1.0) is '32' (str), the table's is 32 (int)")):
        load_inputs(paths)


def test_labels_are_read_without_surrounding_spaces(tmp_path):
    paths = [_write(tmp_path, "justrl", _run_summary("8B ", "JustRL", 40.0)),
             _write(tmp_path, "stapo", _run_summary("8B", " STAPO", 50.0))]
    rows = load_inputs(paths)
    assert tables.scales(rows) == ["8B"] and rows[1].method == "STAPO"
    assert headline(rows, "train")[0] == pytest.approx(25.0)


@pytest.mark.parametrize("grading", ["as-run", "rule-only"])
def test_rows_of_another_grading_protocol_are_never_mixed(tmp_path, grading):
    """Each summary records its grading protocol; justrl and compassverifier rows never share a
    table, not with --allow-mixed-protocol, and not as a rule-only table (their rules differ)."""
    from recipe.stapo.eval.summary import grading_info

    other = grading_info(None, 5.0, "compassverifier")
    assert other["protocol"] == "compassverifier" and grading_info(None, 5.0)["protocol"] == "justrl"
    paths = _eight_b_rows(tmp_path, _run_summary("8B", "GRPO", 45.0, grading=other))
    for mixed in (False, True):
        with pytest.raises(ValueError, match=r"different grading protocols.*stapo\.json: 8B STAPO: justrl; "
                                             r".*grpo\.json: 8B GRPO: compassverifier"):
            load_inputs(paths, allow_mixed_protocol=mixed, grading=grading)
    # the same protocol: one table
    (tmp_path / "same").mkdir()
    same = _eight_b_rows(tmp_path / "same", _run_summary("8B", "GRPO", 45.0, grading=grading_info(None, 5.0, "justrl")))
    assert len(load_inputs(same, grading=grading)) == 3


def test_a_score_of_zero_is_not_taken_for_fractions(tmp_path):
    """A model that solves nothing scores 0 in percent and in fractions alike: its row is a row."""
    zero = _run_summary("8B", "GRPO", 0.0)
    paths = [_write(tmp_path, "grpo", zero), _write(tmp_path, "stapo", _run_summary("8B", "STAPO", 50.0))]
    rows = load_inputs(paths)
    assert rows[0].value("train", "AIME24") == 0.0 and not rows[0].issues
    text = PAPER.read_text().replace("| 6.88 (10.83) |", "| 0.00 (0.00) |", 1)  # one printed zero among percentages
    table = tmp_path / "t.md"
    table.write_text(text)
    assert not [r for r in load_inputs([str(table)]) if r.issues]
    printed_zeros = "| model | method | " + " | ".join(COLUMNS) + " | Avg |\n|---|---|" + "---|" * 7 + "\n" + \
        "| 1.7B | GRPO | " + " | ".join(["0 (0)"] * 7) + " |\n"
    table.write_text(printed_zeros)
    assert not load_inputs([str(table)])[0].issues
    # fractions are still fractions: a nonzero row at most 1 (0.83% is not 8 of 960 samples here: 30 x 4)
    fractions = _run_summary("8B", "JustRL", 0.0)
    fractions["decodings"]["train"]["benchmarks"]["aime24"]["mean_at_n"] = 0.55
    with pytest.raises(ValueError, match=r"every nonzero value is <= 1: fractions"):
        load_inputs([_write(tmp_path, "justrl", fractions)])


def _of_form(summary, form):
    """``summary`` with the prompt form ``form`` (None: a summary from before forms were recorded)."""
    summary = {k: v for k, v in summary.items() if k != "prompt_form"}
    return summary if form is None else {**summary, "prompt_form": form}


@pytest.mark.parametrize("form", ["train", None, "custom", "mixed"])
def test_a_row_not_built_on_justrls_evaluation_prompt_is_refused_or_marked(tmp_path, form):
    """Table 2 follows JustRL's evaluation prompt: a row of another prompt form (or one from before
    forms were recorded) is refused, or shown marked with the reason; a table of such rows alone
    has no headline, and the report names the prompt form."""
    shown = "prompt form " + ("unrecorded (a summary from before prompt forms were recorded)" if form is None else form)
    reason = f"{shown}, not JustRL's evaluation prompt (justrl-eval)"
    rows = [_run_summary("8B", m, v) for m, v in (("JustRL", 40.0), ("STAPO", 50.0), ("GRPO", 45.0))]
    paths = [_write(tmp_path, r["method"].lower(), r) for r in rows[:2] + [_of_form(rows[2], form)]]
    with pytest.raises(ValueError, match=r"partial results refused: .*grpo\.json: 8B GRPO: " + re.escape(reason)):
        load_inputs(paths)
    text = tables.report(load_inputs(paths, allow_partial=True))
    assert f"8B GRPO is partial: {reason}" in text
    assert 'Prompt: JustRL\'s evaluation prompt (justrl-eval: the problem, one space, "Please reason step by step' in text
    old = [_write(tmp_path, r["method"].lower(), _of_form(r, form)) for r in rows]
    with pytest.raises(ValueError, match="partial results refused"):
        load_inputs(old)
    text = tables.report(load_inputs(old, allow_partial=True))
    assert f"Prompt: {shown}\n" in text and "Headline 1.0/1.0: n/a" in text and "Headline 0.7/0.9: n/a" in text


@pytest.mark.parametrize("scale, method", [("8\nB", "GRPO"), ("8B", "GR|PO")])
def test_a_label_that_would_cut_the_markdown_row_is_refused(tmp_path, capsys, scale, method):
    """A '|' or a line break in a summary's label broke Table 2's Markdown silently (a row split, a column added)."""
    path = _write(tmp_path, "odd", _summary(scale, method, [40.0] * 6, [40.0] * 6))
    assert tables.main([path]) == 2
    assert "holds a '|' or a line break; relabel it as SCALE:METHOD=" in capsys.readouterr().err
    assert "8B | GRPO |" in tables.render(load_inputs([f"8B:GRPO={path}"]), "markdown")
