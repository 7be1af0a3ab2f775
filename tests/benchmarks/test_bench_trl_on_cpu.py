"""bench_trl's quick mode (TRL's GRPOTrainer and STAPOTrainer on the tiny model, seconds): a row per
trainer with finite positive times, GRPOTrainer the reference, and the statistics forward covering
what each trainer says (none at tau_p=0, every completion with current_forward=full, the
positive-advantage ones by default). No timing assertion."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_trl


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_bench_trl_quick_prints_every_trainer(assets, tmp_path, capsys):
    rows_file = tmp_path / "rows.json"
    argv = ["--quick", "--model", str(assets / "model"), "--data", str(assets / "train.parquet"),
            "--out", str(tmp_path / "runs"), "--json", str(rows_file)]
    assert bench_trl.main(argv) == 0
    text = capsys.readouterr().out
    rows = {row["trainer"]: row for row in json.loads(rows_file.read_text())}
    assert list(rows) == list(bench_trl.TRAINERS)
    for name, row in rows.items():
        assert f"| {name} | " in text
        assert row["steps"] == 1  # 2 steps, the first skipped
        for key in ("step_s", "step_ratio", "update_s", "update_ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key)
        assert row["update_s"] < row["step_s"]  # the generation is taken out
    assert rows["grpo"]["step_ratio"] == rows["grpo"]["update_ratio"] == 1.0
    assert rows["stapo-tau0"]["forwarded_tokens_frac"] == 0.0
    assert rows["stapo-full"]["forwarded_tokens_frac"] == 1.0
    assert 0.0 < rows["stapo"]["forwarded_tokens_frac"] < 1.0
    assert rows["stapo"]["forward_s"] > 0


@pytest.mark.parametrize("argv, message", [(["--steps", "1"], "--steps must be >= 2"),
                                           (["--rounds", "0"], "--rounds"), (["--batch", "-4"], "--batch")])
def test_bench_trl_bad_arguments_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        bench_trl.main(argv)
    assert error.value.code == 2 and message in capsys.readouterr().err
