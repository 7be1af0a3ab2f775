"""Pooling over a process group: 2 gloo ranks must agree with one process on the concatenated batch.

All cases run in one spawn (one process-group start-up): ranks hold different numbers of
candidates / response tokens, different response lengths, one rank or every rank without any.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist_utils import SyncRecorder, run_on_ranks
from stapo_core import s2t_mask, entropy_topk_mask
from stapo_core.distributed import exchange_objects, gather_objects

WORLD = 2


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------


def _s2t_rank(seed, batch, width, rare_frac, adv_sign=None):
    """(log_prob, entropy, advantages (batch,), mask) with about ``rare_frac`` rare tokens."""
    gen = torch.Generator().manual_seed(seed)
    rare = torch.rand(batch, width, generator=gen) < rare_frac
    log_prob = torch.where(rare, math.log(1e-3), math.log(0.3)) + 0.1 * torch.randn(batch, width, generator=gen)
    entropy = torch.rand(batch, width, generator=gen) * 3
    adv = torch.randn(batch, generator=gen).abs() + 0.1
    if adv_sign is None:
        adv = adv * torch.where(torch.arange(batch) % 3 == 2, -1.0, 1.0)
    else:
        adv = adv * adv_sign
    mask = (torch.rand(batch, width, generator=gen) > 0.15).float()
    return log_prob, entropy, adv, mask


def _one_candidate_rank(seed):
    """A rank whose only candidate is token (1, 5)."""
    log_prob, entropy, _, _ = _s2t_rank(seed, 2, 12, 0.0)
    log_prob[1, 5] = math.log(1e-3)
    return log_prob, entropy, torch.ones(2), torch.ones(2, 12)


def _top_rank(seed, batch, width, empty=False):
    """(entropy quantized to 4 values, so that ties are everywhere, mask)."""
    gen = torch.Generator().manual_seed(seed)
    entropy = torch.randint(0, 4, (batch, width), generator=gen).float() / 2
    mask = torch.zeros(batch, width) if empty else (torch.rand(batch, width, generator=gen) > 0.2).float()
    return entropy, mask


def _s2t_case(name, strategy, q, ranks):
    return {"name": name, "strategy": strategy, "q": q, "ranks": ranks}


def _s2t_cases():
    variable = [_s2t_rank(1, 4, 32, 0.4), _s2t_rank(2, 2, 32, 0.05)]
    settings = [("low_entropy", 0.75), ("high_entropy", 0.3), ("low_entropy", 0.5), ("full", 0.75)]
    cases = [_s2t_case(f"variable-{s}-{q}", s, q, variable) for s, q in settings]
    ragged = [_s2t_rank(3, 3, 32, 0.3), _s2t_rank(4, 2, 20, 0.3)]
    one_empty = [_s2t_rank(5, 3, 16, 0.3, adv_sign=1.0), _s2t_rank(6, 3, 16, 0.3, adv_sign=-1.0)]
    single = [_one_candidate_rank(7), _s2t_rank(8, 2, 16, 0.0)]
    no_candidates = [_s2t_rank(9, 3, 16, 0.3, adv_sign=-1.0), _s2t_rank(10, 2, 16, 0.3, adv_sign=-1.0)]
    bad = _s2t_rank(11, 2, 16, 0.3)
    bad[0][1, 3] = math.nan
    bad[3][1, 3] = 1.0
    negative = _s2t_rank(14, 2, 16, 0.3)
    negative[1][0, 2], negative[3][0, 2] = -2.0, 1.0  # an impossible entropy, inside the mask of rank 1 only
    cases += [
        _s2t_case("ragged", "low_entropy", 0.75, ragged),
        _s2t_case("one-rank-without-candidates", "low_entropy", 0.75, one_empty),
        _s2t_case("one-candidate-overall", "low_entropy", 0.75, single),
        _s2t_case("no-candidates-low_entropy", "low_entropy", 0.75, no_candidates),
        _s2t_case("no-candidates-high_entropy", "high_entropy", 0.75, no_candidates),
        _s2t_case("random", "random", 0.5, variable),
        _s2t_case("nonfinite-on-rank-1", "low_entropy", 0.75, [_s2t_rank(12, 2, 16, 0.3), bad]),
        _s2t_case("impossible-on-rank-1", "low_entropy", 0.75, [_s2t_rank(13, 2, 16, 0.3), negative]),
    ]
    return cases


def _top_cases():
    ties = [_top_rank(20, 3, 16), _top_rank(21, 2, 16)]
    bad_entropy, bad_mask = _top_rank(28, 2, 8)
    bad_entropy[0, 0], bad_mask[0, 0] = math.inf, 1.0
    negative_entropy, negative_mask = _top_rank(31, 2, 8)
    negative_entropy[1, 1], negative_mask[1, 1] = -0.5, 1.0
    cases = [{"name": f"ties-{r}", "ratio": r, "ranks": ties} for r in (0.2, 0.37, 1.0)]
    cases += [
        {"name": "ragged", "ratio": 0.2, "ranks": [_top_rank(22, 2, 24), _top_rank(23, 3, 9)]},
        {"name": "one-rank-without-tokens", "ratio": 0.3, "ranks": [_top_rank(24, 2, 16), _top_rank(25, 2, 16, True)]},
        {"name": "no-tokens", "ratio": 0.2, "ranks": [_top_rank(26, 2, 8, True), _top_rank(27, 1, 8, True)]},
        {"name": "nonfinite-on-rank-0", "ratio": 0.2, "ranks": [(bad_entropy, bad_mask), _top_rank(29, 2, 8)]},
        {"name": "impossible-on-rank-1", "ratio": 0.2, "ranks": [_top_rank(30, 2, 8), (negative_entropy, negative_mask)]},
    ]
    return cases


def _generator(rank):
    return torch.Generator().manual_seed(100 + rank)


# ------------------------------------------------------------------------------------------
# what each rank runs
# ------------------------------------------------------------------------------------------


def _catch(fn, *args):
    """``fn(*args)``, or ``{"error": message}`` when it raises ValueError."""
    try:
        return fn(*args)
    except ValueError as err:
        return {"error": str(err)}


def _s2t_on_rank(rank, group, case):
    result = s2t_mask(
        *case["ranks"][rank], q=case["q"], strategy=case["strategy"], generator=_generator(rank), group=group
    )
    return {"keep": result.keep, "stats": result.stats}


def _top_on_rank(rank, group, case):
    return {"keep": entropy_topk_mask(*case["ranks"][rank], ratio=case["ratio"], group=group)}


def _parcel(src, dest):
    """What rank ``src`` sends rank ``dest`` in the exchange test: sizes differ per pair, one empty."""
    if (src, dest) == (1, 0):
        return None
    return {"from": src, "to": dest, "rows": [torch.arange(3 * src + dest + 1) * (src + 1)]}


def _rank_body(rank, group, payload):
    s2t_cases, top_cases = payload
    return {
        "s2t": {case["name"]: _catch(_s2t_on_rank, rank, group, case) for case in s2t_cases},
        "top": {case["name"]: _catch(_top_on_rank, rank, group, case) for case in top_cases},
        "syncs": _count_syncs(rank, group, s2t_cases[0]["ranks"][rank], top_cases[0]["ranks"][rank]),
        "exchange": exchange_objects([_parcel(rank, dest) for dest in range(WORLD)], group),
        "gather": gather_objects({"rank": rank, "items": list(range(rank + 2))}, group),
    }


def _count_syncs(rank, group, s2t_batch, top_batch):
    """Host reads (method, numel) of one pooled call of each kind, and boolean-indexing counts."""
    calls = {}
    for name, call in [
        ("low_entropy", lambda: s2t_mask(*s2t_batch, group=group)),
        ("random", lambda: s2t_mask(*s2t_batch, strategy="random", generator=_generator(rank), group=group)),
        ("top_entropy", lambda: entropy_topk_mask(*top_batch, group=group)),
    ]:
        with SyncRecorder() as recorder:
            call()
        calls[name] = (recorder.calls, recorder.boolean_indexing)
    return calls


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    payload = (_s2t_cases(), _top_cases())
    return run_on_ranks(_rank_body, payload, WORLD, tmp_path_factory.mktemp("dist"))


# ------------------------------------------------------------------------------------------
# single-process references
# ------------------------------------------------------------------------------------------


def _concat(tensors):
    """Concatenate (batch_r, width_r) tensors along the batch, zero-padding to the widest."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tensors])


def _rows(ranks, rank):
    start = sum(r[0].shape[0] for r in ranks[:rank])
    return slice(start, start + ranks[rank][0].shape[0])


def _assert_stats_equal(got, expected):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[key]), key
        elif key in ("candidates", "silenced", "tokens", "tau_h"):
            assert got[key] == value, key  # counts and the threshold are exact
        else:
            assert got[key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("case", _s2t_cases(), ids=lambda c: c["name"])
def test_s2t_mask_pooled_equals_single_process(rank_results, case):
    got = [r["s2t"][case["name"]] for r in rank_results]
    ranks = case["ranks"]
    if case["name"].startswith("nonfinite"):
        for g in got:  # every rank raises, none hangs
            assert "non-finite" in g["error"] and "log_prob" in g["error"]
        return
    if case["name"].startswith("impossible"):
        for g in got:  # one rank's impossible entropy: every rank raises, none hangs
            assert "entropy has 1 value(s) below -0.001" in g["error"], g
        return
    if case["strategy"] == "random":  # each rank draws for its own candidates with its own generator
        local = [s2t_mask(*ranks[r], q=case["q"], strategy="random", generator=_generator(r)) for r in range(WORLD)]
        for r in range(WORLD):
            assert torch.equal(got[r]["keep"], local[r].keep)
            _assert_stats_equal(got[r]["stats"], got[0]["stats"])
        assert got[0]["stats"]["silenced"] == sum(x.stats["silenced"] for x in local)
        assert got[0]["stats"]["candidates"] == sum(x.stats["candidates"] for x in local)
        return
    log_prob, entropy, mask = (_concat([r[i] for r in ranks]) for i in (0, 1, 3))
    advantages = torch.cat([r[2] for r in ranks])
    whole = s2t_mask(log_prob, entropy, advantages, mask, q=case["q"], strategy=case["strategy"])
    for r in range(WORLD):
        width = ranks[r][0].shape[1]
        assert torch.equal(got[r]["keep"], whole.keep[_rows(ranks, r), :width])
        _assert_stats_equal(got[r]["stats"], whole.stats)  # global stats, identical on every rank
    if case["name"].startswith("no-candidates"):
        assert whole.stats["candidates"] == 0 and math.isnan(got[0]["stats"]["tau_h"])
    if case["name"] == "one-candidate-overall":
        assert whole.stats["candidates"] == 1 and whole.stats["silenced"] == 0


@pytest.mark.parametrize("case", _top_cases(), ids=lambda c: c["name"])
def test_entropy_topk_mask_pooled_equals_single_process(rank_results, case):
    got = [r["top"][case["name"]] for r in rank_results]
    ranks = case["ranks"]
    if case["name"].startswith("nonfinite"):
        for g in got:
            assert "non-finite" in g["error"] and "entropy" in g["error"]
        return
    if case["name"].startswith("impossible"):
        for g in got:
            assert "entropy_topk_mask: entropy has 1 value(s) below -0.001" in g["error"], g
        return
    whole = entropy_topk_mask(_concat([r[0] for r in ranks]), _concat([r[1] for r in ranks]), ratio=case["ratio"])
    for r in range(WORLD):
        width = ranks[r][0].shape[1]
        assert torch.equal(got[r]["keep"], whole[_rows(ranks, r), :width])
    tokens = int(sum(r[1].sum() for r in ranks))
    assert int(sum(g["keep"].sum() for g in got)) == math.ceil(round(case["ratio"] * tokens, 9))


def test_pooled_calls_sync_only_to_size_the_buffers(rank_results):
    """S2T: one read of the per-rank counts (buffer width) + the stats; random: the stats only;
    top-entropy: one read of the per-rank token counts. All reads are of tiny tensors."""
    for result in rank_results:
        syncs = result["syncs"]
        assert [name for name, _ in syncs["low_entropy"][0]] == ["item", "tolist"]
        assert [name for name, _ in syncs["random"][0]] == ["tolist"]
        assert [name for name, _ in syncs["top_entropy"][0]] == ["tolist"]
        for calls, boolean_indexing in syncs.values():
            assert boolean_indexing == 0
            assert all(numel <= 16 for _, numel in calls), calls


def test_exchange_objects_delivers_what_each_rank_sent_to_it(rank_results):
    """Variable-size parcels (one empty) between 2 ranks: rank r receives, from each rank s, exactly
    what s addressed to r."""
    for rank, result in enumerate(rank_results):
        received = result["exchange"]
        assert len(received) == WORLD
        for src in range(WORLD):
            want = _parcel(src, rank)
            if want is None:
                assert received[src] is None
                continue
            assert received[src]["from"] == src and received[src]["to"] == rank
            assert torch.equal(received[src]["rows"][0], want["rows"][0])


def test_gather_objects_lists_every_rank_in_order(rank_results):
    for result in rank_results:
        assert result["gather"] == [{"rank": r, "items": list(range(r + 2))} for r in range(WORLD)]


def test_exchange_and_gather_without_a_group_return_the_local_objects():
    assert exchange_objects(["to me"], None) == ["to me"]
    assert gather_objects(5, None) == [5]
