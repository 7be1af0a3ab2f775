"""Smoke tests of the benchmarks (tiny sizes, seconds): the printed tables have the expected rows
and finite ratios, the measured call is the loss it claims to be, and bench_e2e reads what verl's
own FileLogger writes. No timing assertion."""

from __future__ import annotations

import math
import re
import statistics

import pytest
import torch

from benchmarks import bench_e2e, bench_loss
from tests.helpers.reference_loss import clipped_policy_loss

QUICK = ["--quick", "--repeats", "2", "--shapes", "1x96,2x48", "--vocab", "2048", "--d", "16"]


def table_rows(text: str) -> list[list[str]]:
    """Body rows of the markdown table(s) in ``text`` (header and separator lines dropped)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return [r for r in rows if not set(r[0]) <= {"-"} and r[0] not in ("mode", "phase")]


def _finite(cell: str) -> bool:
    try:
        return math.isfinite(float(cell))
    except ValueError:
        return False


# --------------------------------------------------------------------------------------------
# bench_loss
# --------------------------------------------------------------------------------------------


def test_bench_loss_quick_prints_every_mode_and_shape(capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    assert bench_loss.main([*QUICK, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    rows = table_rows(text)
    expected = {(mode, shape) for mode in bench_loss.MODES for shape in ("1x96", "2x48")}
    assert {(r[0], r[1].split()[0]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        mode, median_ms, ratio_time, peak_mb, ratio_mem, verdict = r[0], r[2], r[3], r[4], r[5], r[7]
        assert _finite(median_ms) and float(median_ms) > 0, r
        assert _finite(ratio_time) and float(ratio_time) > 0, r
        assert _finite(peak_mb) and float(peak_mb) >= 0 and _finite(ratio_mem) and float(ratio_mem) > 0, r
        if mode == "vanilla":
            assert float(ratio_time) == 1.0 and float(ratio_mem) == 1.0
        if bench_loss.MODES[mode].target is None:
            assert verdict == "-"
        else:  # a --quick run is too small to hold a mode to its target
            assert verdict == bench_loss.QUICK_VERDICT, verdict
    assert "d=16" in text and "S2T alone" in text
    assert out_json.is_file() and len(out_json.read_text()) > 0


def test_selected_modes_bring_their_references():
    names = [m.name for m in bench_loss._selected_modes("stapo-current")]
    assert names == ["vanilla", "vanilla+entropy", "stapo-current"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--shapes", "8by4096"], "--shapes"),
        (["--quick", "--shapes", "0x16"], "--shapes"),
        (["--quick", "--modes", "stapo,nope"], "unknown mode"),
        (["--quick", "--entropy-chunk", "-1"], "--entropy-chunk"),
        (["--quick", "--repeats", "0"], "--repeats"),
        (["--quick", "--logit-scale", "8"], "--logit-scale"),
        (["--quick", "--logit-scale", "4,2"], "--logit-scale"),
    ],
)
def test_bench_loss_bad_arguments_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_loss.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_measured_call_is_the_clipped_loss_and_s2t_has_work():
    """The timed vanilla call gives JustRL's loss computed independently (log-softmax over the
    full vocabulary, stapo_core's clipped surrogate); the benchmark batch has S2T candidates."""
    inputs = bench_loss.make_inputs(2, 40, vocab=512, d=8, prompt_len=5, device="cpu", seed=3)
    entropy_fn = bench_loss.entropy_function(16)
    vanilla = bench_loss.MODES["vanilla"]
    loss = bench_loss.loss_step(vanilla, inputs, bench_loss.make_batch(inputs, vanilla), entropy_fn)

    f = inputs.fields
    with torch.no_grad():
        flat = torch.log_softmax(inputs.hidden @ inputs.weight, -1).gather(-1, inputs.labels[:, None]).squeeze(-1)
    lengths = f["response_mask"].sum(1).tolist()
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + 5 + n)
    padded = torch.zeros(2, 40)
    for i, n in enumerate(lengths):  # output at position p predicts token p + 1
        padded[i, :n] = flat[starts[i] + 4 : starts[i] + 4 + n]
    ref, _ = clipped_policy_loss(padded, f["old_log_probs"], f["advantages"], f["response_mask"].float(),
                                 clip_low=0.2, clip_high=0.28, clip_c=3.0)
    torch.testing.assert_close(loss, ref)
    assert inputs.hidden.grad is not None and inputs.weight.grad is not None

    stapo = bench_loss.MODES["stapo-rollout"]
    data = bench_loss.make_batch(inputs, stapo)
    from verl_patches.token_selection import fold_into_mini_batch

    metrics = fold_into_mini_batch(bench_loss.actor_config(stapo.name).policy_loss, data)
    assert metrics["s2t/candidates"] > 0 and metrics["s2t/silenced"] > 0


def test_proposed_entropy_fixes_give_the_same_loss_and_gradient():
    """stapo-current with verl's entropy (with grad), without grad, and only at the candidate
    positions: the same S2T mask, so the same loss and gradients (entropy_coeff = 0)."""
    inputs = bench_loss.make_inputs(2, 48, vocab=1024, d=8, prompt_len=4, device="cpu", seed=5)
    entropy_fn = bench_loss.entropy_function(32)
    results = {}
    for name in ("stapo-current", "stapo-current-nograd", "stapo-current-candidates"):
        mode = bench_loss.MODES[name]
        data = bench_loss._prepare(mode, inputs)
        loss = bench_loss.loss_step(mode, inputs, data, entropy_fn)
        results[name] = (loss, inputs.hidden.grad.clone(), inputs.weight.grad.clone())
    ref = results["stapo-current"]
    for name in ("stapo-current-nograd", "stapo-current-candidates"):
        for got, want in zip(results[name], ref):
            torch.testing.assert_close(got, want)

    # the candidate-only entropy is the full entropy at the candidates, 0 elsewhere, and S2T silences tokens here
    from stapo_core import s2t_mask

    with torch.no_grad():
        logits = inputs.hidden @ inputs.weight
        log_probs = torch.log_softmax(logits, -1).gather(-1, inputs.labels[:, None]).squeeze(-1)
        full = bench_loss.entropy_function(0)(logits)
        partial = bench_loss.candidate_entropy(logits, log_probs, inputs.flat_positive, 0.002, entropy_fn)
    candidates = inputs.flat_positive & (log_probs.exp() < 0.002)
    assert candidates.any() and not candidates.all()
    torch.testing.assert_close(partial[candidates], full[candidates])
    assert torch.all(partial[~candidates] == 0)
    f = inputs.fields
    mask = s2t_mask(bench_loss._flat_to_padded(log_probs, f), bench_loss._flat_to_padded(full, f), f["advantages"],
                    f["response_mask"])
    assert mask.stats["silenced"] > 0


def test_verdict_rules():
    current = bench_loss.MODES["stapo-current"]  # time <= 1.10x vanilla, mem <= vanilla+entropy
    peaks = {"vanilla": 100.0, "vanilla+entropy": 300.0, "stapo-current": 300.0}
    assert bench_loss.verdict(current, 1.10, peaks) == "PASS"
    assert bench_loss.verdict(current, 1.11, peaks) == "MISS (time)"
    over = dict(peaks, **{"stapo-current": 300.0 * 1.01 + 1.5})
    assert bench_loss.verdict(current, 1.0, over) == "MISS (mem)"
    assert bench_loss.verdict(current, 2.0, over) == "MISS (time, mem)"
    assert bench_loss.verdict(current, 1.0, {}) == "PASS (time; mem not measured)"
    assert bench_loss.verdict(bench_loss.MODES["entropy_topk"], 5.0, peaks) == "-"


@pytest.mark.slow
def test_memory_probe_in_a_fresh_process():
    """``--memory subprocess``: the child measures the peak of one call; the logits alone
    (T x V float32) must show up in it."""
    args = bench_loss.parse_args(["--quick", "--vocab", "16384", "--d", "16", "--shapes", "1x256"])
    peak = bench_loss.peak_memory_subprocess(args, "vanilla", (1, 256))
    logits_mb = (256 + args.prompt_len) * 16384 * 4 / 2**20
    assert logits_mb <= peak < 20 * logits_mb


# --------------------------------------------------------------------------------------------
# bench_e2e
# --------------------------------------------------------------------------------------------

PHASES = {"gen": 2.0, "old_log_prob": 0.5, "update_actor": 3.0, "step": 6.0}
FACTORS = {"gen": 1.0, "old_log_prob": 1.1, "update_actor": 1.25, "step": 1.125}


def write_run(path, factor_of, steps=5, warmup_factor=10.0):
    """A run logged by verl's own FileLogger as the quickstart's are: a validation before training
    (step 0, no timing), then per phase ``base * factor * (1 + 0.01 * step)``; step 1 is
    ``warmup_factor`` times slower (a warm-up step the median must skip)."""
    import os

    from verl.utils.tracking import FileLogger

    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        logger = FileLogger("bench", "e2e")
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
    logger.log(data={"val-core/tiny/acc/mean@1": 0.5}, step=0)
    for step in range(1, steps + 1):
        slow = warmup_factor if step == 1 else 1.0
        data = {f"timing_s/{p}": base * factor_of(p) * (1 + 0.01 * step) * slow for p, base in PHASES.items()}
        data["critic/score/mean"] = 0.5
        logger.log(data=data, step=step)
    logger.finish()


def test_bench_e2e_ratios_from_verl_file_logger(tmp_path, capsys):
    (tmp_path / "justrl").mkdir()
    (tmp_path / "stapo").mkdir()
    write_run(tmp_path / "justrl" / "metrics.jsonl", lambda p: 1.0)
    write_run(tmp_path / "stapo" / "metrics.jsonl", FACTORS.get, warmup_factor=1.0)
    assert bench_e2e.main(["--from-quickstart", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step(s) [1] skipped as warm-up" in out  # the first training step, not the validation before it
    rows = {r[0]: r for r in table_rows(out)}
    assert list(rows) == ["gen", "old_log_prob", "update_actor", "step"]
    for phase, r in rows.items():
        assert float(r[3]) == pytest.approx(FACTORS[phase], abs=5e-4) and r[4] == "4"
        # medians over steps 2..5 (step 1 skipped): step 3 and 4 average -> factor 1.035
        assert float(r[1]) == pytest.approx(PHASES[phase] * 1.035, abs=1e-3)  # printed to 3 decimals

    # without skipping the warm-up step, JustRL's slow step 1 enters: medians of steps 1..5
    rows0 = bench_e2e.compare(bench_e2e.load_run(tmp_path / "justrl"), bench_e2e.load_run(tmp_path / "stapo"),
                              warmup_steps=0)
    for r in rows0:
        assert r.n == 5 and r.baseline_s == pytest.approx(PHASES[r.phase] * 1.04, abs=5e-4)
    # the positional form: a .jsonl file and a run folder
    assert bench_e2e.main([str(tmp_path / "justrl" / "metrics.jsonl"), str(tmp_path / "stapo")]) == 0


def test_bench_e2e_degenerate_and_bad_inputs(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_run(tmp_path / "a" / "metrics.jsonl", lambda p: 0.0, steps=3)  # zero baseline times
    write_run(tmp_path / "b" / "metrics.jsonl", lambda p: 1.0, steps=3)
    rows = bench_e2e.compare(bench_e2e.load_run(tmp_path / "a"), bench_e2e.load_run(tmp_path / "b"))
    assert all(r.n == 0 and math.isnan(r.ratio) for r in rows)  # no inf, no division by zero

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "data": {}}\nnot json\n{"step": 2, "data": {}}\n')
    assert bench_e2e.main([str(bad), str(tmp_path / "b")]) == 2
    assert "bad.jsonl: line 2" in capsys.readouterr().err
    assert bench_e2e.main([str(tmp_path / "missing"), str(tmp_path / "b")]) == 2
    assert "no such run folder or metrics file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.main([str(tmp_path / "a")])  # one run only


def test_bench_e2e_run_trains_both_through_the_quickstart(tmp_path, monkeypatch, capsys):
    """``--run`` asks the quickstart for JustRL and STAPO (same settings) and compares what it wrote;
    without the CPU path it prints how to do it by hand."""
    import sys

    import stapo_cpu.quickstart as quickstart

    calls = []

    def fake_quickstart(argv):
        calls.append(argv)
        out = argv[argv.index("--out") + 1]
        for method, factor in (("justrl", 1.0), ("stapo", 1.5)):
            (tmp_path / "q" / method).mkdir(parents=True)
            write_run(tmp_path / "q" / method / "metrics.jsonl", lambda p, f=factor: f, steps=3)
        assert out == str(tmp_path / "q")
        return 0

    monkeypatch.setattr(quickstart, "main", fake_quickstart)
    assert bench_e2e.main(["--run", "--out", str(tmp_path / "q"), "--steps", "3"]) == 0
    assert calls == [["--out", str(tmp_path / "q"), "--methods", "justrl,stapo", "--steps", "3"]]
    rows = table_rows(capsys.readouterr().out)
    assert rows and all(float(r[3]) == pytest.approx(1.5) and r[4] == "2" for r in rows)

    monkeypatch.setitem(sys.modules, "stapo_cpu.quickstart", None)  # the CPU path missing
    assert bench_e2e.main(["--run", "--out", str(tmp_path / "q2")]) == 1
    assert "run_scripts/quickstart.sh --methods justrl,stapo" in capsys.readouterr().out


def test_bench_e2e_names_a_run_the_quickstart_stopped_at_its_limit(tmp_path, monkeypatch, capsys):
    """A stopped run (its record, written as the quickstart writes it) is compared over the steps it
    logged, with a note; stopped before its first step, the error says so instead of advising; ``--run``
    passes ``--timeout`` on and names the stopped run when the quickstart stopped one."""
    import stapo_cpu.quickstart as quickstart

    for method in ("justrl", "stapo"):
        (tmp_path / method).mkdir()
    write_run(tmp_path / "justrl" / "metrics.jsonl", lambda p: 1.0, steps=3)
    write_run(tmp_path / "stapo" / "metrics.jsonl", FACTORS.get, steps=5, warmup_factor=1.0)
    quickstart.record_stop(tmp_path / "justrl", "justrl", 1200.4, 1200, 3, 16)
    assert bench_e2e.main(["--from-quickstart", str(tmp_path)]) == 0
    assert ("note: justrl: run justrl stopped after 1200 s (the quickstart's limit per run, --timeout 1200) with 3 of "
            "16 steps logged: raise --timeout; only the steps it logged are compared") in capsys.readouterr().out

    (tmp_path / "stapo" / "metrics.jsonl").write_text("")
    quickstart.record_stop(tmp_path / "stapo", "stapo", 1200.0, 1200, 0, 16)
    assert bench_e2e.main(["--from-quickstart", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert ("run stapo stopped after 1200 s (the quickstart's limit per run, --timeout 1200) with 0 of 16 steps "
            "logged: raise --timeout, before logging a step: nothing to compare") in err
    assert "no steps logged" not in err

    calls = []

    def stopping_quickstart(argv):
        calls.append(argv)
        run_dir = tmp_path / "q" / "justrl"
        run_dir.mkdir(parents=True)
        quickstart.record_stop(run_dir, "justrl", 30.5, 30, 1, 6)
        return 1

    monkeypatch.setattr(quickstart, "main", stopping_quickstart)
    assert bench_e2e.main(["--run", "--out", str(tmp_path / "q"), "--timeout", "30"]) == 1
    assert calls[0][-2:] == ["--timeout", "30.0"]
    assert ("bench_e2e: run justrl stopped after 30 s (the quickstart's limit per run, --timeout 30) with 1 of 6 "
            "steps logged: raise --timeout (--timeout of bench_e2e --run)") in capsys.readouterr().err


def test_current_stats_cost_model():
    """The extra forwards of stats_from=current: (M-1)/M of a forward, against M forward+backward
    passes of 1/M of the batch (4 forward-equivalents with gradient checkpointing, 3 without)."""
    from benchmarks import bench_current_stats as bcs

    assert bcs.expected_share(1) == 0.0  # one mini-batch: the rollout statistics are the current ones
    assert bcs.expected_share(4) == pytest.approx(3 / 16)
    assert bcs.expected_share(4, checkpointing=False) == pytest.approx(0.25)
    steps = {s: {"timing_s/old_log_prob": 1.0, "timing_s/update_actor": 4.0 * s} for s in (1, 2, 3)}
    assert bcs.measured_share(steps, 4, warmup_steps=1) == pytest.approx(0.75 * statistics.median([1 / 8, 1 / 12]))
    # only the positive-advantage sequences: the same times their token share f
    assert bcs.expected_share(4, forwarded=0.3) == pytest.approx(0.3 * 3 / 16)
    assert bcs.measured_share(steps, 4, warmup_steps=1, forwarded=0.3) == pytest.approx(
        0.3 * 0.75 * statistics.median([1 / 8, 1 / 12]))


def test_current_stats_simulation_at_a_small_scale():
    """The paper-scale model at 4 ranks: f is a share, a rank's own positive-advantage sequences are
    part of its full share, the full forward's busiest rank is at least its mean, every number is
    finite; the table has one row per accuracy."""
    from benchmarks import bench_current_stats as bcs

    result = bcs.simulate(0.5, ranks=4, prompts=16, n=8, steps=2, median_response=500, max_response=2000,
                          budget=8000)
    assert 0.0 < result["f"] < 1.0
    assert all(math.isfinite(v) for v in result.values())
    assert 0.0 < result["own_tokens"] <= 1.0 and result["balanced_tokens"] > 0.0
    assert result["full_imbalance"] >= 1.0
    table = bcs.simulation_table([0.3, 0.7], ranks=4, prompts=16, n=8, steps=1, median_response=500,
                                 max_response=2000, budget=8000)
    assert [r[0] for r in table_rows(table) if r[0] != "mean accuracy"] == ["0.3", "0.7"]


def test_current_stats_bad_simulation_arguments_are_named(capsys):
    from benchmarks import bench_current_stats as bcs

    with pytest.raises(SystemExit):
        bcs.main(["--simulate", "--accuracy", "0.5,one"])
    assert "--accuracy='0.5,one'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bcs.main(["--simulate", "--accuracy", "1.5"])
    assert "numbers in (0, 1)" in capsys.readouterr().err


def test_current_stats_logged_median_skips_warmup_and_missing_steps():
    from benchmarks import bench_current_stats as bcs

    steps = {1: {"m": 100.0}, 2: {"m": 1.0}, 3: {}, 4: {"m": 3.0}}
    assert bcs.logged_median(steps, "m", warmup_steps=1) == 2.0
    assert math.isnan(bcs.logged_median(steps, "absent"))
