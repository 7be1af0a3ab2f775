"""The last part of ``bash run_scripts/quickstart.sh --evaluate`` (:func:`stapo_cpu.quickstart.evaluate`)
on a checkpoint the suite already has: the shared STAPO run's, saved after its last step as
``--evaluate`` has every run save it (tests/helpers/shared_runs.py). verl's model merger through
``eval.sh``, the CPU evaluation on the tiny task's 64 held-out problems, Table 2 from
``recipe.stapo.eval.tables`` (slow: one evaluation, about 2.5 minutes on 2 cores). Which runs save
their checkpoint and reach this function: tests/stapo_cpu/test_quickstart_on_cpu.py."""

from __future__ import annotations

import json

import pytest

from recipe.stapo.eval.tables import COLUMNS, MARK
from stapo_cpu import quickstart as qs


@pytest.mark.slow
def test_evaluate_merges_evaluates_and_builds_table_2(shared_runs, tmp_path):
    run = shared_runs.get("stapo_v1")
    assert run.ok, run.tail()
    checkpoint = run.run_dir / "checkpoints" / "global_step_2"
    markdown, errors = qs.evaluate({"stapo": checkpoint}, tmp_path / "eval")
    assert errors == []
    merged = checkpoint / "merged_hf"
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))  # verl's merger, run by eval.sh
    summary = json.loads((tmp_path / "eval" / "stapo" / "summary.json").read_text())
    assert summary["model"] == str(merged) and (summary["scale"], summary["method"]) == (qs.TINY_SCALE, "stapo")
    assert summary["backend"] == "vllm" and summary["prompt_form"] == "train"
    block = summary["decodings"]["justrl"]["benchmarks"]["val"]
    assert (block["problems"], block["n_samples"], block["ungraded"]) == (64, 4, 0)
    mean, se = block["mean_at_n"], block["mean_at_n_se"]
    assert 0 < se < 10
    assert f"- stapo: val mean@4 {mean:.2f} (standard error {se:.2f}, 64 problems, temperature 0.7): " in markdown
    table = (tmp_path / "eval" / qs.TABLE_FILE).read_text()
    assert table in markdown
    # the tiny task's column after Avg; the row marked partial, with every reason, and out of the headline
    assert f"| model | method | {' | '.join(COLUMNS)} | Avg | val |" in table
    assert f"| tiny | stapo {MARK} | " + " | ".join(["- (-)"] * 7) + f" | - ({mean:.2f}) |" in table
    assert "Prompt: prompt form train\nGrading: justrl protocol: JustRL's grader only (no verifier)" in table
    assert (f"{MARK} tiny stapo is partial: no 1.0/1.0 results; prompt form train, not JustRL's evaluation prompt "
            "(justrl-eval); missing AIME24, AIME25, AMC23, MATH500, Minerva, Olympiad (0.7/0.9)") in table
    assert "Headline 0.7/0.9: n/a (needs stapo and a baseline at some scale)" in table
