"""knorm, keydiff, random, tova and lagkv (docs/policies.md) against kvpress 0.5.5 itself and
against their rules written out in NumPy.

kvpress side (_kvpress_reference): the same tiny random GQA Llama in transformers, float32,
one prompt under KnormPress, KeyDiffPress, TOVAPress and LagKVPress at the compression ratio
that keeps the same budget; the kept positions of every (layer, KV head) must overlap pykv's
(exact matmul, f32 cache) with IoU >= 0.95.

NumPy side (_policy_reference.capture_qkv: a float64 forward of the GGUF, post-RoPE keys,
values, queries) for what kvpress cannot show: RandomPress draws from torch's generator, so
pykv's random policy is checked against its own rule (a splitmix64 hash of seed, layer, KV
head and position) and for a right count, reproducibility and an even spread; TOVA's decode
steps (kvpress compresses the prefill only) are checked step by step on layer 0, whose keys
and queries do not depend on what earlier evictions left; LagKV's tie rule (equal ranks in
different partitions go to the lower position), where kvpress leaves ties to torch's top-k.
A prefill's evictions follow each layer's attention, so every layer's prefill selection is
restated from the unevicted forward.
"""

from __future__ import annotations

import numpy as np
import pytest

import _kvpress_reference as kr
import _policy_reference as pref
from _compare import EXACT
from _tiny_models import random_tokens
from pykv import InvalidArgumentError, Llama

N = 256
PROMPT = random_tokens(N, 5)
LAG = 32          # LagKV partitions short enough for several in PROMPT
SINK = 4
REF_RTOL = 1e-5   # float32 against float64: near-ties at the boundary may go either way


@pytest.fixture(scope="module")
def gqa(tiny_model):
    """F32, 2 layers, 8 query heads on 2 KV heads (G = 4), head_dim 16."""
    return tiny_model("llama_f32_h4kv4", n_embd=128, n_head=8, n_head_kv=2, n_layer=2, seed=21)


@pytest.fixture(scope="module")
def qkv(gqa):
    return pref.capture_qkv(gqa, PROMPT)


def kept(path, policy, budget, tokens=PROMPT, policy_kwargs=None, **kw):
    """{(layer, KV head): sorted kept positions} after one eval of tokens."""
    return kr.pykv_kept(path, tokens, policy, budget, policy_kwargs=policy_kwargs, **kw)


def top(s, k):
    """The k highest of s (ties -> lower index), ascending."""
    return pref.select_top(np.asarray(s, dtype=np.float64), k)


def near_tied_only(got, want, scores, k):
    """got and want differ only on entries near-tied with the k-th best of scores."""
    return pref.same_selection(np.asarray(got), np.asarray(want), np.asarray(scores, dtype=np.float64), k, REF_RTOL)


# ---- 1. against kvpress ------------------------------------------------------------------

def _press(name, ratio):
    from kvpress import KeyDiffPress, KnormPress, LagKVPress, TOVAPress

    return {
        "knorm": lambda: KnormPress(compression_ratio=ratio),
        "keydiff": lambda: KeyDiffPress(compression_ratio=ratio),
        "tova": lambda: TOVAPress(compression_ratio=ratio),
        "lagkv": lambda: LagKVPress(compression_ratio=ratio, lag_size=LAG),
        "lagkv-cross": lambda: LagKVPress(compression_ratio=ratio, lag_size=LAG, cross_scoring=True),
        "lagkv-default": lambda: LagKVPress(compression_ratio=ratio),
    }[name]()


# (case, pykv policy, its arguments, prompt length, budgets)
KVPRESS_CASES = [
    ("knorm", "knorm", None, N, (96, 160)),
    ("keydiff", "keydiff", None, N, (96, 160)),
    ("tova", "tova", None, N, (96, 160)),
    ("lagkv", "lagkv", {"lag": LAG}, N, (96, 160)),
    ("lagkv-cross", "lagkv", {"lag": LAG, "cross": 1}, N, (96, 160)),
    # lag 128: one scored partition in 320 tokens; in 200 (< sink + 2 lag) the sinks and the newest
    ("lagkv-default", "lagkv", None, 320, (200, 240)),
    ("lagkv-default", "lagkv", None, 200, (64,)),
]


@pytest.mark.parametrize("case,policy,kwargs,n,budgets", KVPRESS_CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in KVPRESS_CASES])
def test_matches_kvpress(gqa, case, policy, kwargs, n, budgets):
    kr.skip_without_kvpress()
    tokens = PROMPT if n == N else random_tokens(n, 6)
    for budget in budgets:
        ours = kept(gqa, policy, budget, tokens, kwargs)
        theirs = kr.kvpress_kept(gqa, tokens, _press(case, kr.compression_ratio(budget, n)))
        assert all(len(p) == budget for p in ours.values()), {k: len(p) for k, p in ours.items()}
        kr.assert_overlap(ours, theirs, 0.95, what=f"{case} budget {budget} of {n}")


def test_random_press_same_count_other_draw(gqa):
    """kvpress's RandomPress keeps as many entries per list as pykv's random; which ones is
    its generator's business (the kept sets are not compared)."""
    kr.skip_without_kvpress()
    from kvpress import RandomPress

    budget = 96
    theirs = kr.kvpress_kept(gqa, PROMPT, RandomPress(compression_ratio=kr.compression_ratio(budget, N), seed=0))
    ours = kept(gqa, "random", budget)
    assert {k: len(p) for k, p in theirs.items()} == {k: len(p) for k, p in ours.items()} == \
        {k: budget for k in ours}


# ---- 2. random: its rule in NumPy, reproducible, even --------------------------------------

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x):
    """splitmix64's finaliser on uint64 arrays."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def random_scores(seed, layer, head, positions):
    """docs/policies.md#random: u = hash(seed, layer, KV head, position), top 24 bits / 2^24."""
    h = _mix64(np.uint64(seed))
    h = _mix64(h ^ np.uint64(layer))
    h = _mix64(h ^ np.uint64(head))
    h = _mix64(h ^ np.asarray(positions, dtype=np.uint64))
    return (h >> np.uint64(40)).astype(np.float64) / 2.0 ** 24


@pytest.mark.parametrize("seed", [0, 7])
def test_random_follows_its_rule(gqa, seed):
    budget = 96
    ours = kept(gqa, "random", budget, policy_kwargs={"seed": seed})
    for (layer, head), got in ours.items():
        want = top(random_scores(seed, layer, head, np.arange(N)), budget)
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer} head {head}")


def test_random_is_reproducible_and_seeded(gqa):
    budget = 96
    a = kept(gqa, "random", budget, policy_kwargs={"seed": 3})
    b = kept(gqa, "random", budget, policy_kwargs={"seed": 3}, n_batch=64)   # chunked: the same draw
    c = kept(gqa, "random", budget, policy_kwargs={"seed": 4})
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert all(not np.array_equal(a[k], c[k]) for k in a)
    assert all(not np.array_equal(a[(0, 0)], a[k]) for k in a if k != (0, 0)), "lists draw on their own"


def test_random_spreads_evenly(gqa):
    """Over 10 seeds x 4 lists, every eighth of the prompt keeps its share of the budget:
    each bin expects 40 * 96 / 8 = 480 kept entries (binomial sd ~ 21); allow 4 sd."""
    budget, counts = 96, np.zeros(8)
    for seed in range(10):
        for got in kept(gqa, "random", budget, policy_kwargs={"seed": seed}).values():
            counts += np.bincount(got // (N // 8), minlength=8)
    expected = 40 * budget / 8
    assert np.all(np.abs(counts - expected) < 4 * 21), counts


# ---- 3. knorm and keydiff: their rules in NumPy (every layer) --------------------------------

def knorm_scores(k):
    return -np.linalg.norm(k, axis=-1)


def keydiff_scores(k):
    unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    anchor = unit.mean(axis=0)
    return -(k @ anchor) / (np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor))


@pytest.mark.parametrize("policy,rule", [("knorm", knorm_scores), ("keydiff", keydiff_scores)])
def test_key_scores_follow_their_rule(gqa, qkv, policy, rule):
    hp, _, ks, _ = qkv
    budget = 80
    ours = kept(gqa, policy, budget)
    for (layer, head), got in ours.items():
        s = rule(ks[layer][:, head, :])
        assert near_tied_only(got, top(s, budget), s, budget), (policy, layer, head)


# ---- 4. tova: prefill (both head averages) and decode steps in NumPy ---------------------------

def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def last_query_attention(q, k, keep):
    """(Hq, len(keep)) attention of query q (Hq, D) over keys k[keep] of each head's KV head."""
    Hq, D = q.shape
    group = Hq // k.shape[1]
    return np.stack([softmax(k[keep, h // group, :] @ q[h] / np.sqrt(D)) for h in range(Hq)])


def tova_prefill(q, k, budget, heads):
    """Per KV head: the newest entry and the top B - 1 of the others by the last query's
    attention, averaged over all the layer's heads or over the KV head's group."""
    n, Hkv = k.shape[0], k.shape[1]
    a = last_query_attention(q[-1], k, np.arange(n))[:, :-1]
    group = a.shape[0] // Hkv
    out = {}
    for g in range(Hkv):
        s = a.mean(axis=0) if heads == "layer" else a[g * group:(g + 1) * group].mean(axis=0)
        out[g] = (np.append(top(s, budget - 1), n - 1), s)
    return out


@pytest.mark.parametrize("heads", ["layer", "group"])
@pytest.mark.parametrize("budget", [64, 160])
def test_tova_prefill_follows_its_rule(gqa, qkv, heads, budget):
    hp, qs, ks, _ = qkv
    ours = kept(gqa, "tova", budget, policy_kwargs={"heads": heads})
    for layer in range(hp.n_layer):
        for g, (want, s) in tova_prefill(qs[layer], ks[layer], budget, heads).items():
            got = ours[(layer, g)]
            assert got[-1] == N - 1, "the newest entry stays"
            assert near_tied_only(got[:-1], want[:-1], s, budget - 1), (heads, layer, g)
        if heads == "layer":
            assert np.array_equal(ours[(layer, 0)], ours[(layer, 1)]), "a layer's KV heads keep the same entries"


@pytest.mark.parametrize("heads", ["layer", "group"])
def test_tova_decode_steps_follow_their_rule(gqa, heads):
    """Budget B after the prefill; each decode step appends its entry and, per list, drops
    the older entry its query attends to least (mean over the heads), so every list stays at
    B entries. Layer 0 is restated exactly step by step (its queries and keys come from the
    tokens alone); every layer keeps B entries and the newest."""
    budget, steps = 96, random_tokens(12, 8)
    hp, qs, ks, _ = pref.capture_qkv(gqa, PROMPT + steps)
    q0, k0 = qs[0], ks[0]
    group = hp.n_head // hp.n_head_kv
    with Llama(str(gqa), n_ctx=512, n_batch=N, n_threads=2, policy="tova", budget=budget,
               policy_kwargs={"heads": heads}, **EXACT) as llm:
        llm.eval(PROMPT)
        lists = {g: np.asarray(llm.kv_positions(0, g)) for g in range(hp.n_head_kv)}
        for i, tok in enumerate(steps):
            p = N + i
            llm.eval([tok])
            for g in range(hp.n_head_kv):
                old = lists[g]
                a = last_query_attention(q0[p], k0, np.append(old, p))[:, :-1]
                s = a.mean(axis=0) if heads == "layer" else a[g * group:(g + 1) * group].mean(axis=0)
                want = np.append(np.delete(old, int(np.argmin(s))), p)
                got = np.asarray(llm.kv_positions(0, g))
                assert near_tied_only(got[:-1], want[:-1], s, budget - 1), (heads, i, g)
                lists[g] = got
            for layer in range(hp.n_layer):
                for g in range(hp.n_head_kv):
                    pos = llm.kv_positions(layer, g)
                    assert len(pos) == budget and pos[-1] == p, (layer, g, i)


def test_tova_decode_budget_without_prefill(gqa):
    """Decode steps with no prefill before keep an absolute budget."""
    with Llama(str(gqa), n_ctx=128, n_threads=2, policy="tova", budget=8, **EXACT) as llm:
        for tok in random_tokens(20, 9):
            llm.eval([tok])
        assert llm.kv_stats()["entries_per_head"] == [[8, 8], [8, 8]]
        assert llm.kv_positions(0, 0)[-1] == 19


def test_tova_generates_past_n_ctx(gqa):
    """With evict_every_chunk the prompt may exceed n_ctx, and decoding keeps B entries."""
    with Llama(str(gqa), n_ctx=128, n_batch=32, n_threads=2, policy="tova", budget=48, evict_every_chunk=True,
               **EXACT) as llm:
        res = llm.generate(random_tokens(200, 10), max_tokens=150, temperature=0.0, ignore_eos=True)
        assert len(res.tokens) == 150
        assert llm.kv_stats()["entries_per_head"] == [[48, 48], [48, 48]]


# ---- 5. lagkv: its rule in NumPy, its tie rule against kvpress, short and small cases --------------

def lag_weights(x, lag):
    """(parts - 1, lag) softmax weights of each partition of x (parts * lag, D), scaled by the
    min and max of the partition after it."""
    parts = x.reshape(-1, lag, x.shape[-1])
    ref = parts[1:]
    lo, hi = ref.min(axis=1, keepdims=True), ref.max(axis=1, keepdims=True)
    scaled = (parts[:-1] - lo) / (hi - lo)
    return softmax(scaled.std(axis=-1, ddof=1))


def lagkv_scores(k, v, lag, sink=SINK, cross=False):
    """docs/policies.md#lagkv for one list: sinks and the tail 1; each scored partition's
    entries their mean key/value weight, or its rank inside the partition / lag."""
    n = k.shape[0]
    end = sink + (n - sink) // lag * lag
    w = (lag_weights(k[sink:end], lag) + lag_weights(v[sink:end], lag)) / 2
    if not cross:
        w = np.argsort(np.argsort(w, axis=-1, kind="stable"), axis=-1, kind="stable") / lag
    s = np.ones(n)
    s[sink:end - lag] = w.reshape(-1)
    return s, w


@pytest.mark.parametrize("cross", [0, 1])
@pytest.mark.parametrize("budget", [96, 160])
def test_lagkv_follows_its_rule(gqa, qkv, cross, budget):
    hp, _, ks, vs = qkv
    ours = kept(gqa, "lagkv", budget, policy_kwargs={"lag": LAG, "cross": cross})
    for (layer, g), got in ours.items():
        s, w = lagkv_scores(ks[layer][:, g, :], vs[layer][:, g, :], LAG, cross=bool(cross))
        want = top(s, budget)
        # ranks are exact: equal sets; weights compared across partitions: near-ties only
        assert np.array_equal(got, want) or (cross and near_tied_only(got, want, s, budget)), (layer, g)


def test_lagkv_ties_go_to_the_lower_position(gqa, qkv):
    """At budget 96 the kept ranks straddle one rank value that every scored partition has:
    pykv keeps it in the lower partitions; kvpress (torch's top-k) may choose others. The two
    differ only on entries of that rank."""
    kr.skip_without_kvpress()
    hp, _, ks, vs = qkv
    budget = 96
    ours = kept(gqa, "lagkv", budget, policy_kwargs={"lag": LAG})
    theirs = kr.kvpress_kept(gqa, PROMPT, _press("lagkv", kr.compression_ratio(budget, N)))
    for key, got in ours.items():
        s, _ = lagkv_scores(ks[key[0]][:, key[1], :], vs[key[0]][:, key[1], :], LAG)
        boundary = np.sort(s)[::-1][budget - 1]
        tied = np.flatnonzero(s == boundary)
        assert len(tied) > 1 and boundary < 1
        assert set(got) ^ set(theirs[key]) <= set(tied.tolist()), key
        kept_tied = np.intersect1d(got, tied)
        np.testing.assert_array_equal(kept_tied, tied[:len(kept_tied)])   # the lowest positions of the rank


def test_lagkv_small_budget_keeps_sinks_and_newest(gqa):
    """A budget below the sinks and the unscored tail (4 + 60 here) keeps the sinks and the
    newest entries, as a list too short to partition does."""
    budget = 48
    ours = kept(gqa, "lagkv", budget, policy_kwargs={"lag": LAG})
    want = np.concatenate([np.arange(SINK), np.arange(N - (budget - SINK), N)])
    for got in ours.values():
        np.testing.assert_array_equal(got, want)


# ---- 6. schedules: chunked prefill, evict_every_chunk ----------------------------------------------

SCORED = [("knorm", None), ("keydiff", None), ("random", None), ("tova", None), ("lagkv", {"lag": LAG})]


@pytest.mark.parametrize("policy,kwargs", SCORED, ids=[p for p, _ in SCORED])
def test_chunked_prefill_equals_one_shot(gqa, policy, kwargs):
    one = kept(gqa, policy, 96, policy_kwargs=kwargs)
    chunked = kept(gqa, policy, 96, policy_kwargs=kwargs, n_batch=48)
    for key in one:
        np.testing.assert_array_equal(chunked[key], one[key], err_msg=f"{policy} {key}")


@pytest.mark.parametrize("policy,kwargs", SCORED, ids=[p for p, _ in SCORED])
def test_evict_every_chunk_bounds_the_cache(gqa, policy, kwargs):
    budget, n_batch = 64, 48
    with Llama(str(gqa), n_ctx=512, n_batch=n_batch, n_threads=2, policy=policy, budget=budget,
               policy_kwargs={**(kwargs or {}), "evict_every_chunk": 1}, **EXACT) as llm:
        llm.eval(PROMPT)
        st = llm.kv_stats()
        assert st["entries_per_head"] == [[budget] * 2] * 2
        assert st["peak_bytes"] < 0.6 * N * 4 * 2 * 16 * 4, st   # never the whole prompt's K and V
        if policy == "tova":
            assert llm.kv_positions(1, 1)[-1] == N - 1


# ---- 7. bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,kwargs,budget,needle", [
    ("knorm", {"window": 8}, 64, "has no argument 'window'"),
    ("random", {"seed": -1}, 64, "seed"),
    ("tova", {"heads": "all"}, 64, "heads"),
    ("lagkv", {"lag": 1}, 64, "lag"),
    ("lagkv", {"cross": 2}, 64, "cross"),
    ("lagkv", None, 4, "larger than the 4 sink tokens"),
    ("lagkv", {"sink": 10}, 8, "larger than the 10 sink tokens"),
])
def test_bad_arguments_are_refused(gqa, policy, kwargs, budget, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        Llama(str(gqa), n_ctx=128, policy=policy, budget=budget, policy_kwargs=kwargs)


def test_lagkv_share_budget_is_raised_above_the_sinks(gqa):
    with Llama(str(gqa), n_ctx=512, n_threads=2, policy="lagkv", budget=0.01, policy_kwargs={"sink": 80},
               **EXACT) as llm:
        with pytest.warns(RuntimeWarning, match="raised to 81"):
            llm.eval(PROMPT)
        assert llm.kv_stats()["entries_per_head"] == [[81, 81], [81, 81]]
