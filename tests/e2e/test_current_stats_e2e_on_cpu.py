"""``stats_from=current`` (Algorithm 1) on verl's real trainer on CPU, against an independent forward.

One STAPO run (TransferQueue trainer, 2 steps, 4 mini-batches per step, a learning rate that
visibly moves the tiny policy between mini-batches) on two data-parallel ranks
(``trainer.n_gpus_per_node=2``, gloo), with ``tests.helpers.minibatch_recorder`` loaded into every verl
process: before each mini-batch update it saves the actor's full weights and the mini-batch, and after
the recipe's fold the ``response_mask`` the engine trained on, the sequences the statistics forward
covered and the recipe's S2T metrics. For every mini-batch (both ranks' parts together) the test then

- builds the tiny model from the recorded weights with plain ``transformers`` (padded eager
  forward, float64 softmax: no verl code), computes each response token's probability and entropy
  for every sequence of the mini-batch,
- applies S2T from its definition (candidates ``A > 0`` and ``p < tau_p``; ``tau_h`` the
  ``q``-quantile of the candidates' entropies over the whole mini-batch; silence ``H < tau_h``),
- and compares the silenced set and ``tau_h`` with the ones the trainer folded in and logged.

The trainer forwards only the positive-advantage sequences (``current_forward=positive_advantage``,
the default), moved between the ranks to balance their tokens; the reference forwards every
sequence. The actor runs its update and its no-grad statistics forward one sequence at a time, so a
selection pooled per micro-batch (or taken from the rollout policy) would not match. The two-rank run
has a mini-batch in which one rank holds no positive-advantage sequence: the recorder injects it
(rank 1's advantages of mini-batch :data:`NO_POSITIVE_CALL` become ``-|A|``).

The other events the tests need (mini-batches whose rollout and current statistics silence
different tokens, or whose per-micro-batch pooling differs, tokens silenced) come from the run's
settings on the shipped assets: the run computes the same numbers on every x86 machine (the CPU
path holds the math libraries to AVX2), and each test fails when its event does not occur.

The same recorded weights, before and after every update, give the update effect
(``actor/s2t/dlogp_*``) independently: the change of each response token's log-probability across
its mini-batch's update, pooled over the step, for the silenced tokens, the kept candidates and
every token of the responses holding a candidate. Its two forwards (before and after the update)
are the last two inference calls of a mini-batch that holds a candidate.

The run must also train and log the S2T metrics.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import pytest
import torch

from recipe.stapo.metrics import read_metrics
from stapo_cpu.assets import asset_paths
from stapo_cpu.trainer import EXTERNAL_MODULES, run_cpu_trainer
from stapo_core import DEFAULT_Q
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow

RECORDER = "tests.helpers.minibatch_recorder"
LR = 1e-3  # large for the tiny model: some of its log-probs move by more than 1 within one update
#: far above the paper's 0.002 so that every mini-batch of 8 responses has enough candidates, spread
#: over several sequences, for the quantile and its pooling to matter (a mini-batch with one
#: candidate silences nothing; one whose candidates sit in one sequence pools the same per micro-batch).
#: The threshold's value is not what this test is about (the quickstart runs the paper's)
TAU_P = 0.2
MICRO = 1  # sequences per micro-batch (update and statistics forward); a mini-batch holds 8
#: probabilities / entropies this close to a threshold may fall on either side between two
#: float32 forwards computed in different orders; such tokens are reported, not compared
NEAR = 1e-4
#: data-parallel ranks of the run (one rank is a special case of two: the rank holding all of a
#: mini-batch's positive-advantage sequences forwards them all, which the two-rank run also shows)
RANKS = 2
#: the mini-batch (call index over the run: step 1's second) on which rank 1 is given no
#: positive-advantage sequence (tests.helpers.minibatch_recorder)
NO_POSITIVE_CALL = 1
#: the rows of a mini-batch, concatenated over its ranks (padded to the widest)
ROW_FIELDS = ("responses", "advantages", "old_log_probs", "entropy", "response_mask", "folded")


@pytest.fixture(scope="module")
def records(assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("current_stats") / f"{RANKS}-ranks"
    record_dir = run_dir / "records"
    modules = ",".join([*EXTERNAL_MODULES, RECORDER])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STAPO_TEST_RECORD_DIR", str(record_dir))
        mp.setenv("STAPO_TEST_NO_POSITIVE_AT", f"{NO_POSITIVE_CALL}:1")
        mp.setenv("VERL_USE_EXTERNAL_MODULES", modules)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        run = run_cpu_trainer(
            "stapo", assets, run_dir, steps=2, prompts=8, n=4, mini_batch_prompts=2, lr=LR, timeout=600,
            extra=[
                "actor_rollout_ref.actor.policy_loss.stats_from=current",
                f"actor_rollout_ref.actor.policy_loss.tau_p={TAU_P}",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO}",
                f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{modules}'",
                f"++ray_kwargs.ray_init.runtime_env.env_vars.STAPO_TEST_RECORD_DIR='{record_dir}'",
                f"++ray_kwargs.ray_init.runtime_env.env_vars.STAPO_TEST_NO_POSITIVE_AT='{NO_POSITIVE_CALL}:1'",
                f"trainer.n_gpus_per_node={RANKS}", f"ray_kwargs.ray_init.num_gpus={RANKS}",
            ],
        )
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    by_call = defaultdict(list)
    for f in sorted(record_dir.glob("*.pt")):
        by_call[f.stem.split("_mb")[1]].append(torch.load(f, weights_only=False))
    assert len(by_call) == 8 and all(len(v) == RANKS for v in by_call.values()), \
        f"expected 2 steps x 4 mini-batches on {RANKS} ranks, got {[f.name for f in record_dir.glob('*.pt')]}"
    out, next_is_first = [], True
    for call in sorted(by_call):
        rec = combine(sorted(by_call[call], key=lambda r: r["rank"]))
        rec["first"], next_is_first = next_is_first, rec["update_lr_scheduler"]
        out.append(rec)
    return {"records": out, "model": asset_paths(assets).model, "metrics": run.metrics}


def combine(parts):
    """One mini-batch's record from its ranks' parts: rows concatenated in rank order (``rank_of``
    says which rank held each row), rank 0's weights (before and after the update) and metrics, every rank's forwards."""
    rec = {"weights": parts[0]["weights"], "weights_after": parts[0]["weights_after"], "metrics": parts[0].get("metrics", {}),
           "update_lr_scheduler": parts[0]["update_lr_scheduler"],
           "infer_calls": [p["infer_calls"] for p in parts],
           "infer_responses": [p["infer_responses"] for p in parts],
           "rank_of": torch.cat([torch.full((p["responses"].shape[0],), p["rank"]) for p in parts])}
    width = max(p["responses"].shape[1] for p in parts)
    for name in ROW_FIELDS:
        rec[name] = torch.cat([torch.nn.functional.pad(p[name], (0, width - p[name].shape[1])) for p in parts])
    for name in ("input_ids_rows", "position_ids_rows", "attention_mask_rows"):
        if name in parts[0]:
            rec[name] = [row for p in parts for row in p[name]]
    return rec


def _sequence(rec, i):
    """(input_ids, position_ids) of sequence ``i`` without padding, and where its response starts."""
    ids, pos = rec["input_ids_rows"][i], rec["position_ids_rows"][i]
    if "attention_mask_rows" in rec:  # padded layout; verl's v1 trainer holds jagged rows without padding
        keep = rec["attention_mask_rows"][i].bool()
        ids, pos = ids[keep], pos[keep]
    return ids, pos


def independent_statistics(model, rec):
    """(log p, entropy) of every response token under ``model``: one padded forward per sequence
    (prompt + response without padding), float64 softmax of the logits."""
    responses, mask = rec["responses"], rec["response_mask"].bool()
    log_prob = torch.zeros(responses.shape, dtype=torch.float64)
    entropy = torch.zeros(responses.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(responses.shape[0]):
            n = int(mask[i].sum())
            ids, pos = _sequence(rec, i)
            # the response is the last n tokens of the unpadded sequence (right-padded responses end there)
            assert torch.equal(ids[len(ids) - n:], responses[i, :n]), "recorded sequence does not end with its response"
            logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0].double()
            logp = torch.log_softmax(logits[len(ids) - n - 1: len(ids) - 1], dim=-1)  # temperature 1.0
            log_prob[i, :n] = logp.gather(-1, responses[i, :n, None])[:, 0]
            entropy[i, :n] = -(logp.exp() * logp).sum(-1)
    return log_prob, entropy


def reference_silenced(log_prob, entropy, advantages, mask, tau_p=TAU_P, q=DEFAULT_Q, pool_rows=None):
    """S2T from its definition. ``pool_rows``: compute ``tau_h`` per block of that many rows (a
    micro-batch reading) instead of over the whole mini-batch. Returns (silenced, candidate, tau_h per row)."""
    candidate = mask & (advantages > 0) & (log_prob < math.log(tau_p))
    rows = mask.shape[0]
    block = pool_rows or rows
    silenced = torch.zeros_like(mask)
    tau_h = torch.full((rows,), math.nan, dtype=torch.float64)
    for start in range(0, rows, block):
        sl = slice(start, start + block)
        if candidate[sl].any():
            tau = torch.quantile(entropy[sl][candidate[sl]].double(), q)
            silenced[sl] = candidate[sl] & (entropy[sl] < tau)
            tau_h[sl] = tau
    return silenced, candidate, tau_h


@pytest.fixture(scope="module")
def compared(records):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(records["model"], attn_implementation="eager", dtype=torch.float32)
    model.eval()
    rows = []
    for rec in records["records"]:
        missing, unexpected = model.load_state_dict(rec["weights"], strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied embeddings
        log_prob, entropy = independent_statistics(model, rec)
        mask = rec["response_mask"].bool()
        advantages = rec["advantages"].double()
        silenced, candidate, tau_h = reference_silenced(log_prob, entropy, advantages, mask)
        near = candidate.new_zeros(candidate.shape)
        near |= mask & (log_prob - math.log(TAU_P)).abs().lt(NEAR)
        near |= candidate & (entropy - tau_h[:, None]).abs().lt(NEAR)
        rows.append({
            "rec": rec, "log_prob": log_prob, "entropy": entropy, "mask": mask, "advantages": advantages,
            "reference": silenced, "near": near,
            "trained": mask & ~rec["folded"].bool()[:, : mask.shape[1]], "tau_h": tau_h,
        })
    return rows


def test_every_mini_batch_silences_what_an_independent_forward_of_its_policy_gives(compared):
    """Mini-batch 1: the rollout statistics (= the policy before any update); mini-batches 2+: the
    policy after the previous mini-batches' updates. Both equal the independent reference."""
    assert sum(int(r["reference"].sum()) for r in compared if not r["rec"]["first"]) > 0, "nothing silenced"
    for k, r in enumerate(compared):
        compare = ~r["near"]
        assert int(r["near"].sum()) <= 2, f"mini-batch {k}: {int(r['near'].sum())} tokens on a threshold"
        assert torch.equal(r["trained"] & compare, r["reference"] & compare), (
            f"mini-batch {k}: trained silenced {int(r['trained'].sum())}, reference {int(r['reference'].sum())}")


def test_later_mini_batches_see_a_moved_policy(compared):
    """The test can tell current from rollout statistics: on mini-batches 2+ the policy has moved
    visibly, once any earlier mini-batch of the run had a gradient (the shipped assets' first
    mini-batch has none: all its groups are all right or all wrong, and AdamW then only decays the
    weights; after a gradient its momentum keeps moving them), and the rollout-time statistics give
    a different silenced set in at least one."""
    differs, moved_checked, had_gradient = 0, 0, False
    for k, r in enumerate(compared):
        rec, mask = r["rec"], r["mask"]
        moved = (r["log_prob"] - rec["old_log_probs"].double()).abs()[mask].max().item()
        if rec["first"]:
            assert moved < 1e-3, f"mini-batch {k}: the first mini-batch's old log-probs are the current policy's (moved {moved})"
        elif had_gradient:
            assert moved > 0.05, f"mini-batch {k}: lr={LR} did not move the policy visibly (max |d log p| = {moved})"
            moved_checked += 1
        had_gradient |= bool((r["advantages"][mask] != 0).any())
        if not rec["first"]:
            rollout, _, _ = reference_silenced(rec["old_log_probs"].double(), rec["entropy"].double(),
                                               r["advantages"], mask)
            differs += int(not torch.equal(rollout, r["reference"]))
    assert moved_checked >= 4, f"only {moved_checked} later mini-batches follow an update with a gradient"
    assert differs >= 1, "the rollout statistics silence the same tokens as the current ones on every mini-batch"


def test_tau_h_is_pooled_over_the_mini_batch_not_the_micro_batch(compared):
    """The actor ran in micro-batches of one sequence; the per-micro-batch reading differs from the
    trained set in at least one mini-batch, the mini-batch reading in none (previous test)."""
    differs = 0
    for r in compared:
        per_micro, _, _ = reference_silenced(r["log_prob"], r["entropy"], r["advantages"], r["mask"], pool_rows=MICRO)
        differs += int(not torch.equal(per_micro & ~r["near"], r["trained"] & ~r["near"]))
    assert differs >= 1


def test_tau_h_equals_the_full_forwards(compared):
    """The logged tau_h of every mini-batch with candidates is the reference's (float32 forward)."""
    checked = 0
    for k, r in enumerate(compared):
        logged = r["rec"]["metrics"].get("s2t/tau_h")
        reference = r["tau_h"][~torch.isnan(r["tau_h"])]
        if reference.numel() == 0:
            assert logged is None, f"mini-batch {k}: tau_h {logged} logged without candidates"
            continue
        assert logged == pytest.approx(reference[0].item(), abs=NEAR), f"mini-batch {k}"
        checked += not r["rec"]["first"]
    assert checked >= 3  # of the 6 mini-batches with current-policy statistics


def positive_responses(r):
    """The response token ids of the mini-batch's sequences with a positive advantage."""
    rec, mask = r["rec"], r["mask"]
    return sorted(tuple(rec["responses"][i, : int(mask[i].sum())].tolist()) for i in range(mask.shape[0])
                  if bool(((r["advantages"][i] > 0) & mask[i]).any()))


def test_only_the_positive_advantage_sequences_are_forwarded_and_none_on_the_first(compared):
    """No forward on a step's first mini-batch; on each later one every positive-advantage sequence
    exactly once (one per micro-batch), plus repeats of one of them that keep the ranks in step, and
    no other sequence; every rank runs the same number of forwards."""
    for k, r in enumerate(compared):
        rec = r["rec"]
        assert len(set(rec["infer_calls"])) == 1, f"mini-batch {k}: ranks ran {rec['infer_calls']} forwards"
        forwarded = sorted(seq for rank in statistics_calls(r) for call in rank for seq in call)
        if rec["first"]:
            assert forwarded == [], f"mini-batch {k}"
            continue
        wanted = positive_responses(r)
        extra = list(forwarded)
        for seq in wanted:
            extra.remove(seq)  # ValueError if a positive sequence was not forwarded
        assert len(set(extra)) <= 1 and set(extra) <= set(wanted), f"mini-batch {k}: forwarded other sequences"
        assert all(len(call) == MICRO for rank in statistics_calls(r) for call in rank)


def test_the_two_rank_run_has_a_rank_without_positive_advantage(compared):
    """The injected mini-batch has rank 1 without a positive-advantage sequence and rank 0 with
    some (its statistics then came from rank 0's sequences); the other tests check it like the rest."""
    r = compared[NO_POSITIVE_CALL]
    positive = ((r["advantages"] > 0) & r["mask"]).any(-1)
    assert not r["rec"]["first"], "the injected mini-batch must be a later one (current statistics)"
    assert not bool(positive[r["rec"]["rank_of"] == 1].any()), "rank 1 holds a positive-advantage sequence"
    assert bool(positive[r["rec"]["rank_of"] == 0].any()), "rank 0 holds no positive-advantage sequence either"


def statistics_calls(r):
    """Each rank's inference calls of the statistics forward: all but the update effect's last two."""
    effect = 2 if _measured_rows(r).any() else 0
    return [rank[: len(rank) - effect] for rank in r["rec"]["infer_responses"]]


def test_the_update_effect_forwards_the_responses_holding_a_candidate_before_and_after(compared):
    """The update effect's two calls (the last two of a mini-batch with a candidate) forward the
    responses holding a candidate, the same ones both times (a rank holding none repeats one row)."""
    measured_any = False
    for k, r in enumerate(compared):
        rec, rows = r["rec"], _measured_rows(r)
        if not rows.any():
            continue
        measured_any = True
        wanted = sorted(tuple(rec["responses"][i, : int(r["mask"][i].sum())].tolist()) for i in range(len(rows)) if rows[i])
        before = sorted(seq for rank in rec["infer_responses"] for seq in rank[-2])
        after = sorted(seq for rank in rec["infer_responses"] for seq in rank[-1])
        assert before == after, f"mini-batch {k}: different responses before and after the update"
        assert set(wanted) <= set(before), f"mini-batch {k}: a response holding a candidate was not measured"
        for rank in rec["infer_responses"]:  # a rank with nothing to measure repeats one row (ranks in step)
            assert set(rank[-2]) <= set(wanted) or len(set(rank[-2])) == 1, f"mini-batch {k}"
    assert measured_any


def _measured_rows(r):
    """The rows whose update effect the actor measured: those holding a candidate (the run measures
    every response of a mini-batch)."""
    candidate = r["mask"] & (r["advantages"] > 0) & (r["log_prob"] < math.log(TAU_P))
    return candidate.any(-1)


def test_update_effect_matches_the_recorded_weights(compared, records):
    """Per step: the logged mean change of log-probability across each update, of the silenced
    tokens, the kept candidates and every token of the measured responses, against an independent
    forward of the weights recorded before and after each update (float64, plain transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(records["model"], attn_implementation="eager", dtype=torch.float32)
    model.eval()
    steps = read_metrics(records["metrics"])
    sums, counts, step, checked = {}, {}, 1, 0
    for r in compared:
        rec = r["rec"]
        model.load_state_dict(rec["weights_after"], strict=False)
        after, _ = independent_statistics(model, rec)
        rows = _measured_rows(r)
        candidate = r["mask"] & (r["advantages"] > 0) & (r["log_prob"] < math.log(TAU_P))
        sets = {"silenced": r["trained"], "kept_candidates": candidate & ~r["trained"], "all": r["mask"]}
        for name, tokens in sets.items():
            selected = tokens & rows[:, None]
            sums[name] = sums.get(name, 0.0) + float((after - r["log_prob"])[selected].sum())
            counts[name] = counts.get(name, 0) + int(selected.sum())
        sums["responses"] = sums.get("responses", 0) + int(rows.sum())
        if rec["update_lr_scheduler"]:  # the step's last mini-batch: its metrics are complete
            logged = steps[step]
            assert logged["actor/s2t/dlogp_responses"] == sums["responses"]
            for name in sets:
                assert logged[f"actor/s2t/dlogp_{name}_tokens"] == counts[name], (step, name)
                if counts[name]:
                    assert logged[f"actor/s2t/dlogp_{name}"] == pytest.approx(sums[name] / counts[name], abs=2e-4)
                    checked += 1
            sums, counts, step = {}, {}, step + 1
    assert step == 3 and checked >= 4, (step, checked)  # both steps, silenced tokens among them


def test_the_run_trains_and_logs_the_s2t_metrics(records):
    from tests.e2e.test_trainer_e2e_on_cpu import check_training_happened

    steps = read_metrics(records["metrics"])
    check_training_happened(steps, {1, 2})
    for step in (1, 2):
        s2t = {k: v for k, v in steps[step].items() if k.startswith("actor/s2t/")}
        assert all(math.isfinite(v) for v in s2t.values())
        assert 0 <= s2t["actor/s2t/silenced"] <= s2t["actor/s2t/candidates"] <= s2t["actor/s2t/tokens"]
        assert "actor/s2t/grad_norm_kept" in s2t  # rollout-time sum_pi_squared reached the actor
        assert 0.0 <= s2t["actor/s2t/rollout_agreement"] <= 1.0  # both statistics existed on mini-batches 2+
        frac, slowest = s2t["actor/s2t/current_forward_tokens_frac"], s2t["actor/s2t/current_forward_slowest_rank_frac"]
        assert 0.0 < frac < 1.0  # only the positive-advantage sequences
        assert 0.0 < slowest