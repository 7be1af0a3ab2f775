"""recipe.stapo.plots on synthetic runs whose metrics are written by verl's own FileLogger."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from recipe.stapo import plots

STEPS = list(range(1, 9))


def _metrics(method: str, step: int) -> dict:
    """Deterministic, method-dependent per-step metrics (numpy scalars, as verl logs them)."""
    rng = np.random.default_rng([sum(map(ord, method)), step])
    data = {
        "critic/score/mean": np.float64(-1 + step / 5 + rng.normal(0, 0.05)),
        "critic/rewards/mean": np.float64(-5.0),  # must not be used while score/mean exists
        "actor/entropy": float(0.8 - 0.03 * step + rng.normal(0, 0.01)),
        "response_length/mean": float(100 + 3 * step),
        "actor/pg_loss": float(rng.normal()),
        "perf/time_per_step": "not-a-number",  # non-numeric values are skipped
    }
    if method == "stapo":
        data["actor/s2t/silenced_frac"] = 0.0 if step % 3 == 0 else 1e-4 * step
    # the update effect: every method; a step without silenced tokens logs no mean for them
    for name, scale in (("silenced", 1.0), ("kept_candidates", 0.5), ("all", 0.1)):
        tokens = 0 if name == "silenced" and step % 4 == 0 else step + len(name)
        data[f"actor/s2t/dlogp_{name}_tokens"] = float(tokens)
        if tokens:
            data[f"actor/s2t/dlogp_{name}"] = float(scale * rng.normal())
    return data


def _val(step: int) -> dict:
    return {"val-core/aime24/acc/mean@4": 0.1 + 0.01 * step, "val-aux/aime24/acc/std@4": 0.5,
            "val-core/aime24/acc/mean@2": 99.0}  # the largest N wins


def _log_run(monkeypatch, path: Path, method: str, with_val: bool = True) -> dict:
    """Write a run's metrics with verl's FileLogger at ``path``; return {metric: {step: value}}."""
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = FileLogger("stapo_test", method)
    logged: dict = {}

    def log(data, step):
        logger.log(data=data, step=step)
        for k, v in data.items():
            logged.setdefault(k, {})[step] = v

    if with_val:
        log(_val(0), 0)  # val_before_train is logged on its own line
    for step in STEPS:
        log(_metrics(method, step) | (_val(step) if with_val and step == STEPS[-1] else {}), step)
    logger.finish()
    return logged


@pytest.fixture()
def two_runs(tmp_path, monkeypatch):
    """stapo at the default path; justrl nested as verl's default <root>/<project>/<experiment>.jsonl."""
    stapo = tmp_path / "stapo"
    justrl = tmp_path / "justrl"
    logged = {
        "stapo": _log_run(monkeypatch, stapo / "metrics.jsonl", "stapo"),
        "justrl": _log_run(monkeypatch, justrl / "stapo_test" / "justrl.jsonl", "justrl", with_val=False),
    }
    (justrl / "notes.jsonl").write_text('{"no": "step"}\n')  # not a step record: ignored by the search
    return {"stapo": stapo, "justrl": justrl}, logged


def test_file_logger_format_is_step_and_data(two_runs):
    import json

    runs, _ = two_runs
    first = json.loads((runs["stapo"] / "metrics.jsonl").read_text().splitlines()[0])
    assert set(first) == {"step", "data"} and first["step"] == 0


def test_find_metrics_file_rule(two_runs, tmp_path):
    runs, _ = two_runs
    assert plots.find_metrics_file(runs["stapo"]) == runs["stapo"] / "metrics.jsonl"
    assert plots.find_metrics_file(runs["justrl"]) == runs["justrl"] / "stapo_test" / "justrl.jsonl"
    direct = runs["justrl"] / "stapo_test" / "justrl.jsonl"
    assert plots.find_metrics_file(direct) == direct
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics JSONL"):
        plots.find_metrics_file(empty)
    (runs["justrl"] / "other.jsonl").write_text('{"step": 1, "data": {}}\n')
    with pytest.raises(ValueError, match="several metrics files"):
        plots.find_metrics_file(runs["justrl"])


def test_series_equal_logged_values(two_runs):
    runs, logged = two_runs
    metrics = plots.read_metrics(plots.find_metrics_file(runs["stapo"]))
    for key in ("critic/score/mean", "actor/entropy", "actor/s2t/silenced_frac", "val-core/aime24/acc/mean@4"):
        steps, values = metrics[key]
        assert steps == sorted(logged["stapo"][key])
        np.testing.assert_array_equal(values, [float(logged["stapo"][key][s]) for s in steps])
    assert "perf/time_per_step" not in metrics
    assert metrics["val-core/aime24/acc/mean@4"][0] == [0, STEPS[-1]]


def test_plotted_lines_equal_logged_values(two_runs):
    runs, logged = two_runs
    loaded = plots.load_runs(runs, progress=False)
    fig = plots.summary_figure(loaded)
    axes = fig.axes
    expected = {
        "reward": ("critic/score/mean", ["stapo", "justrl"]),
        "entropy": ("actor/entropy", ["stapo", "justrl"]),
        "response_length": ("response_length/mean", ["stapo", "justrl"]),
        "silenced_frac": ("actor/s2t/silenced_frac", ["stapo"]),  # justrl has none: skipped
        "val_accuracy": ("val-core/aime24/acc/mean@4", ["stapo"]),
    }
    for ax, panel in zip(axes, plots.PANELS):
        if panel.name == "dlogp":
            continue  # below: three lines per run
        key, methods = expected[panel.name]
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == methods, panel.name
        for line, method in zip(lines, methods):
            steps = sorted(logged[method][key])
            np.testing.assert_array_equal(line.get_xdata(), steps)
            np.testing.assert_array_equal(line.get_ydata(), [float(logged[method][key][s]) for s in steps])
    silenced_ax = axes[[p.name for p in plots.PANELS].index("silenced_frac")]
    assert silenced_ax.get_yscale() == "symlog"  # zeros stay on the plot
    effect = axes[[p.name for p in plots.PANELS].index("dlogp")].get_lines()
    sets = (("silenced", "--"), ("kept_candidates", ":"), ("all", "-"))
    assert [line.get_label() for line in effect] == [f"{m} ({n.replace('_', ' ')})" for m in ("stapo", "justrl")
                                                    for n, _ in sets]
    assert [line.get_linestyle() for line in effect] == [style for _ in range(2) for _, style in sets]
    for line in effect:
        method, name = line.get_label().split(" (")
        key = f"actor/s2t/dlogp_{name[:-1].replace(' ', '_')}"
        steps = sorted(logged[method][key])
        assert len(steps) < len(STEPS) if name.startswith("silenced") else len(steps) == len(STEPS)
        np.testing.assert_array_equal(line.get_xdata(), steps)
        np.testing.assert_array_equal(line.get_ydata(), [logged[method][key][s] for s in steps])
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_runs_writes_pngs(two_runs, tmp_path):
    runs, _ = two_runs
    notes: list = []
    out = tmp_path / "figs"
    paths = plots.plot_runs([runs["stapo"], runs["justrl"]], out, notes=notes)
    names = sorted(p.name for p in paths)
    assert names == sorted(["curves.png"] + [f"{p.name}.png" for p in plots.PANELS])
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert any("justrl" in n and "silenced_frac" in n for n in notes)
    assert any("justrl" in n and "val_accuracy" in n for n in notes)
    assert not any(n.startswith("stapo:") for n in notes)


def test_missing_metric_skipped_not_crash(tmp_path, monkeypatch):
    run = tmp_path / "bare"
    _log_run(monkeypatch, run / "metrics.jsonl", "justrl", with_val=False)
    paths = plots.plot_runs([run], tmp_path / "out")
    assert (tmp_path / "out" / "curves.png") in paths
    assert not (tmp_path / "out" / "silenced_frac.png").exists()


def test_rewards_mean_fallback_and_flat_records(tmp_path):
    path = tmp_path / "flat.jsonl"
    path.write_text('{"step": 1, "critic/rewards/mean": 0.5}\n{"step": 2, "critic/rewards/mean": 0.75}\n')
    lines = plots.panel_lines(plots.PANELS[0], {"flat": plots.read_metrics(path)})
    assert lines == {"flat": ([1, 2], [0.5, 0.75])}


def test_all_zero_silenced_fraction_is_finite_on_log_axis(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "data": {{"actor/s2t/silenced_frac": 0.0}}}}\n' for s in range(3)))
    paths = plots.plot_runs({"zeros": path}, tmp_path / "out")
    assert (tmp_path / "out" / "silenced_frac.png") in paths


def test_truncated_last_line_tolerated(two_runs):
    runs, logged = two_runs
    path = runs["stapo"] / "metrics.jsonl"
    with open(path, "a") as handle:
        handle.write('{"step": 9, "data": {"actor/entro')
    with pytest.warns(UserWarning, match="truncated last line"):
        metrics = plots.read_metrics(path)
    assert metrics["actor/entropy"][0] == STEPS


@pytest.mark.parametrize("bad, line, message", [
    ('{"step": 1, "data": {}}\n\n{"step": 2, "data": {}}\n', 2, "line 2 is empty"),
    ('{"step": 1, "data": {}}\n{"step": 2, "data": {\n{"step": 3, "data": {}}\n', 2, "line 2 is not valid JSON"),
    ('{"step": 1, "data": {}}\n["step", 2]\n', 2, "line 2 is not a step record"),
    ('{"step": 1, "data": 3}\n', 1, "line 1: 'data' must be a JSON object"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, line, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(bad)
    with pytest.raises(ValueError, match=message) as info:
        plots.read_metrics(path)
    assert str(path) in str(info.value)


def test_cli(two_runs, tmp_path, capsys):
    runs, _ = two_runs
    out = tmp_path / "cli"
    rc = plots.main([str(runs["stapo"]), str(runs["justrl"]), "--out", str(out), "--labels", "STAPO", "JustRL"])
    assert rc == 0
    assert (out / "curves.png").is_file()
    printed = capsys.readouterr()
    assert "JustRL: no actor/s2t/silenced_frac" in printed.err
    assert plots.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "no such run folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plots.main([str(runs["stapo"]), "--out", str(out), "--labels", "a", "b"])


def test_cli_writes_the_update_effect_figure_docs_inspect_md_promises(two_runs, tmp_path, capsys):
    from tests.helpers.paths import REPO

    runs, _ = two_runs
    out = tmp_path / "figs"
    assert plots.main([str(runs["stapo"]), str(runs["justrl"]), "--out", str(out)]) == 0
    assert (out / "update_effect.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out / "update_effect.png") in capsys.readouterr().out.splitlines()
    docs = (REPO / "docs" / "inspect.md").read_text()
    assert "python -m recipe.stapo.plots results/justrl results/stapo --out figs" in docs
    assert "`figs/update_effect.png`" in docs


def test_cli_names_a_run_the_quickstart_stopped_at_its_limit(two_runs, tmp_path, capsys):
    """With the steps it logged, the stopped run is plotted and named; stopped before its first step,
    the error says so, not how to configure a logger that was configured."""
    from stapo_cpu.quickstart import record_stop

    runs, _ = two_runs
    record_stop(runs["stapo"], "stapo", 1200.2, 1200, 8, 16)
    assert plots.main([str(runs["stapo"]), str(runs["justrl"]), "--out", str(tmp_path / "a")]) == 0
    assert ("note: stapo: run stapo stopped after 1200 s (the quickstart's limit per run, --timeout 1200) with 8 of 16 "
            "steps logged: raise --timeout; its curves end where it stopped") in capsys.readouterr().err

    early = tmp_path / "early"
    early.mkdir()
    (early / "metrics.jsonl").write_text("")  # verl's file logger opened it, then the run was stopped
    record_stop(early, "justrl", 1200.0, 1200, 0, 16)
    assert plots.main([str(runs["stapo"]), str(early), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert (f"error: {early}: nothing to plot: run justrl stopped after 1200 s (the quickstart's limit per run, "
            "--timeout 1200) with 0 of 16 steps logged: raise --timeout, before logging a step") in err
    assert "trainer.logger" not in err and not (tmp_path / "b").exists()


def test_duplicate_folder_names_need_labels(tmp_path):
    for parent in ("a", "b"):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "metrics.jsonl").write_text('{"step": 1, "data": {"actor/entropy": 1.0}}\n')
    with pytest.raises(ValueError, match="labelled 'run'"):
        plots.plot_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"], tmp_path / "out")


# --------------------------------------------------------------------------------------------
# study mode: bands across seeds
# --------------------------------------------------------------------------------------------


def _seed_metrics(method: str, seed: int, step: int) -> dict:
    rng = np.random.default_rng([sum(map(ord, method)), seed, step])
    data = {"critic/score/mean": float(rng.uniform(-1, 1)), "actor/entropy": float(rng.uniform(0.1, 0.5)),
            "actor/entropy_p95": float(rng.uniform(1, 2))}
    for name in ("silenced", "kept_candidates", "all"):
        data |= {f"actor/s2t/dlogp_{name}": float(rng.normal()), f"actor/s2t/dlogp_{name}_tokens": float(1 + step)}
    if method == "stapo":
        data |= {"actor/s2t/silenced_frac": float(rng.uniform(0, 1e-3)),
                 "actor/s2t/grad_norm_kept": float(rng.uniform(0, 0.1)),
                 "actor/s2t/grad_norm_kept_candidates": float(rng.uniform(0.5, 1.5)),
                 "actor/s2t/grad_norm_silenced": float(rng.uniform(0.5, 1.5))}
    return data


@pytest.fixture()
def seeded_runs(tmp_path, monkeypatch):
    """grpo and stapo, 3 seeds each; seed 2 of stapo stops one step early."""
    runs, logged = {}, {}
    for method in ("grpo", "stapo"):
        for seed in range(3):
            from verl.utils.tracking import FileLogger

            path = tmp_path / f"seed{seed}" / method / "metrics.jsonl"
            path.parent.mkdir(parents=True)
            monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
            logger = FileLogger("stapo_test", method)
            last = STEPS[-1] - (1 if (method, seed) == ("stapo", 2) else 0)
            for step in range(1, last + 1):
                data = _seed_metrics(method, seed, step)
                logger.log(data=data, step=step)
                logged.setdefault(method, {}).setdefault(seed, {})[step] = data
            logger.finish()
            runs.setdefault(method, []).append(path.parent)
    return runs, logged


def test_band_is_mean_min_max_over_seeds_with_ragged_steps():
    b = plots.band([([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 2], [3.0, 6.0])])
    assert b.steps == [1, 2, 3] and b.seeds == [2, 2, 1]
    assert b.mean == [2.0, 4.0, 3.0] and b.low == [1.0, 2.0, 3.0] and b.high == [3.0, 6.0, 3.0]


def _seed_mean(logged: dict, method: str, key: str) -> tuple[list, list]:
    """(steps, mean over the seeds that logged each step) of one metric, computed from what was logged."""
    seeds = logged[method]
    steps = sorted({s for per_seed in seeds.values() for s in per_seed})
    return steps, [np.mean([seeds[k][s][key] for k in seeds if s in seeds[k]]) for s in steps]


def test_band_figure_lines_equal_seed_means_one_colour_per_method(seeded_runs):
    runs, logged = seeded_runs
    loaded = {m: [plots.read_metrics(plots.find_metrics_file(r)) for r in dirs] for m, dirs in runs.items()}
    fig = plots.band_figure(loaded)
    axes = {name: ax for ax, (name, *_rest) in zip(fig.axes, plots.BAND_PANELS)}
    colours: dict = {}
    for name, key in (("reward", "critic/score/mean"), ("entropy", "actor/entropy"),
                      ("entropy_p95", "actor/entropy_p95"), ("silenced_frac", "actor/s2t/silenced_frac")):
        lines = axes[name].get_lines()
        methods = ["grpo", "stapo"] if name != "silenced_frac" else ["stapo"]
        assert [line.get_label() for line in lines] == methods, name
        for line, method in zip(lines, methods):
            steps, expected = _seed_mean(logged, method, key)
            np.testing.assert_array_equal(line.get_xdata(), steps)
            np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
            colours.setdefault(method, set()).add(line.get_color())
        assert len(axes[name].collections) == len(methods)  # one min-max band per method
    grad = axes["grad_norm"].get_lines()
    assert [line.get_label() for line in grad] == ["stapo (kept)", "stapo (kept candidates)", "stapo (silenced)"]
    assert [line.get_linestyle() for line in grad] == ["-", ":", "--"]
    for line, key in zip(grad, ("actor/s2t/grad_norm_kept", "actor/s2t/grad_norm_kept_candidates",
                                "actor/s2t/grad_norm_silenced")):
        steps, expected = _seed_mean(logged, "stapo", key)
        np.testing.assert_array_equal(line.get_xdata(), steps)
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
    colours["stapo"] |= {line.get_color() for line in grad}
    dlogp = axes["dlogp"].get_lines()
    assert [line.get_label() for line in dlogp] == [f"{m} ({n})" for m in ("grpo", "stapo")
                                                   for n in ("silenced", "kept candidates", "all")]
    for line in dlogp:
        method, name = line.get_label()[:-1].split(" (")
        steps, expected = _seed_mean(logged, method, f"actor/s2t/dlogp_{name.replace(' ', '_')}")
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
        colours[method].add(line.get_color())
    assert colours == {"grpo": {plots.METHOD_COLORS["grpo"]}, "stapo": {plots.METHOD_COLORS["stapo"]}}
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_update_effect_of_a_run_is_token_weighted():
    steps = {1: {"actor/s2t/dlogp_silenced": 2.0, "actor/s2t/dlogp_silenced_tokens": 1.0,
                 "actor/s2t/dlogp_all": 0.5, "actor/s2t/dlogp_all_tokens": 10.0},
             2: {"actor/s2t/dlogp_silenced": -1.0, "actor/s2t/dlogp_silenced_tokens": 3.0,
                 "actor/s2t/dlogp_all": None, "actor/s2t/dlogp_all_tokens": 10.0},  # non-finite: left out
             3: {"actor/s2t/dlogp_silenced_tokens": 0.0, "actor/s2t/dlogp_all": 1.0, "actor/s2t/dlogp_all_tokens": 30.0}}
    effect = plots.update_effect_of_run(steps)
    assert effect["silenced"] == plots.Effect((2.0 * 1 - 1.0 * 3) / 4, 4)
    assert effect["all"] == plots.Effect((0.5 * 10 + 1.0 * 30) / 40, 40)
    assert effect["kept_candidates"] == plots.Effect(None, 0)


def test_update_effect_figure_shows_each_seeds_run_mean(seeded_runs, tmp_path):
    """One marker per (method, set) at the mean over seeds of the runs' token-weighted means, with
    a min-max whisker, and one dot per seed."""
    runs, logged = seeded_runs
    effects = {m: [plots.update_effect_of_run(logged[m][seed]) for seed in sorted(logged[m])] for m in logged}
    fig = plots.update_effect_figure(effects)
    ax = fig.axes[0]
    markers = [line for line in ax.get_lines() if line.get_marker() in ("v", "o", "s")]
    dots = [c for c in ax.collections if c.get_offsets().shape[0] == 3 and c.get_offsets().shape[1] == 2]
    want = []
    for method in ("grpo", "stapo"):
        for name, *_ in plots.DLOGP_SETS:
            values = [e[name].mean for e in effects[method]]
            want.append(np.mean(values))
    np.testing.assert_allclose(sorted(float(line.get_ydata()[0]) for line in markers), sorted(want), rtol=1e-12)
    assert len(dots) == 6  # 3 seeds per (method, set)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["grpo", "stapo"]
    import matplotlib.pyplot as plt

    plt.close(fig)
    (path,) = plots.plot_update_effect(runs, tmp_path / "out")
    assert path.name == "update_effect.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.plot_update_effect({"grpo": []}, tmp_path / "none") == []  # nothing measured: no figure
    # the per-step panel of the same runs is a file of its own: the quickstart writes both into one folder
    panels = plots.plot_runs({m: dirs[0] for m, dirs in runs.items()}, tmp_path / "out")
    assert tmp_path / "out" / "dlogp.png" in panels and path not in panels
    assert len({p.name for p in panels} | {path.name}) == len(panels) + 1


def test_a_single_seed_update_effect_says_so_and_shows_token_counts():
    """One run per method: no min..max whisker claimed in the title; each marker's measured tokens beside it."""
    effects = {"stapo": [{"silenced": plots.Effect(0.01, 7), "kept_candidates": plots.Effect(0.2, 3),
                          "all": plots.Effect(0.001, 1234)}]}
    fig = plots.update_effect_figure(effects)
    ax = fig.axes[0]
    assert "whiskers" not in ax.get_title() and "one run per method" in ax.get_title()
    assert sorted(t.get_text() for t in ax.texts) == ["1,234", "3", "7"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_bands_writes_png_and_refuses_nothing(seeded_runs, tmp_path):
    runs, _ = seeded_runs
    (path,) = plots.plot_bands(runs, tmp_path / "out")
    assert path.name == "study_curves.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no runs"):
        plots.plot_bands({"grpo": []}, tmp_path / "out")


def test_run_curves_keep_one_colour_per_method(two_runs):
    runs, _ = two_runs
    fig = plots.summary_figure(plots.load_runs(runs, progress=False))
    colours = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert colours["stapo"] == {plots.METHOD_COLORS["stapo"]}  # also alone in the silenced-fraction panel
    assert colours["justrl"] == {plots.METHOD_COLORS["justrl"]}
    import matplotlib.pyplot as plt

    plt.close(fig)


def _colours_by_label(fig, runs=()) -> dict[str, set]:
    """``{run label: colours}`` over every axes of ``fig``: curve lines by their label (``"<run>
    (<variant>)"`` counts for ``<run>``, the longest of ``runs`` it starts with, else the text before
    " ("), the update effect's markers by the tick under them."""
    colours: dict = {}
    for ax in fig.axes:
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith("_") and ticks and len(line.get_xdata()) == 1:  # an update-effect marker
                label = ticks[round(float(line.get_xdata()[0]))]
            if not label.startswith("_"):
                run = max((r for r in runs if label == r or label.startswith(f"{r} (")), key=len, default=None)
                colours.setdefault(run or label.split(" (")[0], set()).add(line.get_color())
    return colours


def test_labels_keep_one_colour_each_in_every_panel_and_figure(two_runs, tmp_path, monkeypatch):
    """``plots --labels``: a label naming a method in any case gets its method's colour, in every panel
    of every figure (curves, one file per panel, the update effect); another label one colour of its own,
    also when it holds " (" as the update-effect panel's line labels do."""
    runs, _ = two_runs
    mine = tmp_path / "mine"
    _log_run(monkeypatch, mine / "metrics.jsonl", "mine", with_val=False)
    figures = []
    labels = ["STAPO", "JustRL", "Mine (lr 1e-3)"]
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(_colours_by_label(fig, labels)) or path)
    rc = plots.main([str(runs["stapo"]), str(runs["justrl"]), str(mine), "--out", str(tmp_path / "out"),
                     "--labels", *labels])
    assert rc == 0 and len(figures) > 3
    seen: dict = {}
    for colours in figures:
        for label, found in colours.items():
            seen.setdefault(label, set()).update(found)
    assert seen["STAPO"] == {plots.METHOD_COLORS["stapo"]}
    assert seen["JustRL"] == {plots.METHOD_COLORS["justrl"]}
    assert len(seen[labels[2]]) == 1 and seen[labels[2]].isdisjoint(seen["STAPO"] | seen["JustRL"])
    assert set(figures[-1]) == set(labels)  # the update effect, saved last, colours all three


# --------------------------------------------------------------------------------------------
# non-finite values: marked on the figure and named in the notes, never dropped silently
# --------------------------------------------------------------------------------------------


def _axes(fig, names):
    return dict(zip(names, fig.axes))


def _line(ax, label):
    return next(line for line in ax.get_lines() if line.get_label() == label)


@pytest.fixture()
def diverged(tmp_path, monkeypatch):
    """stapo logged by verl's FileLogger with NaN at step 3 and inf at step 5 of the reward (written
    as null); flat lines written by Python's json with NaN and -Infinity in the entropy."""
    from verl.utils.tracking import FileLogger

    path = tmp_path / "stapo" / "metrics.jsonl"
    path.parent.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("stapo_test", "stapo")
    for step in STEPS:
        reward = {3: float("nan"), 5: float("inf")}.get(step, step / 10)
        logger.log(data={"critic/score/mean": reward, "actor/entropy": 1 - step / 10}, step=step)
    logger.finish()
    assert '"critic/score/mean":null' in path.read_text()  # what verl writes for NaN and inf
    flat = tmp_path / "flat.jsonl"
    flat.write_text('{"step": 1, "actor/entropy": NaN}\n{"step": 2, "actor/entropy": -Infinity}\n'
                    '{"step": 3, "actor/entropy": 0.5}\n{"step": 4, "actor/entropy": Infinity}\n')
    return {"stapo": path.parent, "flat": flat}


def test_nonfinite_values_are_marked_and_the_line_breaks(diverged):
    import matplotlib.pyplot as plt

    fig = plots.summary_figure(plots.load_runs(diverged, progress=False))
    axes = _axes(fig, [p.name for p in plots.PANELS])
    reward = _line(axes["reward"], "stapo")
    np.testing.assert_array_equal(reward.get_xdata(), STEPS)  # steps 3 and 5 are on the line, as gaps
    expected = [math.nan if s in (3, 5) else s / 10 for s in STEPS]
    np.testing.assert_array_equal(reward.get_ydata(), expected)
    mark = _line(axes["reward"], "stapo: NaN/inf (null)")
    assert list(mark.get_xdata()) == [3, 5] and list(mark.get_ydata()) == [0.96, 0.96]
    assert mark.get_marker() == "x" and mark.get_color() == plots.METHOD_COLORS["stapo"]
    assert mark.get_transform() == axes["reward"].get_xaxis_transform()  # height in axes coordinates
    entropy = axes["entropy"]
    for label, steps, height, marker in (("flat: NaN", [1], 0.96, "x"), ("flat: -inf", [2], 0.04, "v"),
                                         ("flat: +inf", [4], 0.96, "^")):
        line = _line(entropy, label)
        assert list(line.get_xdata()) == steps and list(line.get_ydata()) == [height] and line.get_marker() == marker
    np.testing.assert_array_equal(_line(entropy, "flat").get_ydata(), [math.nan, math.nan, 0.5, math.nan])
    assert axes["entropy"].get_ylim()[0] > 0  # the marks never move the y range (entropy >= 0.2 here)
    assert "stapo: NaN/inf (null)" in [t.get_text() for t in axes["reward"].get_legend().get_texts()]
    plt.close(fig)


def test_nonfinite_values_are_named_in_the_notes(diverged, tmp_path, capsys):
    notes: list = []
    plots.plot_runs(diverged, tmp_path / "out", notes=notes)
    assert ("stapo: critic/score/mean is not finite at 2 step(s) (step 3 NaN/inf (null), step 5 NaN/inf (null)); "
            "marked on 'reward', left out of its line") in notes
    assert ("flat: actor/entropy is not finite at 3 step(s) (step 1 NaN, step 2 -inf, step 4 +inf); "
            "marked on 'entropy', left out of its line") in notes
    assert "note: stapo: critic/score/mean is not finite" in capsys.readouterr().err
    assert plots.main([str(diverged["flat"]), "--out", str(tmp_path / "cli")]) == 0
    assert "note: flat: actor/entropy is not finite at 3 step(s)" in capsys.readouterr().err


def test_metric_nonfinite_at_every_step_is_marked_not_called_missing(tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "data": {{"actor/entropy": null, "critic/score/mean": {s}}}}}\n'
                            for s in (1, 2)))
    runs = {"dead": path}
    notes: list = []
    paths = plots.plot_runs(runs, tmp_path / "out", notes=notes)
    assert (tmp_path / "out" / "entropy.png") in paths
    assert not any("no actor/entropy" in n for n in notes)
    assert any(n.startswith("dead: actor/entropy is not finite at 2 step(s)") for n in notes)
    fig = plots.summary_figure(plots.load_runs(runs, progress=False))
    entropy = _axes(fig, [p.name for p in plots.PANELS])["entropy"]
    assert list(_line(entropy, "dead: NaN/inf (null)").get_xdata()) == [1, 2]
    assert not [t for t in entropy.texts if "not logged" in t.get_text()]
    plt.close(fig)


def test_band_figure_marks_nonfinite_seed_values(seeded_runs, tmp_path):
    import json

    import matplotlib.pyplot as plt

    runs, logged = seeded_runs
    path = runs["stapo"][1] / "metrics.jsonl"  # seed 1 of stapo diverges at step 4
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for record in lines:
        if record["step"] == 4:
            record["data"]["critic/score/mean"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    loaded = {m: [plots.read_metrics(plots.find_metrics_file(r)) for r in dirs] for m, dirs in runs.items()}
    fig = plots.band_figure(loaded)
    reward = dict(zip([p[0] for p in plots.BAND_PANELS], fig.axes))["reward"]
    stapo = _line(reward, "stapo")
    at4 = list(stapo.get_xdata()).index(4)
    expected = np.mean([logged["stapo"][seed][4]["critic/score/mean"] for seed in (0, 2)])  # seeds 0 and 2 only
    assert stapo.get_ydata()[at4] == pytest.approx(expected, rel=1e-12)
    assert list(_line(reward, "stapo: NaN/inf (null)").get_xdata()) == [4]
    plt.close(fig)
    notes: list = []
    plots.plot_bands(runs, tmp_path / "out", notes=notes)
    assert notes == ["stapo (run 2 of 3): critic/score/mean is not finite at 1 step(s) (step 4 NaN/inf (null)); "
                     "marked on 'reward', left out of the band"]


def test_out_pointing_at_a_file_is_a_clear_error(two_runs, tmp_path, capsys):
    runs, _ = two_runs
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert plots.main([str(runs["stapo"]), "--out", str(afile)]) == 2
    assert f"error: --out {afile} is a file, not a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot be created"):
        plots.plot_bands({"stapo": [runs["stapo"]]}, afile / "sub")
    assert afile.read_text() == "x"


def test_values_near_the_float_maximum_are_marked_not_drawn(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    values = {1: 0.5, 2: 1.7e308, 3: -1.7e308, 4: 0.25}
    path.write_text("".join(json.dumps({"step": s, "data": {"critic/score/mean": v}}) + "\n" for s, v in values.items()))
    assert plots.main([str(path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "critic/score/mean is not finite or beyond +-1e300 at 2 step(s) (step 2 > 1e300, step 3 < -1e300)" in err
    assert (tmp_path / "out" / "reward.png").is_file()
    assert plots.read_metrics(path)["critic/score/mean"] == ([1, 4], [0.5, 0.25])


@pytest.mark.parametrize("content, why", [(b"", "an empty metrics file"),
                                          (b"\0" * 64, "its 64 bytes hold no complete line"),
                                          (b'{"step": 1, "data": {"a"', "its 24 bytes hold no complete line")])
def test_an_empty_metrics_file_is_an_error_naming_it(tmp_path, capsys, content, why):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    assert plots.main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {path}: no step records ({why}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
