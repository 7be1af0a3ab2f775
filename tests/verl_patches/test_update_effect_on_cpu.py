"""verl_patches.update_effect through the actor's wrapper: the change of log-probability across each
update of the tokens S2T silences (STAPO) or would silence (the monitor), against an independent
computation.

A tiny random Qwen3 stands in for the actor. Its ``infer_batch`` (verl's inference pass) scores each
sequence of the batch it is given; its ``train_batch`` (verl's update) takes one SGD step on
``-sum(A * log p)`` over the response tokens the (possibly folded) mask keeps. The reference saves
the weights before and after every update, rebuilds the S2T sets from their definition
(:func:`stapo_core.s2t_mask` on the rollout statistics) and computes every token's log-probability
under both weights with a padded float64 forward of plain ``transformers``: the step's metrics must
be the token-weighted means of those differences, pooled over the step's mini-batches.
"""

from __future__ import annotations

import copy
import functools
import math
from types import SimpleNamespace

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from stapo_core import s2t_mask
from verl.utils import tensordict_utils as tu
from verl_patches.policy_loss_config import TokenSelectionLossConfig
from verl_patches.mini_batch import wrap_train_batch
from verl_patches.mini_batch_view import S2TSets
from verl_patches.update_effect import SETS, choose_rows

VOCAB, GROUPS, N = 48, 2, 4
TAU_P = 0.02
LR = 0.01  # plain SGD on a tiny model: log-probs move by about 0.1-1 in one step
REWARDS = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]]


def test_choose_rows_puts_silenced_rows_first():
    mask = torch.ones(5, 4, dtype=torch.bool)
    candidate = torch.zeros(5, 4, dtype=torch.bool)
    silenced = torch.zeros(5, 4, dtype=torch.bool)
    candidate[[0, 1, 3, 4], [1, 2, 0, 3]] = True
    silenced[[3, 1], [0, 2]] = True  # rows 1 and 3 hold a silenced token, rows 0 and 4 only kept candidates
    sets = S2TSets(mask=mask, silenced=silenced, candidate=candidate)
    assert choose_rows(sets, 10) == [1, 3, 0, 4]
    assert choose_rows(sets, 3) == [1, 3, 0]
    assert choose_rows(sets, 0) == []


@pytest.mark.parametrize("over, match", [
    (dict(update_effect_responses=-1), "update_effect_responses=-1 is invalid: expected an integer >= 0"),
    (dict(update_effect_responses=True), "update_effect_responses=True is invalid"),
    (dict(update_effect_responses=2), "without S2T's selection: set .*s2t_monitor=true"),
    (dict(token_selection="s2t", scope="micro_batch", update_effect_responses=2), "scope=micro_batch"),
])
def test_bad_settings_name_the_key(over, match):
    with pytest.raises(ValueError, match=match):
        TokenSelectionLossConfig(**over)


# --------------------------------------------------------------------------------------------
# the wrapper with a tiny model
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         initializer_range=0.4, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def _sequence_log_probs(model, seq: torch.Tensor) -> torch.Tensor:
    """``(L,)`` float32: entry k is log p(seq[k+1] | seq[:k+1]) (the last entry 0), verl's flat layout."""
    logits = model(input_ids=seq[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None]).squeeze(-1)
    return torch.cat([lp, lp.new_zeros(1)])


class TinyWorker:
    """The parts of verl's ``TrainingWorker`` the wrapper uses, around a real tiny model.

    ``infer_batch`` returns the log-probs of every sequence of the batch it is given (one unbatched
    forward each, verl's flat layout); the wrapped ``train_batch`` records the weights before the
    update, takes one SGD step on ``-sum(A log p)`` over the kept response tokens, and records the
    weights after it."""

    def __init__(self, model, cfg):
        self.model = model
        self.loss_fn = functools.partial(lambda **kw: None, config=SimpleNamespace(policy_loss=cfg))
        self.engine = SimpleNamespace(module=model, get_data_parallel_group=lambda: None)
        self.engine_config = SimpleNamespace(infer_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                                             infer_max_token_len_per_gpu=None)
        self.model_config = SimpleNamespace(tokenizer=SimpleNamespace(
            decode=lambda ids, skip_special_tokens=False: " ".join(str(int(i)) for i in ids)))
        self.infer_sizes, self.updates = [], []
        self.train_batch = wrap_train_batch(TinyWorker._update)

    @torch.no_grad()
    def infer_batch(self, data):
        assert not tu.get(data, "calculate_entropy") and not tu.get(data, "compute_loss")
        self.infer_sizes.append(len(data))
        return {"log_probs": torch.cat([_sequence_log_probs(self.model, seq) for seq in data["input_ids"].unbind()])}

    def _update(self, data):
        before = copy.deepcopy(self.model.state_dict())
        keep = _padded(data["response_mask"]).float()
        adv = _padded(data["advantages"]).float()
        loss = 0.0
        for i, (seq, response) in enumerate(zip(data["input_ids"].unbind(), data["responses"].unbind())):
            n = len(response)
            lp = _sequence_log_probs(self.model, seq)[-n - 1 : -1]
            loss = loss - (adv[i, :n] * keep[i, :n] * lp).sum()
        self.model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in self.model.parameters():
                p -= LR * p.grad
        self.updates.append({"before": before, "after": copy.deepcopy(self.model.state_dict()),
                             "kept": keep.clone()})
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {}})


def _padded(t: torch.Tensor) -> torch.Tensor:
    from verl_patches.layout import to_padded

    return to_padded(t)


def _rows(model, seed: int):
    """One mini-batch's rows (GROUPS x N responses): ids, the model's own p and H as the rollout
    statistics (so tokens below TAU_P are S2T candidates), GRPO advantages."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    r = torch.tensor(REWARDS)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
    for i in range(GROUPS * N):
        prompt = torch.randint(1, VOCAB, (3 + i % 2,), generator=gen)
        response = torch.randint(1, VOCAB, (7 + (i * 3) % 5,), generator=gen)
        seq = torch.cat([prompt, response])
        with torch.no_grad():
            logits = model(input_ids=seq[None]).logits[0, len(prompt) - 1 : -1].double()
        logp = torch.log_softmax(logits, -1)
        rows.append({"prompt": prompt, "response": response, "adv": float(adv[i]),
                     "old": logp.gather(-1, response[:, None]).squeeze(-1).float(),
                     "entropy": -(logp.exp() * logp).sum(-1).float()})
    return rows


def _mini_batch(rows, *, last: bool):
    """The TransferQueue trainer's mini-batch layout: every per-token field jagged."""
    from tensordict import TensorDict

    def jag(values):
        return torch.nested.as_nested_tensor(values, layout=torch.jagged)

    seqs = [torch.cat([r["prompt"], r["response"]]) for r in rows]
    data = TensorDict({
        "prompts": jag([r["prompt"] for r in rows]), "responses": jag([r["response"] for r in rows]),
        "input_ids": jag(seqs), "position_ids": jag([torch.arange(len(s)) for s in seqs]),
        "response_mask": jag([torch.ones(len(r["response"]), dtype=torch.long) for r in rows]),
        "loss_mask": jag([torch.ones(len(r["response"]), dtype=torch.long) for r in rows]),
        "old_log_probs": jag([r["old"] for r in rows]), "entropy": jag([r["entropy"] for r in rows]),
        "advantages": jag([torch.full((len(r["response"]),), r["adv"]) for r in rows]),
    }, batch_size=[len(rows)])
    tu.assign_non_tensor(data, temperature=1.0, update_lr_scheduler=last)
    return data


def _padded_rows(rows, key):
    """``(B, R)`` of a per-token key (``old``, ``entropy``) or the response's advantage (``adv``)."""
    width = max(len(r["response"]) for r in rows)
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r["response"])] = r[key]
    return out


def _reference_log_probs(model, state, rows) -> torch.Tensor:
    """``(B, R)`` float64 log-probs of the response tokens under ``state``: one padded forward of
    plain transformers (right padding, attention mask), independent of the worker's code path."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(state)
    ref = ref.double()
    seqs = [torch.cat([r["prompt"], r["response"]]) for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = s, 1
    with torch.no_grad():
        logp = torch.log_softmax(ref(input_ids=ids, attention_mask=attn).logits, -1)
    out = torch.zeros(len(rows), max(len(r["response"]) for r in rows), dtype=torch.float64)
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["response"])
        out[i, :n] = logp[i, p - 1 : p - 1 + n].gather(-1, r["response"][:, None]).squeeze(-1)
    return out


def _reference_sets(rows, cfg):
    width = max(len(r["response"]) for r in rows)
    mask = (torch.arange(width)[None] < torch.tensor([len(r["response"]) for r in rows])[:, None]).float()
    result = s2t_mask(_padded_rows(rows, "old"), _padded_rows(rows, "entropy"), _padded_rows(rows, "adv"), mask,
                      tau_p=cfg.tau_p, q=cfg.q)
    inside = mask != 0
    silenced = inside & (result.keep == 0)
    return {"silenced": silenced, "kept_candidates": result.candidate & ~silenced, "all": inside}


def _run_step(model, cfg, seeds):
    """One step of ``len(seeds)`` mini-batches through the wrapper; returns the worker, each
    mini-batch's rows and each update's merged metrics."""
    worker = TinyWorker(model, cfg)
    batches = [_rows(model, seed) for seed in seeds]
    metrics = []
    for k, rows in enumerate(batches):
        out = worker.train_batch(worker, _mini_batch(rows, last=k == len(batches) - 1))
        metrics.append(dict(tu.get(out, "metrics")))
    return worker, batches, metrics


@pytest.mark.parametrize("method", ["stapo", "monitor"])
def test_step_metrics_match_an_independent_forward(model, method):
    """Two mini-batches, every candidate-holding response measured: the step's dlogp of silenced
    tokens, kept candidates and all tokens equal the reference's pooled means."""
    model = copy.deepcopy(model)
    selection = {"token_selection": "s2t"} if method == "stapo" else {"s2t_monitor": True}
    cfg = TokenSelectionLossConfig(tau_p=TAU_P, stats_from="rollout", update_effect_responses=GROUPS * N, **selection)
    worker, batches, metrics = _run_step(model, cfg, seeds=(1, 2))
    assert "s2t/dlogp_all" not in metrics[0]  # the step's sums are complete only after its last update
    got = metrics[-1]
    assert got["s2t/applied"] == (1.0 if method == "stapo" else 0.0)
    sums = {name: 0.0 for name in SETS}
    counts = {name: 0 for name in SETS}
    responses = 0
    for rows, update in zip(batches, worker.updates):
        sets = _reference_sets(rows, cfg)
        measured = (sets["silenced"] | sets["kept_candidates"]).any(-1)  # rows holding a candidate
        dlogp = (_reference_log_probs(model, update["after"], rows)
                 - _reference_log_probs(model, update["before"], rows))
        responses += int(measured.sum())
        for name in SETS:
            selected = sets[name] & measured[:, None]
            sums[name] += float(dlogp[selected].sum())
            counts[name] += int(selected.sum())
        # STAPO's update did not train on the silenced tokens; the monitor's trained on every token
        kept = update["kept"][:, : sets["silenced"].shape[1]]
        trained_on_silenced = bool((kept[sets["silenced"]] != 0).any())
        assert trained_on_silenced == (method == "monitor") or not sets["silenced"].any()
    assert counts["silenced"] > 0 and counts["kept_candidates"] > 0
    assert got["s2t/dlogp_responses"] == responses
    for name in SETS:
        assert got[f"s2t/dlogp_{name}_tokens"] == counts[name]
        assert got[f"s2t/dlogp_{name}"] == pytest.approx(sums[name] / counts[name], abs=1e-5)
    assert got["s2t/dlogp_seconds"] > 0
    # two forwards (before, after) of the measured rows per mini-batch, nothing else
    assert len(worker.infer_sizes) == 4


def test_the_limit_keeps_the_silenced_rows(model):
    """With room for one response per mini-batch, the measured one holds a silenced token."""
    cfg = TokenSelectionLossConfig(tau_p=TAU_P, s2t_monitor=True, update_effect_responses=1)
    worker, batches, metrics = _run_step(copy.deepcopy(model), cfg, seeds=(1, 2))
    sets = [_reference_sets(rows, cfg) for rows in batches]
    assert all(bool(s["silenced"].any()) for s in sets)
    assert metrics[-1]["s2t/dlogp_responses"] == 2 and worker.infer_sizes == [1, 1, 1, 1]
    want = sum(int(s["silenced"][int(torch.nonzero(s["silenced"].any(-1))[0])].sum()) for s in sets)
    assert metrics[-1]["s2t/dlogp_silenced_tokens"] == want


def test_no_candidate_no_forward(model):
    """A step without any candidate measures nothing: no forward, zero counts, no mean."""
    cfg = TokenSelectionLossConfig(tau_p=1e-9, s2t_monitor=True, update_effect_responses=4)
    worker, _, metrics = _run_step(copy.deepcopy(model), cfg, seeds=(1,))
    assert worker.infer_sizes == []
    assert metrics[-1]["s2t/dlogp_responses"] == 0 and metrics[-1]["s2t/dlogp_silenced_tokens"] == 0
    assert not any(k in metrics[-1] for k in ("s2t/dlogp_silenced", "s2t/dlogp_kept_candidates", "s2t/dlogp_all"))


def test_off_by_default(model):
    cfg = TokenSelectionLossConfig(tau_p=TAU_P, s2t_monitor=True)
    worker, _, metrics = _run_step(copy.deepcopy(model), cfg, seeds=(1, 2))
    assert worker.infer_sizes == [] and not any(k.startswith("s2t/dlogp") for m in metrics for k in m)
    assert math.isfinite(metrics[0]["s2t/tau_h"])  # the monitor itself ran


def test_the_token_dump_reads_the_same_probe(model, tmp_path, monkeypatch):
    """With the token dump on, one probe (one forward before and one after the update, of the measured
    and the dumped responses together) serves both: every dumped token's dlogp is the reference change
    of its log-probability across the update, and the step's metrics stay those of the measured rows."""
    from stapo_core import token_records as td
    from verl_patches.token_dump import settings

    monkeypatch.setenv(settings.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(settings.RESPONSES_ENV, "3")
    model = copy.deepcopy(model)
    cfg = TokenSelectionLossConfig(token_selection="s2t", tau_p=TAU_P, stats_from="rollout", update_effect_responses=2)
    worker, (rows,), (metrics,) = _run_step(model, cfg, seeds=(1,))
    assert len(worker.infer_sizes) == 2 and worker.infer_sizes[0] >= 2  # before and after, every probed row
    assert metrics["s2t/dlogp_responses"] == 2 and metrics["token_dump/responses"] == 3
    update = worker.updates[0]
    want = (_reference_log_probs(model, update["after"], rows) - _reference_log_probs(model, update["before"], rows))
    tokens = td.read_dump(tmp_path, progress=False).tokens
    assert tokens
    for t in tokens:
        assert t["dlogp"] == pytest.approx(float(want[t["row"], t["position"]]), abs=1e-5)
