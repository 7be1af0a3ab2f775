"""The quickstart runs STAPO at the paper's settings: it composes the STAPO run's config, records
the S2T settings and refuses to train when any differs from the paper's (no trainer is started here)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from stapo_cpu import quickstart as qs
from stapo_cpu import quickstart_report as report
from stapo_cpu import quickstart_settings as qsettings
from recipe.stapo.driver import compose
from stapo_cpu.assets import asset_paths
from stapo_core import fileio
from stapo_core.s2t import DEFAULT_Q, DEFAULT_TAU_P

S2T = "actor_rollout_ref.actor.policy_loss"


@pytest.fixture()
def fake_assets(tmp_path, monkeypatch) -> Path:
    """An assets folder the CPU overrides accept; build_assets is not run (no warm-up here)."""
    root = tmp_path / "assets"
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    pd.DataFrame({"problem": [f"{i} + 1" for i in range(8)]}).to_parquet(asset_paths(root).val)  # 8 held-out problems
    monkeypatch.setattr(qs, "build_assets", lambda folder: asset_paths(root))
    return root


def _run_trainer_forbidden(*args, **kwargs):
    raise AssertionError("the trainer must not start")


def test_paper_values_are_the_papers():
    paper = qsettings.paper_settings()
    assert paper[f"{S2T}.tau_p"] == DEFAULT_TAU_P == 0.002 and paper[f"{S2T}.q"] == DEFAULT_Q == 0.75
    assert (paper["actor_rollout_ref.actor.clip_ratio_low"], paper["actor_rollout_ref.actor.clip_ratio_high"]) == (0.2, 0.28)
    assert paper["actor_rollout_ref.actor.loss_agg_mode"] == "token-mean"
    assert paper["reward.custom_reward_function.path"]  # the recipe's reward, read from its config


def test_quickstart_defaults_to_the_shipped_assets(tmp_path):
    from stapo_cpu.assets import SHIPPED_DIR

    assert qs.parse_options(["--out", str(tmp_path / "out")]).assets == SHIPPED_DIR
    assert qs.parse_options(["--out", str(tmp_path / "out"), "--assets", str(tmp_path / "a")]).assets == tmp_path / "a"


def test_quickstart_stapo_config_has_the_papers_settings(fake_assets, tmp_path):
    opts = qs.parse_options(["--out", str(tmp_path / "out"), "--assets", str(fake_assets)])
    settings, differences = qs.check_stapo_settings(opts, fake_assets)
    assert differences == []
    assert settings[f"{S2T}.tau_p"] == 0.002 and settings[f"{S2T}.q"] == 0.75
    # scale settings are the quickstart's, and differ from the paper-scale config
    assert settings["data.train_batch_size"] == 4 and settings["actor_rollout_ref.rollout.n"] == 4
    assert settings["data.max_response_length"] == 160
    assert settings["actor_rollout_ref.actor.ppo_mini_batch_size"] == 2  # half of the 4 prompts by default
    assert settings[qsettings.VAL_N] == 1 and qsettings.config_value(compose(["method=stapo"]), qsettings.VAL_N) == 32  # JustRL's avg@32
    text = qsettings.settings_markdown(settings)
    for key in [*qsettings.PAPER_S2T, *qsettings.SCALE_KEYS]:
        assert f"`{key}`" in text, key
    assert "| `actor_rollout_ref.actor.policy_loss.tau_p` | 0.002 |" in text


def test_differences_name_the_key_and_both_values():
    paper = {f"{S2T}.tau_p": 0.002, f"{S2T}.q": 0.75}
    assert qsettings.s2t_differences(dict(paper), paper) == []
    assert qsettings.s2t_differences({**paper, f"{S2T}.q": 0.5}, paper) == [f"{S2T}.q = 0.5, the paper's is 0.75"]
    assert qsettings.s2t_differences({f"{S2T}.q": 0.75}, paper) == [f"{S2T}.tau_p = None, the paper's is 0.002"]


@pytest.mark.parametrize("override,key", [
    (f"{S2T}.tau_p=0.5", f"{S2T}.tau_p"),
    (f"{S2T}.q=0.5", f"{S2T}.q"),
    ("actor_rollout_ref.actor.clip_ratio_high=0.2", "actor_rollout_ref.actor.clip_ratio_high"),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.loss_agg_mode"),
])
def test_quickstart_refuses_non_paper_stapo(fake_assets, tmp_path, monkeypatch, capsys, override, key):
    monkeypatch.setattr(qs, "run_cpu_trainer", _run_trainer_forbidden)
    code = qs.main(["--out", str(tmp_path / "out"), "--assets", str(fake_assets), "--override", override])
    assert code == 2
    assert f"{key} = " in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    (f"{S2T}.tau_p=0.01", f"{S2T}.tau_p = 0.01, the paper's is 0.002"),
    ("trainer.nnodez=1", "--override: override refused: Could not override 'trainer.nnodez'"),
    ("trainer.nnodes=[1", "--override: override refused: no viable alternative at input '[1'"),
])
def test_an_override_is_refused_before_the_assets_are_built(tmp_path, monkeypatch, capsys, override, message):
    monkeypatch.setattr(qs, "build_assets", _run_trainer_forbidden)
    monkeypatch.setattr(qs, "run_cpu_trainer", _run_trainer_forbidden)
    out, assets = tmp_path / "out", tmp_path / "assets"
    assert qs.main(["--out", str(out), "--assets", str(assets), "--override", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() and not assets.exists()



@pytest.mark.parametrize("override", ["trainer.total_training_steps=3", "trainer.save_freq=-1", "+data.seed=7",
                                      "actor_rollout_ref.rollout.n=3", "recipe.token_dump.dir=elsewhere"])
def test_an_override_of_a_key_the_quickstart_sets_from_its_options_is_refused(fake_assets, tmp_path, monkeypatch,
                                                                               capsys, override):
    """They passed: the runs trained 3 steps while the summary reported 16 and --evaluate looked for
    global_step_16 after training, saved no checkpoint, or lost the token dump; ``+data.seed`` was
    Hydra's traceback."""
    monkeypatch.setattr(qs, "run_cpu_trainer", _run_trainer_forbidden)
    assert qs.main(["--out", str(tmp_path / "out"), "--assets", str(fake_assets), "--evaluate",
                    "--override", override]) == 2
    err = capsys.readouterr().err
    key = override.lstrip("+").partition("=")[0]
    assert f"--override {override}: the quickstart sets {key} from its options" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["a,b", "q'u\"o", "br[1]=2", "é", "x${oc.env:HOME}", "semi;#{c}", "new\nline", "bs\\"])
def test_a_folder_of_any_name_reaches_hydra_as_written(fake_assets, tmp_path, name):
    """The quickstart's folders reached Hydra unquoted: a comma, quote, bracket, '=', '#', a non-ASCII
    letter or a line break in --out was Hydra's traceback after the assets were checked, and
    ``${oc.env:HOME}`` was resolved (the checkpoints written elsewhere)."""
    run = tmp_path / name / "stapo"
    opts = qs.parse_options(["--out", str(tmp_path / name), "--assets", str(fake_assets)])
    config = compose(["method=stapo", *qs.cpu_overrides(fake_assets, run), *qs.method_overrides(opts, run)])
    assert config.trainer.default_local_dir == str(run / "checkpoints")
    assert (config.trainer.experiment_name, config.recipe.token_dump.dir) == ("stapo", str(run))
    assert config.data.train_files == str(asset_paths(fake_assets).train)


def test_scale_override_is_allowed_and_recorded(fake_assets, tmp_path, monkeypatch):
    """A scale override passes the check; the run is attempted with it (a stub trainer fails it)."""
    calls = []

    def stub(method, assets, run_dir, **kwargs):
        calls.append((method, kwargs["extra"]))
        from stapo_cpu.trainer import CPURun

        return CPURun(method, 1, 0.0, Path(run_dir), Path(run_dir) / "metrics.jsonl", Path(run_dir) / "x.log")

    monkeypatch.setattr(qs, "run_cpu_trainer", stub)
    code = qs.main(["--out", str(tmp_path / "out"), "--assets", str(fake_assets), "--methods", "stapo",
                    "--override", "actor_rollout_ref.actor.optim.weight_decay=0.0"])
    assert code == 1 and calls and "actor_rollout_ref.actor.optim.weight_decay=0.0" in calls[0][1]
    recorded = json.loads((tmp_path / "out" / qs.SETTINGS_FILE).read_text())
    assert recorded["stapo"][f"{S2T}.tau_p"] == recorded["paper"][f"{S2T}.tau_p"] == 0.002
    assert "| `actor_rollout_ref.actor.policy_loss.q` | 0.75 |" in (tmp_path / "out" / "summary.md").read_text()


def test_summary_row_means_the_logged_s2t_counts():
    steps = {0: {"val-core/x/acc/mean@1": 0.25},
             1: {report.REWARD: -0.5, report.CANDIDATES: 3, report.SILENCED_COUNT: 2, report.SILENCED: 0.002},
             2: {report.REWARD: 0.5, report.CANDIDATES: 5, report.SILENCED_COUNT: 4, report.SILENCED: 0.004, "val-core/x/acc/mean@1": 0.5}}
    row = report.summarise("stapo", steps, 10.0)
    assert (row["mean_candidates"], row["mean_silenced"], row["mean_silenced_frac"]) == (4.0, 3.0, 0.003)
    assert (row["val_acc_first"], row["val_acc_last"], row["final_reward"], row["steps"]) == (0.25, 0.5, 0.5, 2)
    table = report.markdown_table([row])
    assert "| 4.0 / 3.0 | 0.003 | 0.250 -> 0.500 |" in table


def _effect_steps(applied: float, silenced: list, tokens: list) -> dict:
    """Per-step records with the update effect: dlogp of silenced tokens (None: none that step)."""
    steps = {}
    for step, (value, count) in enumerate(zip(silenced, tokens), start=1):
        data = {report.REWARD: -0.5 + 0.25 * step, report.APPLIED: applied, "actor/s2t/dlogp_silenced_tokens": float(count),
                "actor/s2t/dlogp_all": 0.1 * step, "actor/s2t/dlogp_all_tokens": 100.0,
                "actor/s2t/dlogp_kept_candidates_tokens": 0.0, report.DLOGP_SECONDS: 0.02}
        if value is not None:
            data["actor/s2t/dlogp_silenced"] = value
        steps[step] = data
    return steps


def test_summary_row_carries_the_update_effect():
    row = report.summarise("justrl", _effect_steps(0.0, [2.0, None, -1.0, 0.5], [1, 0, 2, 2]), 5.0)
    assert row["s2t"] == "monitored" and row["mean_dlogp_seconds"] == pytest.approx(0.02)
    assert row["update_effect"]["silenced"] == {"mean": pytest.approx((2.0 - 2.0 + 1.0) / 5), "tokens": 5}
    assert row["update_effect"]["all"] == {"mean": pytest.approx(0.25), "tokens": 400}
    assert row["update_effect"]["kept_candidates"] == {"mean": None, "tokens": 0}
    assert (row["reward_first_half"], row["reward_second_half"]) == (pytest.approx(-0.125), pytest.approx(0.375))
    table = report.update_effect_table([row])
    assert "| justrl | monitored | 0.200 (5) | - (0) | 0.250 (400) | 0.020 |" in table
    assert report.update_effect_table([{**row, "error": "stopped after 1200 s"}]) == ""  # no run measured it: no table
    assert report.summarise("stapo", _effect_steps(1.0, [0.1], [1]), 1.0)["s2t"] == "applied"
    assert "| monitored | n/a / n/a | n/a | n/a -> n/a | n/a | 5.0 | 12.3 |" in report.markdown_table([{**row, "cpu_s": 12.3}])
    assert report.summarise("grpo", {1: {report.REWARD: 0.0}}, 1.0)["s2t"] is None  # S2T neither applied nor monitored


def test_update_effect_across_seeds_is_mean_and_range_of_the_runs():
    rows = [{**report.summarise("justrl", _effect_steps(0.0, [value], [3]), 1.0), "seed": seed}
            for seed, value in enumerate((1.0, 4.0, -2.0))]
    by_method = report.update_effect_by_method(rows)
    assert by_method["justrl"]["silenced"] == {"mean": 1.0, "low": -2.0, "high": 4.0, "runs": 3, "tokens": 9}
    assert by_method["justrl"]["kept_candidates"]["mean"] is None
    assert "| justrl | monitored | 1.000 [-2.000, 4.000] (3 seeds, 9 tokens) | - |" in report.update_effect_markdown(by_method)


def _learning_row(method, before, after, rewards, reward_se=0.05):
    return {"method": method, "error": None, "val_acc_first": before, "val_acc_last": after,
            "reward_first_half": rewards[0], "reward_second_half": rewards[1], "reward_change_se": reward_se}


def test_half_change_se_is_the_standard_error_of_the_difference_of_means():
    first, second = [0.0, 1.0, 2.0], [1.0, 3.0]  # sample variances 1 and 2
    assert report.half_change_se(first, second) == pytest.approx((1 / 3 + 2 / 2) ** 0.5)
    assert report.half_change_se([1.0], second) is None  # one step: no spread to measure
    rewards = {s: {report.REWARD: r} for s, r in enumerate([-1.0, 0.0, 1.0, 1.0], start=1)}
    assert report.summarise("justrl", rewards, None)["reward_change_se"] == pytest.approx((0.5 / 2 + 0.0) ** 0.5)


def test_the_summary_says_first_whether_the_baselines_learned_beyond_noise():
    # validation on 64 samples at 0.4: standard error of a change sqrt(2 * 0.4 * 0.6 / 64) = 0.0866
    rising = [_learning_row(m, 0.4, 0.6, (-0.5, -0.2)) for m in ("grpo", "entropy20", "justrl")]
    check = report.learning_check(rising + [_learning_row("stapo", 0.4, 0.3, (-0.5, -0.6))], val_samples=64)
    assert check["learned"] and set(check["methods"]) == {"grpo", "entropy20", "justrl"}  # STAPO is not judged
    assert check["methods"]["grpo"]["val_change_se"] == pytest.approx((2 * 0.4 * 0.6 / 64) ** 0.5)
    assert report.learning_markdown(check).startswith(
        "**The baselines learned**: grpo: validation accuracy 0.400 -> 0.600 (standard error 0.09), training "
        "reward -0.500 (first half of the steps) -> -0.200 (second half) (standard error 0.05)")
    # justrl: both rise, but the accuracy by 0.1 < 2 x 0.0866: within noise
    within = rising[:2] + [_learning_row("justrl", 0.4, 0.5, (-0.5, -0.2))]
    check = report.learning_check(within, val_samples=64)
    assert not check["learned"] and check["methods"]["justrl"]["rose"] and not check["methods"]["justrl"]["learned"]
    assert report.learning_markdown(check).startswith(
        "**Not every baseline visibly learned with these settings** (justrl: validation accuracy and training "
        "reward did not both rise beyond their noise; justrl rose, but within it)")
    flat = rising[:2] + [_learning_row("justrl", 0.4, 0.7, (-0.3, -0.3))]  # the reward did not rise
    check = report.learning_check(flat, val_samples=64)
    assert not check["methods"]["justrl"]["rose"] and "rose, but within it" not in report.learning_markdown(check)
    # over seeds: means of the changes, standard errors divided by sqrt(seeds)
    two_seeds = [_learning_row("grpo", 0.4, 0.6, (-0.5, -0.2), 0.1), _learning_row("grpo", 0.4, 0.6, (-0.5, -0.2), 0.1)]
    got = report.learning_check(two_seeds, val_samples=64)["methods"]["grpo"]
    assert got["reward_change_se"] == pytest.approx(0.1 / 2 ** 0.5)
    assert got["val_change_se"] == pytest.approx((2 * 0.4 * 0.6 / 64) ** 0.5 / 2 ** 0.5)
    down = [_learning_row("grpo", 0.4, 0.6, (-0.5, -0.2)), _learning_row("grpo", 0.4, 0.0, (-0.5, -0.6))]
    assert not report.learning_check(down, val_samples=64)["methods"]["grpo"]["rose"]  # means over seeds: 0.4 -> 0.3
    assert not report.learning_check(rising)["learned"]  # no validation size: no noise to judge against
    assert report.learning_markdown(report.learning_check([_learning_row("stapo", 0.4, 0.5, (0, 1))])) == ""


def test_the_learning_lines_state_the_noise_rule(tmp_path):
    # standard error of an accuracy p on k samples: sqrt(p (1 - p) / k); 0.4 on 64: 0.0612
    assert report.validation_noise(0.4, 64) == pytest.approx((0.4 * 0.6 / 64) ** 0.5)
    assert report.validation_noise(0.0, 64) == 0.0
    text = report.learning_markdown(report.learning_check([_learning_row("justrl", 0.4, 0.7, (-0.5, -0.2))], val_samples=64))
    assert text.startswith("**The baselines learned**") and "rose by more than two standard errors" in text
    # the samples of one validation: held-out problems x samples per problem
    root = tmp_path / "assets"
    root.mkdir()
    pd.DataFrame({"x": range(5)}).to_parquet(asset_paths(root).val)
    assert qs.validation_samples(root, {qsettings.VAL_N: 3}) == 15


def test_validation_before_training_runs_once_per_seed_and_is_shared(fake_assets, tmp_path, monkeypatch):
    """The seed's first run validates before training; the seed's other runs skip it and get that
    record as their step 0, marked with its source (a stub trainer writes verl-style metrics)."""
    calls = []

    def stub(method, assets, run_dir, **kwargs):
        from stapo_cpu.trainer import CPURun

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        before = "trainer.val_before_train=false" not in kwargs["extra"]
        calls.append((method, kwargs["seed"], before))
        lines = [{"step": 0, "data": {"val-core/x/acc/mean@1": 0.25 + kwargs["seed"]}}] if before else []
        lines.append({"step": 1, "data": {report.REWARD: 0.5, "val-core/x/acc/mean@1": 0.75}})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return CPURun(method, 0, 1.0, run_dir, run_dir / "metrics.jsonl", run_dir / "x.log")

    monkeypatch.setattr(qs, "run_cpu_trainer", stub)
    monkeypatch.setattr(qs, "plot_runs", lambda *a, **k: [])
    monkeypatch.setattr(qs, "plot_bands", lambda *a, **k: [])
    monkeypatch.setattr(qs, "quadrant_markdown", lambda dirs: "")
    out = tmp_path / "out"
    assert qs.main(["--out", str(out), "--assets", str(fake_assets), "--methods", "grpo,stapo", "--seeds", "2",
                    "--steps", "1"]) == 0
    assert calls == [("grpo", 0, True), ("stapo", 0, False), ("grpo", 1, True), ("stapo", 1, False)]
    for seed in (0, 1):
        first = json.loads((out / f"seed{seed}" / "stapo" / "metrics.jsonl").read_text().splitlines()[0])
        assert first == {"step": 0, "data": {"val-core/x/acc/mean@1": 0.25 + seed}, qs.SHARED_FROM: "grpo"}
    rows = json.loads((out / "summary.json").read_text())["methods"]
    assert {(r["method"], r["seed"]): r["val_acc_first"] for r in rows} == {
        ("grpo", 0): 0.25, ("stapo", 0): 0.25, ("grpo", 1): 1.25, ("stapo", 1): 1.25}
    assert "measured once per seed, by grpo (seed 0), grpo (seed 1)" in (out / "summary.md").read_text()
    # the learning lines give the validation's noise from its size, 8 held-out problems x 1 sample: a change
    # has standard error sqrt(2 p (1 - p) / 8) per seed at each seed's p (0.25; 1.25 clips to 0), / 2 seeds
    se = (2 * 0.25 * 0.75 / 8) ** 0.5 / 2
    assert f"grpo: validation accuracy 0.750 -> 0.750 (standard error {se:.2f})," in (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["reproducibility"]["seeds"] == [0, 1]
    assert "- seeds: 0, 1\n" in (out / "summary.md").read_text()
    assert (out / "summary.md").read_text().startswith("# STAPO study (CPU, tiny model, 1 steps, 2 seed(s)")
    # a second invocation reuses every finished run (same settings, validation included)
    calls.clear()
    assert qs.main(["--out", str(out), "--assets", str(fake_assets), "--methods", "grpo,stapo", "--seeds", "2",
                    "--steps", "1"]) == 0
    assert calls == []


def _checkpointing_trainer(calls):
    """A stub trainer writing verl-style metrics and, when asked to save at its last step, verl's
    checkpoint folder for it; records each call's method and ``save_freq``."""

    def stub(method, assets, run_dir, **kwargs):
        from stapo_cpu.trainer import CPURun

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        calls.append((method, kwargs["save_freq"]))
        if kwargs["save_freq"] > 0:
            (run_dir / "checkpoints" / f"global_step_{kwargs['steps']}" / "actor").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {report.REWARD: 0.5}}) + "\n")
        return CPURun(method, 0, 1.0, run_dir, run_dir / "metrics.jsonl", run_dir / "x.log")

    return stub


def test_evaluate_saves_each_final_checkpoint_and_evaluates_it(fake_assets, tmp_path, monkeypatch):
    """``--evaluate``: every run saves verl's checkpoint at its last step (and only then), each method's
    checkpoint goes to :func:`stapo_cpu.quickstart.evaluate` (its real work: the slow test below), whose
    section ends up in summary.md; a run finished without a checkpoint is trained again, one finished
    with it is reused, and the plain quickstart saves none."""
    calls, evaluated = [], []
    monkeypatch.setattr(qs, "run_cpu_trainer", _checkpointing_trainer(calls))
    monkeypatch.setattr(qs, "evaluate", lambda checkpoints, out: evaluated.append((checkpoints, out)) or ("TABLE 2\n", []))
    for name in ("plot_runs", "plot_update_effect"):
        monkeypatch.setattr(qs, name, lambda *a, **k: [])
    monkeypatch.setattr(qs, "quadrant_markdown", lambda dirs: "")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--assets", str(fake_assets), "--methods", "grpo,stapo", "--steps", "3"]
    assert qs.main(argv) == 0
    assert calls == [("grpo", -1), ("stapo", -1)] and evaluated == []  # the plain quickstart: no checkpoint
    assert not (out / "stapo" / "checkpoints").exists()
    calls.clear()
    assert qs.main([*argv, "--evaluate"]) == 0
    assert calls == [("grpo", 3), ("stapo", 3)]  # finished without a checkpoint: trained again, saving one
    assert evaluated == [({m: out / m / "checkpoints" / "global_step_3" for m in ("grpo", "stapo")}, out / "eval")]
    assert "## Evaluation: each method's final checkpoint, and Table 2 on the tiny task\n\nTABLE 2\n" in (
        out / "summary.md").read_text()
    calls.clear()
    assert qs.main([*argv, "--evaluate"]) == 0 and qs.main(argv) == 0
    assert calls == []  # runs holding their checkpoint serve both
    monkeypatch.setattr(qs, "evaluate", lambda checkpoints, out: ("", ["the evaluation of X failed (exit 2)"]))
    assert qs.main([*argv, "--evaluate"]) == 1  # a failed evaluation fails the command


def test_evaluate_takes_one_seed(tmp_path, capsys):
    err = _refused(["--evaluate", "--seeds", "2"], tmp_path, capsys)
    assert "--evaluate with --seeds: Table 2 has one row per method; evaluate one seed (--seed K)" in err


# ------------------------------------------------------------------------------------------------
# options: every bad one is refused (exit 2, naming it) before anything is built or created
# ------------------------------------------------------------------------------------------------


def _refused(argv: list[str], tmp_path: Path, capsys) -> str:
    """Run the quickstart with ``argv``; assert it exits 2 having created neither the output nor the
    assets folder, and return its error message."""
    out, assets = tmp_path / "out", tmp_path / "assets"
    with pytest.raises(SystemExit) as exit_info:
        qs.main(["--out", str(out), "--assets", str(assets), *argv])
    assert exit_info.value.code == 2
    assert not out.exists() and not assets.exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--lr", "-1"], "--lr must be a positive finite number, got -1.0"),
    (["--lr", "0"], "--lr must be a positive finite number, got 0.0"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--n", "1"], "--n must be >= 2, got 1: GRPO's advantage"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--seed", "-1"], "seeds -1..-1 must lie in [0, 4294967295]"),
    (["--seed", str(2**32 - 1), "--seeds", "2"], "seeds 4294967295..4294967296 must lie in [0, 4294967295]"),
    (["--methods", "grpo,dapo"], "--methods: unknown dapo; give a comma-separated subset of grpo,entropy20,justrl,stapo"),
    (["--methods", ","], "--methods: none given"),
    (["--methods", "stapo,stapo"], "--methods: stapo given more than once"),
    (["--test-freq", "0"], "--test-freq must be a positive number of steps, got 0"),
    (["--test-freq", "-2"], "--test-freq must be a positive number of steps, got -2"),
    (["--prompts", "4", "--mini-batch", "3"], "--mini-batch 3 must divide --prompts 4"),
    (["--prompts", "6", "--mini-batch", "0"], "--mini-batch 0 must divide --prompts 6"),
    (["--response-length", "0"], "--response-length must be >= 1, got 0"),
    (["--prompt-length", "0"], "--prompt-length must be >= 1, got 0"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--override", "trainer.test_freq"], "--override 'trainer.test_freq' is not a Hydra override"),
    (["--override", "=3"], "--override '=3' is not a Hydra override"),
])
def test_bad_option_exits_2_naming_it_before_building_anything(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(qs, "build_assets", _run_trainer_forbidden)
    monkeypatch.setattr(qs, "run_cpu_trainer", _run_trainer_forbidden)
    assert message in _refused(argv, tmp_path, capsys)


def test_every_bad_option_is_named_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(qs, "build_assets", _run_trainer_forbidden)
    err = _refused(["--lr", "nan", "--steps", "0", "--n", "1"], tmp_path, capsys)
    assert "3 options cannot run" in err and "--lr" in err and "--steps" in err and "--n" in err


@pytest.mark.parametrize("target", ["out", "assets"])
def test_an_output_folder_that_cannot_be_created_is_refused(tmp_path, monkeypatch, capsys, target):
    """A file where the folder (or one of its parents) should be: refused, the file untouched."""
    monkeypatch.setattr(qs, "build_assets", _run_trainer_forbidden)
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    folders = {"out": tmp_path / "out", "assets": tmp_path / "assets", target: blocker / "sub"}
    with pytest.raises(SystemExit) as exit_info:
        qs.main(["--out", str(folders["out"]), "--assets", str(folders["assets"])])
    assert exit_info.value.code == 2
    assert f"--{target} {blocker / 'sub'} cannot be created: {blocker} is a file" in capsys.readouterr().err
    assert blocker.read_text() == "keep me" and not (tmp_path / "out").exists() and not (tmp_path / "assets").exists()
    folders[target] = blocker
    with pytest.raises(SystemExit):
        qs.main(["--out", str(folders["out"]), "--assets", str(folders["assets"])])
    assert f"--{target} {blocker} is a file, not a folder" in capsys.readouterr().err


def test_a_read_only_output_folder_is_refused(tmp_path, monkeypatch, capsys):
    """Without write permission (nothing can be made in the folder, as for a non-root user) the folder is
    refused."""
    monkeypatch.setattr(qs, "build_assets", _run_trainer_forbidden)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.parent == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(SystemExit) as exit_info:
        qs.main(["--out", str(locked / "out"), "--assets", str(tmp_path / "assets")])
    assert exit_info.value.code == 2
    assert f"--out {locked / 'out'} cannot be created: {locked} is not writable: Permission denied ({locked / 'out'})" \
        in capsys.readouterr().err


def test_built_assets_in_a_read_only_folder_are_accepted(tmp_path, monkeypatch):
    """The assets folder only needs to be writable when it has to be built."""
    calls = []
    monkeypatch.setattr(qs, "is_built", lambda folder: calls.append(folder) or True)
    real_write_bytes = Path.write_bytes

    def write_bytes(self, data):  # nothing can be written in the assets folder (what a non-root user meets)
        if self.parent == tmp_path / "assets":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    (tmp_path / "assets").mkdir()
    assert "is not writable" in fileio.output_folder_problem("--assets", tmp_path / "assets")
    opts = qs.parse_options(["--out", str(tmp_path / "out"), "--assets", str(tmp_path / "assets")])
    assert opts.assets == tmp_path / "assets" and calls == [tmp_path / "assets"]


def test_options_are_parsed_once_into_a_frozen_checked_object(tmp_path):
    opts = qs.parse_options(["--out", str(tmp_path / "o"), "--assets", str(tmp_path / "a"), "--methods", "grpo, stapo",
                             "--prompts", "6", "--seed", "3", "--seeds", "2", "--test-freq", "4", "--lr", "2e-4"])
    assert (opts.methods, opts.prompts, opts.mini_batch, opts.seeds, opts.test_freq, opts.lr) == (
        ("grpo", "stapo"), 6, 3, (3, 4), 4, 2e-4)
    assert opts.out == (tmp_path / "o").resolve() and opts.study
    assert opts.run_dir("stapo", 4) == opts.out / "seed4" / "stapo"
    assert qs.parse_options(["--out", str(tmp_path / "o"), "--prompts", "5"]).mini_batch == 5  # odd: one mini-batch
    with pytest.raises(AttributeError):
        opts.lr = 1.0  # frozen
    with pytest.raises(qs.OptionError, match="--lr must be a positive finite number"):
        dataclasses.replace(opts, lr=float("nan"))  # every instance is checked, not only the parsed ones


# ------------------------------------------------------------------------------------------------
# the study: one command, shown alike everywhere
# ------------------------------------------------------------------------------------------------

STUDY = "bash run_scripts/quickstart.sh --out results/study --seeds 3 --test-freq 8"


def _bash_lines(path: Path) -> list[str]:
    """The lines of the ```bash blocks of a markdown file."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
        elif inside:
            lines.append(line)
    return lines


def test_the_study_is_one_command_that_every_document_shows(tmp_path, monkeypatch):
    """Every line of the docs, the quickstart script and module that gives a number of seeds is the
    study's one command; docs/miniature.md shows it as a command. Its options, as
    written, are the study's (the study itself trains 12 runs, 22 minutes: docs/miniature.md)."""
    import re
    import shlex

    from recipe.stapo.methods import PAPER_METHODS
    from tests.helpers.paths import REPO

    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "run_scripts" / "quickstart.sh",
               REPO / "stapo_cpu" / "quickstart.py"]
    for source in sources:
        for line in source.read_text().splitlines():
            if re.search(r"--seeds \d", line):
                assert STUDY in line, f"{source}: {line}"
    assert STUDY in _bash_lines(REPO / "docs" / "miniature.md")
    monkeypatch.chdir(tmp_path)
    opts = qs.parse_options(shlex.split(STUDY)[2:])
    assert (opts.study, opts.seeds, opts.test_freq, opts.steps, opts.methods) == (True, (0, 1, 2), 8, 16, PAPER_METHODS)
    assert opts.out == tmp_path / "results" / "study"


EVALUATE = "bash run_scripts/quickstart.sh --evaluate"


def test_the_whole_pipeline_is_one_documented_command(tmp_path, monkeypatch):
    """docs/miniature.md shows ``--evaluate`` as a command; as written it is the quickstart's four runs,
    each saving its final checkpoint, then their evaluation (the work itself: the tests above and
    tests/stapo_cpu/test_quickstart_evaluate_on_cpu.py; its numbers: docs/miniature.md)."""
    import shlex

    from recipe.stapo.methods import PAPER_METHODS
    from tests.helpers.paths import REPO

    assert EVALUATE in _bash_lines(REPO / "docs" / "miniature.md")
    monkeypatch.chdir(tmp_path)
    opts = qs.parse_options(shlex.split(EVALUATE)[2:])
    assert (opts.evaluate, opts.seeds, opts.steps, opts.methods) == (True, (0,), 16, PAPER_METHODS)
    assert qs.run_kwargs(opts, 0)["save_freq"] == 16 and opts.checkpoint("stapo", 0) == (
        tmp_path / "results" / "quickstart" / "stapo" / "checkpoints" / "global_step_16")


# ------------------------------------------------------------------------------------------------
# the per-run limit (--timeout): a run past it is stopped, named as stopped, and the tools reading
# its folder say so
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_past_its_limit_is_reported_stopped_and_the_tools_reading_it_say_so(assets, tmp_path, capsys):
    """``--timeout 1``: verl's trainer cannot get past its imports in a second, so the runner kills
    each run at its limit. The summary names the limit to raise (not "FAILED: exit -9"), and inspect,
    plots and bench_e2e, given the stopped runs, say they were stopped instead of advising how to turn
    on what was on."""
    import re

    from benchmarks import bench_e2e
    from recipe.stapo import inspect as insp
    from recipe.stapo import plots

    out = tmp_path / "out"
    assert qs.main(["--out", str(out), "--assets", str(assets), "--methods", "justrl,stapo", "--steps", "2",
                    "--timeout", "1"]) == 1
    printed = capsys.readouterr()
    summary = (out / "summary.md").read_text()
    for method in ("justrl", "stapo"):
        reason = (r"stopped after \d+ s \(the quickstart's limit per run, --timeout 1\) with 0 of 2 steps logged: "
                  r"raise --timeout")
        assert re.search(rf"^\| {method} \| {reason} \|", summary, re.MULTILINE), summary
        assert re.search(rf"^\[quickstart\] {method}: {reason}$", printed.err, re.MULTILINE), printed.err
        record = json.loads((out / method / "stopped.json").read_text())
        assert re.fullmatch(rf"run {method} {reason}", record["message"])
        assert (record["timeout_s"], record["steps_logged"], record["steps"]) == (1, 0, 2) and record["wall_s"] >= 1
    assert "FAILED" not in summary and "exit -9" not in summary
    assert "Update effect" not in summary and "Update effect" not in printed.out  # no run measured it

    assert insp.main([str(out / "stapo")]) == 1
    err = capsys.readouterr().err
    assert "no token dump to inspect: run stapo stopped after" in err and "recipe.token_dump.dir" not in err
    assert plots.main([str(out / "justrl"), str(out / "stapo"), "--out", str(tmp_path / "figs")]) == 2
    err = capsys.readouterr().err
    assert "nothing to plot: run justrl stopped after" in err and "trainer.logger" not in err
    assert bench_e2e.main(["--from-quickstart", str(out)]) == 2
    err = capsys.readouterr().err
    assert "run justrl stopped after" in err and "raise --timeout, before logging a step" in err
    assert "trainer.logger" not in err and "timing enabled" not in err
