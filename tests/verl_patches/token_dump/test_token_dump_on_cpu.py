"""verl_patches.token_dump: the training-time spurious-token dump.

Fast tests drive the dump through the real actor hook (``verl_patches.mini_batch``'s wrapper of
``TrainingWorker.train_batch``) with a tiny random Qwen3 and hand-built mini-batches in both of
verl's layouts (TransferQueue: jagged; legacy: padded, converted by verl's own
``left_right_2_no_padding``), and check every number against an independent float64 computation.

The slow tests share ONE real run (``python -m recipe.stapo.main_stapo method=stapo`` on CPU,
2 steps, the dump on) and check the dump against the initial model re-scored with transformers,
the inspector and plots on the real run folder, the quadrant counts and the logged metrics.
"""

from __future__ import annotations

import contextlib
import functools
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stapo_core import token_records as td
import stapo_core
from verl_patches.token_dump import hook, scoring, settings
from tests.helpers.paths import REPO
from tests.helpers import shared_runs as shared_runs_table

VOCAB = 48
TAU_P = 0.03  # ~1.5/|V|: a good share of the random model's sampled tokens are rare
GROUPS, N = 2, 4
REWARDS = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
PROB_TOL = 1e-5


# --------------------------------------------------------------------------------------------
# pure pieces
# --------------------------------------------------------------------------------------------


def test_select_responses_rule():
    adv = [1.0, -1.0, 0.5, 0.0, 2.0, -0.5, 1.5, 0.3]  # positive: 0 2 4 6 7; other: 1 3 5
    positive = {0, 2, 4, 6, 7}
    # (k, responses with advantage <= 0 drawn): k // 4 of them, more only when positives run out
    for k, want_other in [(1, 0), (3, 0), (4, 1), (6, 1), (7, 2), (8, 3), (20, 3)]:
        got = scoring.select_responses(adv, k, (3, 0))
        assert got == sorted(set(got)) and len(got) == min(k, len(adv))
        assert sum(i not in positive for i in got) == want_other, (k, got)
    assert scoring.select_responses(adv, 4, (3, 0)) == scoring.select_responses(adv, 4, (3, 0))
    draws = {tuple(scoring.select_responses(adv, 4, (step, rank))) for step in range(6) for rank in range(2)}
    assert len(draws) > 1  # seeded by step and rank
    assert scoring.select_responses([-1.0, 0.0], 4, (1, 0)) == [0, 1]
    with pytest.raises(ValueError, match="k=0"):
        scoring.select_responses(adv, 0, (1, 0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_chunked_matches_float64(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 101, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 101, (37,), generator=gen)
    got = scoring.token_stats(logits, targets, temperature=temperature, chunk_size=8)
    a = logits.double() / temperature
    probs = torch.softmax(a, -1)
    p = probs.gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(got["prob"].double(), p, atol=1e-6)
    assert torch.allclose(got["entropy"].double(), -(probs * torch.log_softmax(a, -1)).sum(-1), atol=1e-5)
    assert torch.allclose(got["grad_norm"].double(), torch.sqrt(1 - 2 * p + (probs ** 2).sum(-1)), atol=1e-5)
    top_p, top_i = probs.topk(5, -1)
    assert torch.allclose(got["top_prob"].double(), top_p, atol=1e-6)
    assert torch.equal(got["top_prob"], got["top_prob"].sort(-1, descending=True).values)
    assert torch.allclose(probs.gather(-1, got["top_ids"]), top_p, atol=1e-6)  # ties may swap ids
    empty = scoring.token_stats(logits[:0], targets[:0])
    assert empty["prob"].shape == (0,) and empty["top_ids"].shape == (0, 5)
    with pytest.raises(ValueError, match="temperature"):
        scoring.token_stats(logits, targets, temperature=0.0)


def test_settings_from_env_names_the_key(tmp_path):
    s = settings.settings_from_env({settings.DIR_ENV: str(tmp_path)})
    assert (s.run_dir, s.responses, s.context, s.ids, s.method) == (tmp_path, 4, 16, False, None)
    s = settings.settings_from_env({settings.DIR_ENV: "r", settings.RESPONSES_ENV: "2", settings.CONTEXT_ENV: "0", settings.IDS_ENV: "1",
                               settings.METHOD_ENV: "justrl"})
    assert (s.responses, s.context, s.ids, s.method) == (2, 0, True, "justrl")
    for env, match in [({}, "recipe.token_dump.dir"),
                       ({settings.RESPONSES_ENV: "0"}, "recipe.token_dump.responses=0"),
                       ({settings.RESPONSES_ENV: "four"}, "recipe.token_dump.responses='four'"),
                       ({settings.CONTEXT_ENV: "-1"}, "recipe.token_dump.context=-1"),
                       ({settings.IDS_ENV: "maybe"}, r"recipe.token_dump.ids='maybe' \(env STAPO_TOKEN_DUMP_IDS\)")]:
        with pytest.raises(ValueError, match=match):
            settings.settings_from_env({settings.DIR_ENV: "r", **env} if env else env)


def test_write_step_replaces_atomically(tmp_path):
    rec = {"kind": "response", "step": 1, "method": "m", "uid": "u", "response_index": 0, "advantage": 1.0,
           "n_tokens": 1, "tau_p": 0.5, "tau_h": None,
           "quadrants": {q: {"count": 0, "grad_norm_sum": 0.0} for q in td.QUADRANTS}}
    path = td.write_step(tmp_path, 1, [rec, rec])
    assert path == td.step_file(tmp_path, 1)
    td.write_step(tmp_path, 1, [rec])  # a step trained again (resume) replaces its file
    assert len(td.read_dump(tmp_path).responses) == 1
    with pytest.raises(ValueError, match="record #1"):
        td.write_step(tmp_path, 1, [rec, {**rec, "tau_p": 2.0}])
    assert len(td.read_dump(tmp_path).responses) == 1 and sorted(p.name for p in path.parent.iterdir()) == [path.name]


# --------------------------------------------------------------------------------------------
# the dump through the actor hook, both layouts, a tiny random Qwen3
# --------------------------------------------------------------------------------------------


class CharTokenizer:
    """Token i is the string ``t<i>|`` (so a decode is checkable)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"t{int(i)}|" for i in ids)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         initializer_range=0.3, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def _reference(model, prompt: list, response: list) -> dict:
    """float64 p, H, probs over the response positions, from a plain unbatched forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    probs = torch.softmax(logits, -1)
    p = probs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    return {"p": p, "H": -(probs * torch.log_softmax(logits, -1)).sum(-1), "probs": probs}


@pytest.fixture(scope="module")
def batch(model):
    """One mini-batch (GROUPS x N responses): token lists, references, rollout fields."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(GROUPS * N):
        prompt = torch.randint(1, VOCAB, (4 + i % 3,), generator=gen).tolist()
        response = torch.randint(1, VOCAB, (6 + (i * 5) % 7,), generator=gen).tolist()
        ref = _reference(model, prompt, response)
        mask = torch.ones(len(response), dtype=torch.long)
        if i == 2:
            mask[2:4] = 0  # e.g. tool-output tokens inside a response
        rows.append({"prompt": prompt, "response": response, "ref": ref, "mask": mask})
    r = torch.tensor(REWARDS)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
    for i, row in enumerate(rows):
        row["adv"] = float(adv[i])
        row["uid"] = f"group{i // N}"
    return rows


def _padded_tensordict(rows):
    from tensordict import TensorDict

    B = len(rows)
    P, R = max(len(r["prompt"]) for r in rows), max(len(r["response"]) for r in rows)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp_mask, old_lp, ent, adv = (torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R), torch.zeros(B, R),
                                   torch.zeros(B, R))
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["response"])
        prompts[i, P - p:] = torch.tensor(r["prompt"])
        responses[i, :n] = torch.tensor(r["response"])
        attn[i, P - p : P + n] = 1
        resp_mask[i, :n] = r["mask"]
        old_lp[i, :n] = r["ref"]["p"].log().float()
        ent[i, :n] = r["ref"]["H"].float()
        adv[i, :n] = r["adv"] * r["mask"]
    return TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "response_mask": resp_mask,
        "old_log_probs": old_lp, "entropy": ent, "advantages": adv,
    }, batch_size=[B])


def _jagged(padded: torch.Tensor, lengths: list) -> torch.Tensor:
    """Rows ``padded[i, :lengths[i]]`` as a jagged nested tensor (the TransferQueue layout)."""
    return torch.nested.as_nested_tensor([padded[i, :n] for i, n in enumerate(lengths)], layout=torch.jagged)


def _mini_batch(rows, layout: str, *, last: bool, with_entropy: bool = True):
    """The mini-batch TensorDict the actor hook sees: ``legacy`` (verl's left_right_2_no_padding of
    the padded batch) or ``v1`` (every per-token field jagged)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    padded = _padded_tensordict(rows)
    if layout == "legacy":
        data = left_right_2_no_padding(padded)
    else:
        from tensordict import TensorDict

        lengths = [len(r["response"]) for r in rows]
        jag = functools.partial(_jagged, lengths=lengths)
        seq = [torch.tensor(r["prompt"] + r["response"]) for r in rows]
        data = TensorDict({k: jag(padded[k]) for k in ("responses", "response_mask", "old_log_probs",
                                                                "entropy", "advantages")}, batch_size=[len(rows)])
        data["loss_mask"] = jag(padded["response_mask"])
        data["prompts"] = torch.nested.as_nested_tensor([torch.tensor(r["prompt"]) for r in rows], layout=torch.jagged)
        data["input_ids"] = torch.nested.as_nested_tensor(seq, layout=torch.jagged)
        data["position_ids"] = torch.nested.as_nested_tensor([torch.arange(len(s)) for s in seq], layout=torch.jagged)
    if not with_entropy:
        data.pop("entropy")
    tu.assign_non_tensor_stack(data, "uid", [r["uid"] for r in rows])
    tu.assign_non_tensor(data, temperature=1.0, update_lr_scheduler=last)
    return data


@torch.no_grad()
def _infer_batch(model, data):
    """verl's inference pass (the update's probe): every sequence's log-probs in verl's flat layout,
    entry k of a sequence being log p(seq[k+1] | seq[:k+1])."""
    flat = []
    for seq in data["input_ids"].unbind():
        logp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].float(), -1)
        flat += [logp.gather(-1, seq[1:, None]).squeeze(-1), logp.new_zeros(1)]
    return {"log_probs": torch.cat(flat)}


def _hook(model, cfg, last_epoch: int):
    """verl_patches' wrapped ``train_batch`` and a stand-in TrainingWorker around ``model``."""
    from verl.utils import tensordict_utils as tu

    from verl_patches.mini_batch import wrap_train_batch

    def train_batch(self, data):  # verl's would train; return the metrics dict it would
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {}})

    worker = SimpleNamespace(
        engine=SimpleNamespace(module=model, get_data_parallel_group=lambda: None,
                               lr_scheduler=SimpleNamespace(last_epoch=last_epoch)),
        engine_config=SimpleNamespace(infer_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                                      infer_max_token_len_per_gpu=None),
        infer_batch=functools.partial(_infer_batch, model),
        model_config=SimpleNamespace(tokenizer=CharTokenizer()), config=SimpleNamespace(model_type="language_model"),
        loss_fn=functools.partial(lambda **kw: None, config=SimpleNamespace(policy_loss=cfg)))
    return wrap_train_batch(train_batch), worker


def _stapo_cfg(**kw):
    from verl_patches.policy_loss_config import TokenSelectionLossConfig

    return TokenSelectionLossConfig(token_selection="s2t", tau_p=TAU_P, **{"stats_from": "rollout", **kw})


def _switch_on(monkeypatch, run_dir: Path) -> None:
    """Dump into ``run_dir`` (each test's worker is a fresh one: no mini-batch seen yet)."""
    monkeypatch.setenv(settings.DIR_ENV, str(run_dir))


@pytest.fixture
def dump_env(tmp_path, monkeypatch):
    """The dump on into ``tmp_path``: 6 responses, 2 tokens of context, no ids, default method."""
    _switch_on(monkeypatch, tmp_path)
    monkeypatch.setenv(settings.RESPONSES_ENV, "6")
    monkeypatch.setenv(settings.CONTEXT_ENV, "2")
    monkeypatch.delenv(settings.IDS_ENV, raising=False)
    monkeypatch.delenv(settings.METHOD_ENV, raising=False)
    return tmp_path


def _metrics_of(output) -> dict:
    from verl.utils import tensordict_utils as tu

    return dict(tu.get(output, "metrics"))


@pytest.mark.parametrize("layout", ["v1", "legacy"])
def test_dump_matches_independent_forward(model, batch, dump_env, layout, monkeypatch):
    from verl_patches.layout import to_padded

    hook, worker = _hook(model, _stapo_cfg(), last_epoch=4)
    data = _mini_batch(batch, layout, last=False)
    original = to_padded(data["response_mask"]).clone()
    metrics = _metrics_of(hook(worker, data))
    folded = to_padded(data["response_mask"])
    dump = td.read_dump(dump_env, progress=False)
    tokens, responses = dump.tokens, dump.responses
    assert td.dump_files(dump_env) == [td.step_file(dump_env, 5)]  # lr-scheduler count 4 -> step 5

    # metrics: the fold's and the dump's, side by side
    assert metrics["token_dump/records"] == len(tokens) + len(responses)
    assert metrics["token_dump/responses"] == len(responses) == 6
    assert metrics["token_dump/max_prob_diff"] < PROB_TOL and metrics["token_dump/seconds"] > 0
    assert all(r["tau_h"] == pytest.approx(metrics["s2t/tau_h"], abs=1e-7) for r in responses)
    assert sum(t["silenced"] for t in tokens) > 0 and any(not t["silenced"] for t in tokens)

    by_row = {r["row"]: r for r in responses}
    assert {r["uid"] for r in responses} <= {"group0", "group1"}
    for row, rec in by_row.items():
        src = batch[row]
        ref, m = src["ref"], src["mask"] != 0
        assert rec["uid"] == src["uid"] and rec["response_index"] == sum(b["uid"] == src["uid"] for b in batch[:row])
        assert rec["n_tokens"] == int(m.sum()) and rec["advantage"] == pytest.approx(src["adv"], abs=1e-6)
        cand = [t for t in tokens if t["row"] == row]
        want = [pos for pos in range(len(src["response"])) if m[pos] and src["adv"] > 0 and ref["p"][pos] < TAU_P]
        assert [t["position"] for t in cand] == want  # candidate set, recomputed independently
        q = rec["quadrants"]
        assert q["lowp_lowh"]["count"] + q["lowp_highh"]["count"] == (len(want) if src["adv"] > 0 else
                                                                      int((m & (ref["p"] < TAU_P)).sum()))
        for t in cand:
            pos, full = t["position"], src["prompt"] + src["response"]
            at = len(src["prompt"]) + pos
            probs = ref["probs"][pos]
            assert t["token_id"] == src["response"][pos] and t["token"] == f"t{t['token_id']}|"
            assert t["context_before"] == CharTokenizer().decode(full[max(0, at - 2) : at])
            assert t["context_after"] == CharTokenizer().decode(full[at + 1 : at + 3])
            assert t["prob"] == pytest.approx(float(ref["p"][pos]), abs=PROB_TOL)
            assert t["entropy"] == pytest.approx(float(ref["H"][pos]), abs=1e-5)
            g = math.sqrt(1 - 2 * float(ref["p"][pos]) + float((probs ** 2).sum()))
            assert t["grad_norm"] == pytest.approx(g, abs=1e-5)
            top_p, top_i = probs.topk(5)
            assert [s for s, _ in t["top5"]] == [f"t{i}|" for i in top_i.tolist()]
            assert [p for _, p in t["top5"]] == pytest.approx(top_p.tolist(), abs=PROB_TOL)
            # silenced exactly where the fold removed the token from the update
            assert t["silenced"] == bool(original[row, pos] != 0 and folded[row, pos] == 0)
            assert t["silenced"] == (t["entropy"] < rec["tau_h"] - 1e-6) or abs(t["entropy"] - rec["tau_h"]) < 1e-6
        assert rec["tau_h_source"] == "mini_batch" and rec["silenced_from"] == "update_mask"
    # every token's dlogp comes from the update's probe; this stand-in update leaves the weights unchanged
    assert all(t["dlogp"] == 0.0 for t in tokens)
    # a later mini-batch of the same step: no dump, no cost
    again = _metrics_of(hook(worker, _mini_batch(batch, layout, last=True)))
    assert not any(k.startswith("token_dump/") for k in again)
    assert len(td.read_dump(dump_env, progress=False).tokens) == len(tokens)
    # the next step's first mini-batch is dumped again
    worker.engine.lr_scheduler.last_epoch = 5
    _metrics_of(hook(worker, _mini_batch(batch, layout, last=True)))
    assert td.dump_files(dump_env) == [td.step_file(dump_env, 5), td.step_file(dump_env, 6)]


def test_both_layouts_dump_the_same_records(model, batch, dump_env, monkeypatch):
    """The TransferQueue (jagged) and legacy (padded) mini-batches of the same responses give
    identical records."""
    monkeypatch.setenv(settings.RESPONSES_ENV, "5")
    monkeypatch.setenv(settings.IDS_ENV, "1")
    dumps = {}
    for layout in ("v1", "legacy"):
        _switch_on(monkeypatch, dump_env / layout)
        hook, worker = _hook(model, _stapo_cfg(), last_epoch=0)
        hook(worker, _mini_batch(batch, layout, last=True))
        dumps[layout] = td.read_dump(dump_env / layout, progress=False)
    assert dumps["v1"] == dumps["legacy"]
    for r in dumps["v1"].responses:
        assert r["prompt_ids"] == batch[r["row"]]["prompt"] and r["response_ids"] == batch[r["row"]]["response"]


def test_s2t_inside_the_loss_is_recomputed(model, batch, dump_env, monkeypatch):
    """With S2T in the loss (scope=micro_batch) no mask is folded: ``silenced`` comes from S2T
    recomputed over the mini-batch, which here (one micro-batch = the mini-batch) is exactly what
    the fold would have silenced."""
    dumps = {}
    for name, cfg in (("fold", _stapo_cfg()), ("loss", _stapo_cfg(scope="micro_batch"))):
        _switch_on(monkeypatch, dump_env / name)
        hook, worker = _hook(model, cfg, last_epoch=0)
        metrics = _metrics_of(hook(worker, _mini_batch(batch, "v1", last=True)))
        assert ("s2t/tau_h" in metrics) == (name == "fold")
        dumps[name] = td.read_dump(dump_env / name, progress=False)
    def strip(recs):
        return [{k: v for k, v in r.items() if k != "silenced_from"} for r in recs]

    loss, fold = dumps["loss"].tokens, dumps["fold"].tokens
    assert strip(loss) == strip(fold) and any(t["silenced"] for t in loss)
    assert {r["silenced_from"] for r in dumps["loss"].responses} == {"s2t_recomputed"}


def test_forward_uses_the_engine_autocast():
    assert isinstance(hook._autocast(SimpleNamespace(), torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(hook._autocast(SimpleNamespace(_autocast_dtype=torch.float32), torch.device("cpu")),
                      contextlib.nullcontext)
    with hook._autocast(SimpleNamespace(_autocast_dtype=torch.bfloat16), torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_baseline_without_rollout_entropy(model, batch, dump_env, monkeypatch):
    """A baseline (verl's vanilla loss) on the legacy layout, which then carries no rollout entropy:
    tau_p = 0.002 unless the config has one, tau_h pooled over the sampled responses, nothing silenced."""
    from verl.workers.config import PolicyLossConfig

    from stapo_core import s2t_mask

    monkeypatch.setenv(settings.METHOD_ENV, "justrl")
    hook, worker = _hook(model, PolicyLossConfig(loss_mode="vanilla"), last_epoch=0)
    metrics = _metrics_of(hook(worker, _mini_batch(batch, "legacy", last=True, with_entropy=False)))
    assert not any(k.startswith("s2t/") for k in metrics)
    dump = td.read_dump(dump_env, progress=False)
    tokens, responses = dump.tokens, dump.responses
    assert all(r["method"] == "justrl" and r["tau_p"] == stapo_core.DEFAULT_TAU_P for r in responses)
    assert all(r["tau_h_source"] == "sampled" for r in responses) and not any(t["silenced"] for t in tokens)
    rows = [batch[r["row"]] for r in responses]
    width = max(len(b["response"]) for b in rows)

    def pad(xs):
        return torch.stack([torch.nn.functional.pad(x.float(), (0, width - len(x))) for x in xs])

    ref = s2t_mask(pad([b["ref"]["p"].log() for b in rows]), pad([b["ref"]["H"] for b in rows]),
                   pad([b["adv"] * b["mask"].float() for b in rows]), pad([b["mask"] for b in rows]),
                   tau_p=stapo_core.DEFAULT_TAU_P, q=stapo_core.DEFAULT_Q)
    want = ref.stats["tau_h"]
    assert all((r["tau_h"] is None) if math.isnan(want) else r["tau_h"] == pytest.approx(want, abs=1e-5)
               for r in responses)


def test_dump_off_writes_nothing(model, batch, tmp_path, monkeypatch):
    monkeypatch.delenv(settings.DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    hook, worker = _hook(model, _stapo_cfg(), last_epoch=0)
    metrics = _metrics_of(hook(worker, _mini_batch(batch, "v1", last=True)))
    assert "s2t/tau_h" in metrics and not any(k.startswith("token_dump/") for k in metrics)
    assert not list(tmp_path.rglob(td.TOKEN_DUMP_DIR))
    # the recipe's default leaves the workers' switch empty
    import yaml

    default = yaml.safe_load((REPO / "recipe/stapo/config/stapo_trainer.yaml").read_text())
    assert default["recipe"]["token_dump"]["dir"] == ""
    assert default["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"][settings.DIR_ENV] == "${recipe.token_dump.dir}"


# --------------------------------------------------------------------------------------------
# one real CPU run (slow)
# --------------------------------------------------------------------------------------------

#: "rare" for this test (0.5): the forking positions of the tiny task (p ~ 1/6 .. 1/3) are candidates,
#: and few tokens sit near the threshold (confident tokens have p ~ 0.99, where float noise between the
#: rollout's and the dump's forward could move a token across it)
REAL_TAU_P = shared_runs_table.STAPO_TAU_P
REAL_RESPONSES = shared_runs_table.DUMP_RESPONSES  # every response of the first mini-batch (2 prompts x 4)


@pytest.fixture(scope="module")
def real_run(shared_runs):
    """The suite's shared STAPO run (tests/helpers/shared_runs.py), which dumps every response of
    each step's first mini-batch with token ids, 8 tokens of context, ``tau_p=0.5``."""
    from recipe.stapo.metrics import read_metrics
    from stapo_cpu.assets import asset_paths

    run = shared_runs.get("stapo_v1")
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return SimpleNamespace(run=run, dir=run.run_dir, model=asset_paths(shared_runs.assets).model,
                           metrics=read_metrics(run.metrics), dump=td.read_dump(run.run_dir, progress=False))


@pytest.mark.slow
def test_real_run_dump_matches_initial_model(real_run):
    """Step 1's policy is the initial model: re-score every dumped response with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokens, responses = real_run.dump.tokens, real_run.dump.responses
    assert {r["step"] for r in responses} == {1, 2} == set(real_run.metrics)
    for step in (1, 2):  # one mini-batch per step, K responses (one rank)
        assert sum(r["step"] == step for r in responses) == REAL_RESPONSES
    model = AutoModelForCausalLM.from_pretrained(real_run.model, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(real_run.model)
    checked = 0
    for rec in (r for r in responses if r["step"] == 1):
        ref = _reference(model, rec["prompt_ids"], rec["response_ids"])
        mine = [t for t in tokens if t["step"] == 1 and t["row"] == rec["row"]]
        rare = [i for i, p in enumerate(ref["p"].tolist()) if p < REAL_TAU_P]
        assert [t["position"] for t in mine] == (rare if rec["advantage"] > 0 else [])
        for t in mine:
            pos = t["position"]
            assert t["token_id"] == rec["response_ids"][pos]
            assert t["token"] == tokenizer.decode([t["token_id"]])
            assert t["prob"] == pytest.approx(float(ref["p"][pos]), abs=1e-4)
            assert t["entropy"] == pytest.approx(float(ref["H"][pos]), abs=1e-4)
            top_p, top_i = ref["probs"][pos].topk(5)
            assert [p for _, p in t["top5"]] == pytest.approx(top_p.tolist(), abs=1e-4)
            assert [s for s, _ in t["top5"]] == [tokenizer.decode([i]) for i in top_i.tolist()]
            checked += 1
    assert checked > 0, "no candidate token at step 1: raise REAL_TAU_P"


@pytest.mark.slow
def test_real_run_quadrants_and_metrics(real_run):
    tokens, responses = real_run.dump.tokens, real_run.dump.responses
    assert tokens, "no candidate token in the run: raise REAL_TAU_P"
    # both outcomes occur (the shared run computes the same on every x86 machine, docs/testing.md)
    assert any(t["silenced"] for t in tokens) and not all(t["silenced"] for t in tokens), \
        f"{sum(t['silenced'] for t in tokens)} of {len(tokens)} candidates silenced: the check below needs both kinds"
    tau_h = {r["step"]: r["tau_h"] for r in responses}
    for t in tokens:  # STAPO silenced exactly the candidates below the mini-batch's tau_h (ties aside)
        if abs(t["entropy"] - tau_h[t["step"]]) > 1e-5:
            assert t["silenced"] == (t["entropy"] < tau_h[t["step"]]), t
    for rec in responses:
        q = {k: v["count"] for k, v in rec["quadrants"].items()}
        assert sum(q.values()) == rec["n_tokens"]
        mine = [t for t in tokens if (t["step"], t["row"]) == (rec["step"], rec["row"])]
        if rec["advantage"] > 0:  # the low-p quadrants of a positive response are its candidates
            assert q["lowp_lowh"] + q["lowp_highh"] == len(mine)
            assert q["lowp_lowh"] == sum(t["entropy"] < rec["entropy_split"] for t in mine)
        else:
            assert not mine
    for step, data in real_run.metrics.items():
        # tau_h of the records is the fold's: the step's logged S2T threshold (first mini-batch)
        taus = {r["tau_h"] for r in responses if r["step"] == step}
        assert len(taus) == 1 and all(r["tau_h_source"] == "mini_batch" for r in responses)
        assert data["actor/token_dump/max_prob_diff"] < 1e-4
        assert data["actor/token_dump/records"] == sum(r["step"] == step for r in tokens + responses)
        seconds, step_s = data["actor/token_dump/seconds"], data["timing_s/step"]
        print(f"[token dump] step {step}: dump {seconds:.3f} s of a {step_s:.1f} s step ({100 * seconds / step_s:.1f}%)")
        assert 0 < seconds < step_s


@pytest.mark.slow
def test_real_run_inspect_and_plots(real_run, tmp_path):
    out = tmp_path / "plots"
    for cmd in ([sys.executable, "-m", "recipe.stapo.inspect", str(real_run.dir)],
                [sys.executable, "-m", "recipe.stapo.plots", str(real_run.dir), "--out", str(out)]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
    report = (real_run.dir / "inspect" / "report.md").read_text()
    assert "Four-quadrant taxonomy" in report and (real_run.dir / "inspect" / "report.html").is_file()
    n_silenced = sum(t["silenced"] for t in real_run.dump.tokens)
    assert n_silenced > 0 and str(n_silenced) in report
    assert sorted(out.glob("*.png"))
