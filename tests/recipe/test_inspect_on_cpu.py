"""The token-dump records and ``recipe.stapo.inspect`` on a dump from a tiny real Qwen3.

The dump is built with the actor's own code: a random tiny ``Qwen3ForCausalLM`` scores
sampled-looking responses, the actor-side scoring (``verl_patches.token_dump.scoring.token_stats``)
turns its logits into p, H, top-5 and the gradient norm, ``stapo_core.s2t_mask`` gives the mask and
tau_h, ``scoring.build_records`` builds the records and ``token_records.write_step`` writes them.
"""

from __future__ import annotations

import html
import json
import math

import numpy as np
import pytest
import torch

from recipe.stapo import inspect as insp
from stapo_core import token_records as td
from stapo_core import s2t_mask
from verl_patches.token_dump import scoring

#: token strings of the tiny vocabulary: HTML/Markdown specials on purpose
SPECIAL = ["<b>", "&amp;", "a|b", "</td>", '"q"', "\n", " ", "x_1", "*"]
VOCAB = SPECIAL + [f"w{i}" for i in range(64 - len(SPECIAL))]
TAU_P = 0.02  # ~1/|V|: about half of uniformly drawn tokens are rare
PROMPT_LEN, RESP_LEN, GROUPS, N = 4, 12, 2, 4
CONTEXT = 3


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         initializer_range=0.5, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def _step_tensors(model, step: int):
    """Per-token tensors of one step: ids, probs (B, T, V), p, H, grad norm, advantages, mask."""
    gen = torch.Generator().manual_seed(step)
    batch = GROUPS * N
    ids = torch.randint(0, len(VOCAB), (batch, PROMPT_LEN + RESP_LEN), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1 : -1].float()  # predicts the response tokens
    resp = ids[:, PROMPT_LEN:]
    probs = torch.softmax(logits, -1)
    # the actor's scoring of every position: what the writer dumps and s2t_mask compares with tau_p
    stats = [scoring.token_stats(logits[i], resp[i]) for i in range(batch)]
    log_p, entropy, grad_norm = (torch.stack([st[k] for st in stats]) for k in ("log_prob", "entropy", "grad_norm"))
    p = log_p.exp()
    lengths = torch.tensor([RESP_LEN - (i % 3) for i in range(batch)])  # some padding
    mask = (torch.arange(RESP_LEN)[None] < lengths[:, None]).float()
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    adv = ((rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)).reshape(-1)
    # step 2 carries each token's log-prob change across its update (step 1: a dump without it)
    dlogp = torch.randn(batch, RESP_LEN, generator=gen) if step == 2 else None
    return {"ids": ids, "resp": resp, "probs": probs, "log_p": log_p, "p": p, "H": entropy,
            "g": grad_norm, "adv": adv, "mask": mask, "stats": stats, "dlogp": dlogp}


def _text(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def _records(step: int, t: dict, method: str = "stapo"):
    """The token and response records the actor writes for one step (its own record builder)."""
    result = s2t_mask(t["log_p"], t["H"], t["adv"], t["mask"], tau_p=TAU_P, q=0.75)
    tau_h = result.stats["tau_h"]
    tokens, responses = [], []
    for i in range(t["resp"].shape[0]):
        n = int(t["mask"][i].sum())
        full = t["ids"][i].tolist()
        resp = scoring.SampledResponse(
            prompt_ids=full[:PROMPT_LEN], response_ids=full[PROMPT_LEN:PROMPT_LEN + n],
            stats={k: v[:n] for k, v in t["stats"][i].items()}, mask=t["mask"][i, :n],
            advantages=t["adv"][i].expand(n), silenced=result.keep[i, :n] == 0, old_log_prob=None,
            uid=f"prompt{i // N}", response_index=i % N, rank=0, row=i,
            dlogp=None if t["dlogp"] is None else t["dlogp"][i, :n])
        records = scoring.build_records(resp, step=step, method=method, tau_p=TAU_P, tau_h=tau_h, context=CONTEXT,
                                        decode=_text)
        tokens += [r for r in records if r["kind"] == "token"]
        responses += [r for r in records if r["kind"] == "response"]
    return tokens, responses, result.stats


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder with two steps of dump; returns (run_dir, tokens, responses, per-step tensors, stats)."""
    run_dir = tmp_path_factory.mktemp("run")
    model = _model()
    all_tokens, all_responses, tensors, stats = [], [], {}, {}
    for step in (1, 2):
        tensors[step] = _step_tensors(model, step)
        tokens, responses, stats[step] = _records(step, tensors[step])
        td.write_step(run_dir, step, tokens + responses)
        all_tokens += tokens
        all_responses += responses
    return run_dir, all_tokens, all_responses, tensors, stats


def test_dump_round_trip(run):
    run_dir, tokens, responses, _, stats = run
    assert (run_dir / "s2t_tokens" / "step_000001.jsonl").is_file()
    assert td.read_dump(run_dir) == td.Dump(tokens=tokens, responses=responses, skipped=[])
    assert sum(s["silenced"] for s in stats.values()) == sum(t["silenced"] for t in tokens) > 0
    assert sum(s["candidates"] for s in stats.values()) == len(tokens)
    assert any(t["candidate"] and not t["silenced"] for t in tokens)


def test_grad_norm_closed_form_matches_autograd(run):
    """The writer's grad_norm (the actor's token_stats) is ||d log p_k / d logits||, checked against
    autograd on a few tokens."""
    _, tokens, _, tensors, _ = run
    for tok in tokens[:5]:
        t = tensors[tok["step"]]
        i = [j for j in range(GROUPS * N) if f"prompt{j // N}" == tok["uid"] and j % N == tok["response_index"]][0]
        logits = torch.log(t["probs"][i, tok["position"]]).double().requires_grad_(True)
        torch.log_softmax(logits, -1)[tok["token_id"]].backward()
        assert math.isclose(logits.grad.norm().item(), tok["grad_norm"], rel_tol=1e-4)


def test_quadrants_add_up(run):
    _, tokens, responses, _, _ = run
    positive = [r for r in responses if r["advantage"] > 0]
    low_p = sum(r["quadrants"]["lowp_lowh"]["count"] + r["quadrants"]["lowp_highh"]["count"] for r in positive)
    assert low_p == sum(t["candidate"] and t["advantage"] > 0 for t in tokens) > 0
    for r in responses:
        assert sum(q["count"] for q in r["quadrants"].values()) == r["n_tokens"]
    # with tau_h = S2T's tau_h, the low-p low-H quadrant of positive responses is exactly the silenced set
    assert sum(r["quadrants"]["lowp_lowh"]["count"] for r in positive) == sum(t["silenced"] for t in tokens)
    silenced_g = sum(t["grad_norm"] for t in tokens if t["silenced"])
    assert math.isclose(sum(r["quadrants"]["lowp_lowh"]["grad_norm_sum"] for r in positive), silenced_g, rel_tol=1e-9)


@pytest.mark.parametrize("tau_h", [1.0, None])
def test_quadrant_counts_against_loop(tau_h):
    """Counts and sums of a (3, 7) batch against a loop over its tokens; without tau_h the entropy
    split is the median entropy of the masked tokens (sorted by hand here)."""
    rng = np.random.default_rng(3)
    p, h, g = rng.uniform(0, 0.1, (3, 7)), rng.uniform(0, 2, (3, 7)), rng.uniform(0, 1.4, (3, 7))
    mask = rng.uniform(size=(3, 7)) > 0.2
    tokens = [(i, j) for i in range(3) for j in range(7) if mask[i, j]]
    ent = sorted(h[t] for t in tokens)
    split = tau_h if tau_h is not None else (ent[(len(ent) - 1) // 2] + ent[len(ent) // 2]) / 2
    assert td.entropy_split(h, mask, tau_h) == pytest.approx(split, rel=1e-15)
    d = rng.normal(0, 1, (3, 7))
    got = td.quadrant_counts(torch.tensor(p), h, g, mask, 0.05, tau_h, dlogp=d)
    for name, (lp, lh) in zip(td.QUADRANTS, [(1, 1), (1, 0), (0, 1), (0, 0)]):
        sel = [t for t in tokens if (p[t] < 0.05) == lp and (h[t] < split) == lh]
        assert got[name]["count"] == len(sel)
        assert math.isclose(got[name]["grad_norm_sum"], sum(g[t] for t in sel), abs_tol=1e-12)
        assert math.isclose(got[name]["dlogp_sum"], sum(d[t] for t in sel), abs_tol=1e-12)


def test_median_split_without_tau_h():
    ent = [0.1, 0.4, 0.2, 0.9]
    rec = td.response_record(step=0, method="m", uid="u", response_index=0, advantage=1.0, prob=[0.5] * 4,
                             entropy=ent, grad_norm=[0.1] * 4, mask=[1, 1, 1, 1], tau_p=0.002, tau_h=float("nan"))
    assert rec["tau_h"] is None and rec["entropy_split"] == pytest.approx(0.3)
    assert rec["quadrants"]["highp_lowh"]["count"] == 2 and rec["quadrants"]["highp_highh"]["count"] == 2
    empty = td.response_record(step=0, method="m", uid="u", response_index=1, advantage=0.0, prob=[0.5],
                               entropy=[0.3], grad_norm=[0.1], mask=[0], tau_p=0.002, tau_h=None)
    assert empty["entropy_split"] is None and empty["n_tokens"] == 0
    assert all(q == {"count": 0, "grad_norm_sum": 0.0, "dlogp_sum": None} for q in empty["quadrants"].values())


def test_quadrant_counts_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        td.quadrant_counts([0.1, 0.2], [1.0], [0.1, 0.2], [1, 1], 0.002, None)
    with pytest.raises(ValueError, match="tau_p"):
        td.quadrant_counts([0.1], [1.0], [0.1], [1], 0.0, None)
    with pytest.raises(ValueError, match="entropy holds non-finite"):
        td.quadrant_counts([0.1], [float("nan")], [0.1], [1], 0.002, None)
    # a non-finite value outside the mask is not counted, so it is no error
    assert td.quadrant_counts([0.1, 0.2], [float("nan"), 1.0], [0.1, 0.2], [0, 1], 0.002, None)["highp_highh"] == {
        "count": 1, "grad_norm_sum": 0.2, "dlogp_sum": None}
    with pytest.raises(ValueError, match="dlogp holds non-finite"):
        td.quadrant_counts([0.1], [1.0], [0.1], [1], 0.002, None, dlogp=[float("inf")])
    with pytest.raises(ValueError, match="same shape"):
        td.quadrant_counts([0.1], [1.0], [0.1], [1], 0.002, None, dlogp=[0.1, 0.2])


def test_report_contents(run, tmp_path):
    run_dir, tokens, responses, _, stats = run
    md_path, html_path = insp.write_report(run_dir, tmp_path / "out", top=50)
    md, page = md_path.read_text(), html_path.read_text()
    freq = insp.frequent_silenced(tokens, 3)
    counts = {}
    for t in tokens:
        if t["silenced"]:
            counts[t["token_id"]] = counts.get(t["token_id"], 0) + 1
    assert [f.count for f in freq] == sorted(counts.values(), reverse=True)[:3]
    for f in freq:  # the top silenced token strings are in both reports, escaped
        assert html.escape(repr(f.token), quote=True) in page
        assert insp._md_escape(repr(f.token)) in md
        group = [t for t in tokens if t["silenced"] and t["token_id"] == f.token_id]
        assert f.mean_prob == pytest.approx(np.mean([t["prob"] for t in group]))
    summary = insp.step_summaries(tokens, responses)
    assert [(s.step, s.candidates, s.silenced) for s in summary] == [
        (k, v["candidates"], v["silenced"]) for k, v in sorted(stats.items())]
    assert [s.tau_h_min for s in summary] == pytest.approx([stats[1]["tau_h"], stats[2]["tau_h"]])
    rows = insp.quadrant_table(responses)
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert rows[0].count == sum(t["silenced"] for t in tokens)
    assert rows[0].mean_grad_norm == pytest.approx(np.mean([t["grad_norm"] for t in tokens if t["silenced"]]))
    assert page.count('class="tok silenced"') == sum(t["silenced"] for t in tokens) + 1  # + the legend
    assert page.count('class="tok kept"') == sum(t["candidate"] and not t["silenced"] for t in tokens) + 1


def test_update_effect_per_quadrant(run, tmp_path):
    """The report's dlogp columns against a loop over step 2's tokens (step 1 has no dlogp and is
    left out of them): each quadrant's mean over its tokens of positive-advantage responses, the
    silenced and kept candidates' means over their token records."""
    run_dir, tokens, responses, tensors, stats = run
    t = tensors[2]
    split = stats[2]["tau_h"]
    want = {q: [] for q in td.QUADRANTS}
    for i in range(GROUPS * N):
        if t["adv"][i] <= 0:
            continue
        for j in range(int(t["mask"][i].sum())):
            low_p, low_h = float(t["p"][i, j]) < TAU_P, float(t["H"][i, j]) < split
            name = td.QUADRANTS[[(True, True), (True, False), (False, True), (False, False)].index((low_p, low_h))]
            want[name].append(float(t["dlogp"][i, j]))
    rows = {r.name: r for r in insp.quadrant_table(responses)}
    for name, values in want.items():
        assert rows[name].dlogp_count == len(values)
        assert rows[name].mean_dlogp == (pytest.approx(np.mean(values), abs=1e-9) if values else None)
    assert rows["lowp_lowh"].dlogp_count < rows["lowp_lowh"].count  # step 1's tokens have none
    effects = {e.name: e for e in insp.candidate_effects(tokens)}
    for name, flag in (("silenced", True), ("kept", False)):
        values = [float(t["dlogp"][int(tok["row"]), tok["position"]]) for tok in tokens
                  if tok["step"] == 2 and tok["silenced"] is flag]
        assert effects[name].count == len(values) > 0
        assert effects[name].mean_dlogp == pytest.approx(np.mean(values), abs=1e-6)
    assert all(tok["dlogp"] is None for tok in tokens if tok["step"] == 1)
    md_path, html_path = insp.write_report(run_dir, tmp_path / "out", top=50)
    md = md_path.read_text()
    assert "mean dlogp (update)" in md and "## Update effect on the dumped candidates" in md
    assert f"| {insp._num(effects['silenced'].mean_dlogp)} |" in md
    assert "mean dlogp (update)" in html_path.read_text()


def test_html_escaping(tmp_path):
    """Tokens and contexts like <b>, </td>, & and quotes never reach the HTML unescaped."""
    rec = {"kind": "token", "step": 3, "method": "stapo", "uid": "<script>u", "response_index": 0, "position": 2,
           "token_id": 0, "token": "<b>", "context_before": "1 < 2 & ", "context_after": '</td>"|x',
           "prob": 0.001, "entropy": 0.2, "advantage": 1.0, "candidate": True, "silenced": True, "grad_norm": 1.3,
           "top5": [['"><img>', 0.9]]}
    td.write_step(tmp_path, 3, [rec])
    md_path, html_path = insp.write_report(tmp_path, top=5)
    page, md = html_path.read_text(), md_path.read_text()
    for raw in ("<b>", "</td>\"", "<script>", "<img>", "1 < 2"):
        assert raw not in page and raw not in md
    assert '<span class="tok silenced" title="' in page
    assert "&lt;b&gt;</span>" in page and "1 &lt; 2 &amp; " in page and "&lt;/td&gt;&quot;|x" in page
    assert "**[&lt;b&gt;]**" in md and "&lt;/td&gt;\"\\|x" in md


def test_no_dump_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no spurious-token dump.*recipe.token_dump.dir="):
        insp.build_report(tmp_path)
    assert insp.main([str(tmp_path)]) == 2
    assert "no spurious-token dump" in capsys.readouterr().err
    path = td.write_step(tmp_path, 1, [_token()])
    with pytest.raises(FileNotFoundError, match="no such run folder"):  # a file is not a run folder
        td.dump_files(path)


def test_cli_default_out(run, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(run[0], run_dir)
    assert insp.main([str(run_dir), "--top", "3"]) == 0
    assert (run_dir / "inspect" / "report.md").is_file() and (run_dir / "inspect" / "report.html").is_file()
    with pytest.raises(SystemExit):
        insp.main([str(run_dir), "--top", "0"])


def _token(**over):
    rec = {"kind": "token", "step": 1, "method": "stapo", "uid": "u", "response_index": 0, "position": 0,
           "token_id": 5, "token": "t", "context_before": "", "context_after": "", "prob": 0.001, "entropy": 0.5,
           "advantage": 1.0, "candidate": True, "silenced": False, "grad_norm": 1.0, "top5": []}
    rec.update(over)
    return rec


def test_validation_normalises_numbers_and_keeps_extra_keys():
    tok = td.validate_record(_token(prob=0, entropy=1, advantage=2, grad_norm=1, top5=[("a", 1)], row=7))
    assert all(type(tok[k]) is float for k in ("prob", "entropy", "advantage", "grad_norm"))
    assert (tok["prob"], tok["entropy"], tok["advantage"], tok["grad_norm"]) == (0.0, 1.0, 2.0, 1.0)
    assert tok["top5"] == [["a", 1.0]] and type(tok["top5"][0][1]) is float
    assert type(tok["position"]) is int and tok["row"] == 7
    assert td.validate_token_record(dict(tok, kind="other"))["kind"] == "token"
    resp = td.response_record(step=1, method="m", uid="u", response_index=0, advantage=1, prob=[0.5],
                              entropy=[0.1], grad_norm=[0.5], mask=[1], tau_p=0.002, tau_h=None)
    assert resp["entropy_split"] == 0.1
    without = {k: v for k, v in resp.items() if k != "entropy_split"}
    assert td.validate_record(without) == dict(resp, entropy_split=None)


@pytest.mark.parametrize("over, message", [
    ({"prob": 1.5}, "'prob' must lie in"),
    ({"entropy": float("nan")}, "'entropy' must be a finite number"),
    ({"step": "1"}, "'step' must be an integer"),
    ({"silenced": True, "candidate": False}, "silenced token must be a candidate"),
    ({"top5": [["a", 0.5, 1]]}, "'top5'\\[0\\]"),
    ({"kind": "tok"}, "'kind' must be"),
])
def test_writer_rejects_bad_records_and_keeps_file(tmp_path, over, message):
    path = td.write_step(tmp_path, 1, [_token()])
    before = path.read_bytes()
    with pytest.raises(ValueError, match=message) as info:
        td.write_step(tmp_path, 1, [_token(position=1), _token(**over)])
    assert "record #1" in str(info.value) and str(path) in str(info.value)
    assert path.read_bytes() == before  # nothing half-written


def test_reader_names_file_and_line(tmp_path):
    folder = tmp_path / "s2t_tokens"
    folder.mkdir()
    good = json.dumps(_token())
    (folder / "step_000002.jsonl").write_text(good + "\n" + json.dumps(_token(grad_norm=-1.0)) + "\n")
    with pytest.raises(ValueError, match=r"step_000002.jsonl: line 2: field 'grad_norm'"):
        td.read_dump(tmp_path)
    (folder / "step_000002.jsonl").write_text(good + "\n{not json\n" + good + "\n")
    with pytest.raises(ValueError, match=r"step_000002.jsonl: line 2 is not valid JSON"):
        td.read_dump(tmp_path)
    (folder / "step_000002.jsonl").write_text(good + "\n" + good[:20])  # a write cut short: tolerated
    with pytest.warns(UserWarning, match="truncated last line 2"):
        dump = td.read_dump(tmp_path)
    assert len(dump.tokens) == 1


def test_response_record_validation(tmp_path):
    rec = td.response_record(step=1, method="m", uid="u", response_index=0, advantage=1.0, prob=[0.001, 0.5],
                             entropy=[0.1, 0.2], grad_norm=[1.0, 0.5], mask=[1, 1], tau_p=0.002, tau_h=0.15)
    assert rec["quadrants"]["lowp_lowh"] == {"count": 1, "grad_norm_sum": 1.0, "dlogp_sum": None}
    assert rec["quadrants"]["highp_highh"] == {"count": 1, "grad_norm_sum": 0.5, "dlogp_sum": None}
    # a record written before dlogp existed reads as unmeasured
    old = {**rec, "quadrants": {k: {"count": v["count"], "grad_norm_sum": v["grad_norm_sum"]}
                                for k, v in rec["quadrants"].items()}}
    assert td.validate_record(old)["quadrants"] == rec["quadrants"]
    bad = dict(rec, quadrants={**rec["quadrants"], "lowp_lowh": {"count": 1, "grad_norm_sum": 1.0, "dlogp_sum": "x"}})
    with pytest.raises(td.RecordError, match=r"quadrants.lowp_lowh: field 'dlogp_sum' must be a finite number or null"):
        td.validate_record(bad)
    bad = dict(rec, n_tokens=1)
    with pytest.raises(td.RecordError, match="more than n_tokens"):
        td.validate_record(bad)
    bad = dict(rec, quadrants={k: v for k, v in rec["quadrants"].items() if k != "lowp_lowh"})
    with pytest.raises(td.RecordError, match="'quadrants' must map exactly"):
        td.validate_record(bad)
    bad = dict(rec, quadrants={**rec["quadrants"], "lowp_lowh": {"count": -1, "grad_norm_sum": 0.0}})
    with pytest.raises(td.RecordError, match=r"quadrants.lowp_lowh: field 'count' must be >= 0"):
        td.validate_record(bad)


def test_step_files_read_in_step_order(tmp_path):
    for step in (10, 2, 100):
        td.write_step(tmp_path, step, [_token(step=step)])
    (tmp_path / "s2t_tokens" / "notes.txt").write_text("ignored")
    dump = td.read_dump(tmp_path, progress=False)
    assert [t["step"] for t in dump.tokens] == [2, 10, 100]
    assert [p.name for p in td.dump_files(tmp_path / "s2t_tokens")] == [
        "step_000002.jsonl", "step_000010.jsonl", "step_000100.jsonl"]


def test_degenerate_dump_renders_finite(tmp_path):
    """Only a negative-advantage response with no tokens: empty tables, zero shares, no NaN."""
    rec = td.response_record(step=0, method="justrl", uid="u", response_index=0, advantage=-1.0, prob=[],
                             entropy=[], grad_norm=[], mask=[], tau_p=0.002, tau_h=None)
    td.write_step(tmp_path, 0, [rec])
    md_path, html_path = insp.write_report(tmp_path)
    assert all(r.count == 0 and r.share == 0.0 and r.mean_grad_norm == 0.0 for r in insp.quadrant_table([rec]))
    md, page = md_path.read_text(), html_path.read_text()
    assert "nan" not in md.lower() and "nan" not in page.lower()
    assert "| 0 | justrl | 1 | 0 | 0 | 0 | 0 | 0 | 0.002 | - |" in md


def test_step_file_of_random_bytes_names_the_file_and_line(run, tmp_path, capsys):
    run_dir, *_ = run
    bad = tmp_path / "bytes"
    (bad / "s2t_tokens").mkdir(parents=True)
    for f in (run_dir / "s2t_tokens").iterdir():
        (bad / "s2t_tokens" / f.name).write_bytes(f.read_bytes())
    junk = bad / "s2t_tokens" / "step_000003.jsonl"
    junk.write_bytes(bytes([0xFF, 0xFE, 0x00, 0x81, 0xC3]) * 64)  # binary garbage, not UTF-8
    assert insp.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "step_000003.jsonl: line 1 is not UTF-8" in err


def test_empty_step_file_is_reported_as_skipped(run, tmp_path, capsys):
    run_dir, tokens, responses, *_ = run
    copy = tmp_path / "empty_step"
    (copy / "s2t_tokens").mkdir(parents=True)
    for f in (run_dir / "s2t_tokens").iterdir():
        (copy / "s2t_tokens" / f.name).write_bytes(f.read_bytes())
    (copy / "s2t_tokens" / "step_000003.jsonl").write_text("")
    assert insp.main([str(copy)]) == 0
    err = capsys.readouterr().err
    assert "skipped" in err and "step_000003.jsonl" in err
    report = (copy / "inspect" / "report.md").read_text()
    assert "## Skipped files" in report and "step_000003.jsonl" in report
    assert f"{len(tokens)} token records, {len(responses)} response records" in report  # the rest is read


def test_dump_without_usable_record_exits_non_zero(tmp_path, capsys):
    (tmp_path / "s2t_tokens").mkdir()
    (tmp_path / "s2t_tokens" / "step_000001.jsonl").write_text("")
    assert insp.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no usable record" in err and "step_000001.jsonl" in err
    assert not (tmp_path / "inspect").exists()


def test_a_run_stopped_at_the_quickstarts_limit_is_named_not_advised(run, tmp_path, capsys):
    """A run the quickstart stopped (its record, written as the quickstart writes it): without a dump the
    error says it was stopped and which limit to raise, not how to turn on a dump that was on; with the
    steps it dumped, the report covers them and a note says where it stopped."""
    import shutil

    from stapo_cpu.quickstart import record_stop

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    record_stop(stopped, "stapo", 1200.3, 1200, 0, 16)
    assert insp.main([str(stopped)]) == 1
    err = capsys.readouterr().err
    assert (f"error: {stopped}: no token dump to inspect: run stapo stopped after 1200 s (the quickstart's limit per "
            "run, --timeout 1200) with 0 of 16 steps logged: raise --timeout, before the dump's first step") in err
    assert "recipe.token_dump.dir" not in err and not (stopped / "inspect").exists()

    partial = tmp_path / "partial"
    shutil.copytree(run[0], partial)
    record_stop(partial, "stapo", 1201.0, 1200, 2, 16)
    assert insp.main([str(partial)]) == 0
    assert ("note: run stapo stopped after 1201 s (the quickstart's limit per run, --timeout 1200) with 2 of 16 steps "
            "logged: raise --timeout; the report covers the steps before the stop") in capsys.readouterr().err
    assert (partial / "inspect" / "report.md").is_file()


def test_out_at_a_file_is_a_named_error(run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for out in (afile, afile / "sub"):
        assert insp.main([str(run[0]), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"error: --out {out}" in err and "Traceback" not in err
    assert afile.read_text() == "keep"


def _response(**over):
    rec = {"kind": "response", "step": 1, "method": "stapo", "uid": "u", "response_index": 0, "advantage": 1.0,
           "n_tokens": 10, "tau_p": 0.002, "tau_h": 0.5, "entropy_split": None,
           "quadrants": {q: {"count": 1, "grad_norm_sum": 1.0} for q in td.QUADRANTS}}
    rec.update(over)
    return rec


@pytest.mark.parametrize("damage, phrase", [
    ("garbage_line", "line 2 is not valid JSON"),
    ("foreign_record", "line 1: field 'kind' must be 'token' or 'response'"),
    ("folder", "is a folder, not a regular file"),
])
def test_a_damaged_step_file_is_named_with_what_to_do(tmp_path, capsys, damage, phrase):
    """The dump writes each step file whole: one that does not read is damaged or foreign, and the
    error says to move it aside to inspect the other steps (before: the reader's message alone)."""
    td.write_step(tmp_path, 1, [_token(), _response()])
    bad = td.step_file(tmp_path, 2)
    if damage == "garbage_line":
        bad.write_text(json.dumps(_token(step=2)) + "\n{oops\n")
    elif damage == "foreign_record":
        bad.write_text(json.dumps({"step": 2, "token": "x", "p": 0.1}) + "\n")
    else:
        bad.mkdir()
    assert insp.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "step_000002.jsonl" in err and phrase in err and "move it out of s2t_tokens/ to inspect the other steps" in err
    assert "Traceback" not in err and not (tmp_path / "inspect").exists()


def test_a_last_line_cut_short_is_listed_in_the_report(tmp_path, capsys):
    """A copy that did not finish leaves a step file's last line cut: its other records are read, and
    the report lists the file (before: one Python warning on stderr, nothing in the report)."""
    td.write_step(tmp_path, 1, [_token(), _response()])
    td.step_file(tmp_path, 2).write_text(json.dumps(_token(step=2)) + "\n" + json.dumps(_token(step=2))[:30])
    assert insp.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "step_000002.jsonl: last line 2 cut short" in err and "UserWarning" not in err
    report = (tmp_path / "inspect" / "report.md").read_text()
    assert "## Skipped files" in report and "last line 2 cut short" in report
    assert "2 token records, 1 response records" in report  # step 1, and step 2 up to its cut line


def test_a_dump_of_two_methods_is_noted(tmp_path, capsys):
    """A run folder another method's run also dumped to: the report pools them, and says so."""
    td.write_step(tmp_path, 1, [_token(), _response()])
    td.write_step(tmp_path, 2, [_token(step=2, method="grpo", silenced=False), _response(step=2, method="grpo")])
    assert insp.main([str(tmp_path)]) == 0
    note = "the dump holds records of 2 methods (grpo: steps 2; stapo: steps 1)"
    assert note in capsys.readouterr().err
    assert note in (tmp_path / "inspect" / "report.md").read_text()
    assert "Notes" in (tmp_path / "inspect" / "report.html").read_text()
    td.write_step(tmp_path, 2, [_token(step=2), _response(step=2)])
    assert insp.main([str(tmp_path)]) == 0
    assert "methods" not in capsys.readouterr().err
