"""CAKE and LAVa eviction policies (docs/policies.md#cake, #lava).

The NumPy reference (_cake_lava_reference.py) recomputes, from the spec formulas and the
float64 forward pass, each layer's preference / entropy, the layer and head budgets and
the kept positions of every (layer, KV head); the runtime must agree.

Near-ties: the runtime scores in float32, the reference in float64. A kept set may differ
from the reference only where the swapped positions' reference scores lie within 1e-5
(relative to the head's largest score) of the score of the reference's last kept entry,
i.e. a genuine near-tie at the selection boundary; kept counts (the layer and head
budgets) must match exactly. Exact ties (max pooling copies values) are broken toward the
lower position in both, and equal fractional parts in the budget rounding toward the lower
layer / head, so they are not near-ties.
"""

from __future__ import annotations

import numpy as np
import pytest

import _cake_lava_reference as ref
from _compare import EXACT
from pykv import Llama
from pykv.errors import InvalidArgumentError

W = 32
N_PROMPT = 160
TINY = dict(name="llama_q8_0_h8kv2", n_layer=4, wtype="F32")   # 8 query heads, 2 KV heads, 4 layers


def _prompt(n=N_PROMPT, seed=0):
    rng = np.random.default_rng(seed)
    return [1] + [int(t) for t in rng.integers(3, 300, n - 1)]


@pytest.fixture(scope="module")
def tiny4(tiny_model):
    return tiny_model(TINY["name"], n_layer=TINY["n_layer"], wtype=TINY["wtype"])


@pytest.fixture(scope="module")
def tiny4_qkv(tiny4):
    return ref.capture_qkv(tiny4, _prompt())


def _run(path, tokens, policy, budget, n_threads=2, n_batch=512, **kwargs):
    llm = Llama(str(path), **EXACT, n_ctx=512, n_threads=n_threads, n_batch=n_batch, policy=policy, budget=budget,
                policy_kwargs=kwargs or None)
    llm.eval(tokens)
    return llm


def _positions(llm):
    st = llm.kv_stats()
    L, H = len(st["entries_per_head"]), len(st["entries_per_head"][0])
    return {(l, h): llm.kv_positions(l, h) for l in range(L) for h in range(H)}


def _assert_matches_reference(llm, r, n_tokens):
    n_cand = r["n_cand"]
    window = set(range(n_cand, n_tokens))
    for l, heads in enumerate(r["keep"]):
        for h, exp in enumerate(heads):
            got = llm.kv_positions(l, h)
            assert got == sorted(got), f"layer {l} head {h}: list not in position order"
            assert window <= set(got), f"layer {l} head {h}: window entries evicted"
            g = {p for p in got if p < n_cand}
            e = {int(p) for p in exp if p < n_cand}
            assert len(g) == len(e), f"layer {l} head {h}: kept {len(g)} candidates, reference {len(e)}"
            if g == e:
                continue
            s = np.asarray(r["scores"][l][h])
            boundary = min(s[p] for p in e)
            tol = 1e-5 * np.max(np.abs(s))
            for p in g ^ e:
                assert abs(s[p] - boundary) <= tol, (
                    f"layer {l} head {h}: position {p} (score {s[p]:.9g}) differs from the reference "
                    f"selection and is not a near-tie with the boundary score {boundary:.9g}")


# ---- (1) CAKE cascade == one-shot (Theorem 1) ----------------------------------------


@pytest.mark.parametrize("n_batch", [512, 48])
@pytest.mark.parametrize("taus", [(1.0, 1.0), (0.3, 0.5)])
def test_cake_cascade_equals_one_shot(tiny4, n_batch, taus):
    toks = _prompt()
    kw = dict(tau1=taus[0], tau2=taus[1])
    casc = _run(tiny4, toks, "cake", 64, n_batch=n_batch, cascade=1, **kw)
    once = _run(tiny4, toks, "cake", 64, n_batch=n_batch, cascade=0, **kw)
    assert _positions(casc) == _positions(once)
    assert casc.kv_stats()["entries"] == once.kv_stats()["entries"]
    np.testing.assert_array_equal(casc.logits(), once.logits())


# ---- (2) selection and budgets against the NumPy reference ---------------------------


@pytest.mark.parametrize("taus", [(1.0, 1.0), (0.3, 0.5)])
@pytest.mark.parametrize("cascade", [1, 0])
def test_cake_matches_reference(tiny4, tiny4_qkv, taus, cascade):
    r = ref.cake_select(tiny4_qkv, 64, W, tau1=taus[0], tau2=taus[1])
    llm = _run(tiny4, _prompt(), "cake", 64, cascade=cascade, tau1=taus[0], tau2=taus[1])
    per_head = llm.kv_stats()["entries_per_head"]
    assert [row[0] for row in per_head] == [int(b) + W for b in r["budgets"]]   # layer budgets
    assert all(len(set(row)) == 1 for row in per_head)                         # shared by the heads
    _assert_matches_reference(llm, r, N_PROMPT)


@pytest.mark.parametrize("cascade", [1, 0])
def test_lava_matches_reference(tiny4, tiny4_qkv, cascade):
    r = ref.lava_select(tiny4_qkv, 64, W, cascade=bool(cascade))
    llm = _run(tiny4, _prompt(), "lava", 64, cascade=cascade)
    per_head = np.array(llm.kv_stats()["entries_per_head"])
    np.testing.assert_array_equal(per_head, r["kept"] + W)                      # head and layer budgets
    _assert_matches_reference(llm, r, N_PROMPT)


def test_smollm2_matches_reference(smollm2_path):
    """A real model: layer preferences and entropies differ a lot across its 30 layers."""
    llm = Llama(str(smollm2_path), **EXACT, n_ctx=512, n_threads=2)
    text = ("The quick brown fox jumps over the lazy dog. " * 3 + "In 1492, Columbus sailed the ocean blue, "
            "and many other things happened in the world of science and art. " * 4 + "Question: what did the fox do?")
    toks = llm.tokenize(text)
    llm.close()
    qkv = ref.capture_qkv(smollm2_path, toks)

    r = ref.cake_select(qkv, 64, W)
    assert max(r["budgets"]) > 3 * min(r["budgets"])      # the allocation is far from uniform
    cake = _run(smollm2_path, toks, "cake", 64)
    assert [row[0] for row in cake.kv_stats()["entries_per_head"]] == [int(b) + W for b in r["budgets"]]
    _assert_matches_reference(cake, r, len(toks))
    assert _positions(cake) == _positions(_run(smollm2_path, toks, "cake", 64, cascade=0))

    r = ref.lava_select(qkv, 64, W)
    lava = _run(smollm2_path, toks, "lava", 64)
    np.testing.assert_array_equal(np.array(lava.kv_stats()["entries_per_head"]), r["kept"] + W)
    _assert_matches_reference(lava, r, len(toks))


# ---- (3) budget rules, window, threads, no-op --------------------------------------


@pytest.mark.parametrize("policy", ["cake", "lava"])
@pytest.mark.parametrize("budget", [40, 64, 100, "45%"])
def test_budget_never_exceeded_and_window_kept(tiny4, policy, budget):
    toks = _prompt()
    llm = _run(tiny4, toks, policy, budget)
    st = llm.kv_stats()
    L, H = len(st["entries_per_head"]), len(st["entries_per_head"][0])
    B = budget if isinstance(budget, int) else int(np.ceil(0.45 * N_PROMPT))
    assert st["entries"] <= B * L * H
    assert st["entries"] == B * L * H          # the whole budget is used (no list is capped here)
    assert st["evicted"] == N_PROMPT * L * H - st["entries"]
    for (l, h), pos in _positions(llm).items():
        assert set(range(N_PROMPT - W, N_PROMPT)) <= set(pos), (l, h)


def test_caps_redistribute(tiny4):
    """A budget close to the prompt: lists are capped at their candidates, the excess goes
    to the other layers (CAKE, LAVa) and heads (LAVa), the total is exactly the budget."""
    toks = _prompt(n=100)
    qkv = ref.capture_qkv(tiny4, toks)
    n_cand = 100 - W
    r = ref.cake_select(qkv, 95, W, tau1=0.2, tau2=0.4)
    assert max(r["budgets"]) == n_cand and min(r["budgets"]) < n_cand - 8     # some layers capped
    llm = _run(tiny4, toks, "cake", 95, tau1=0.2, tau2=0.4)
    assert [row[0] for row in llm.kv_stats()["entries_per_head"]] == [int(b) + W for b in r["budgets"]]
    assert llm.kv_stats()["entries"] == 95 * 4 * 2
    _assert_matches_reference(llm, r, 100)

    r = ref.lava_select(qkv, 95, W, alpha=0.0)
    assert r["kept"].max() == n_cand                                           # some heads capped
    llm = _run(tiny4, toks, "lava", 95, alpha=0.0)
    np.testing.assert_array_equal(np.array(llm.kv_stats()["entries_per_head"]), r["kept"] + W)
    assert llm.kv_stats()["entries"] == 95 * 4 * 2
    _assert_matches_reference(llm, r, 100)


@pytest.mark.parametrize("policy", ["cake", "lava"])
def test_thread_count_does_not_change_selection(tiny4, policy):
    toks = _prompt()
    one = _run(tiny4, toks, policy, 64, n_threads=1)
    two = _run(tiny4, toks, policy, 64, n_threads=2)
    assert _positions(one) == _positions(two)


@pytest.mark.parametrize("policy", ["cake", "lava"])
def test_budget_at_least_prompt_is_full(tiny4, policy):
    toks = _prompt()
    full = _run(tiny4, toks, "full", None)
    exact = _run(tiny4, toks, policy, N_PROMPT)
    assert exact.kv_stats()["evicted"] == 0
    np.testing.assert_array_equal(exact.logits(), full.logits())
    llm = _run(tiny4, toks, policy, N_PROMPT + 2)
    assert llm.kv_stats()["evicted"] == 0
    assert llm.kv_stats()["entries"] == full.kv_stats()["entries"]
    np.testing.assert_array_equal(llm.logits(), full.logits())
    for tok in (5, 77):   # decoding while the sequence still fits the budget
        llm.eval([tok]), full.eval([tok])
    np.testing.assert_array_equal(llm.logits(), full.logits())
    assert llm.kv_stats()["evicted"] == 0


# ---- (4) decode ------------------------------------------------------------------


def test_cake_decode_keeps_budget(tiny4):
    toks = _prompt()
    llm = _run(tiny4, toks, "cake", 64)
    st0 = llm.kv_stats()
    L, H = len(st0["entries_per_head"]), len(st0["entries_per_head"][0])
    new = [int(t) for t in np.random.default_rng(1).integers(3, 300, 12)]
    for i, tok in enumerate(new):
        llm.eval([tok])
        st = llm.kv_stats()
        assert st["entries_per_head"] == st0["entries_per_head"]
        assert st["entries"] <= 64 * L * H
        assert st["evicted"] == st0["evicted"] + (i + 1) * L * H
        for (l, h), pos in _positions(llm).items():
            assert N_PROMPT + i in pos and set(range(N_PROMPT + i + 1 - W, N_PROMPT + i + 1)) <= set(pos)

    # Layer 0's decode choices against the reference rule (its queries do not depend on
    # the compressed caches of other layers, so the float64 reference is exact there).
    q_all = ref.capture_qkv(tiny4, toks + new)[0]
    q0, k0 = q_all[0], q_all[1]
    r = ref.cake_select(ref.capture_qkv(tiny4, toks), 64, W)
    lists = [list(map(int, r["keep"][0][h])) for h in range(H)]
    for i in range(len(new)):
        p = N_PROMPT + i
        for h in range(H):
            lists[h].append(p)
        scores = ref.cake_decode_scores(q0[p], [k0[lists[h], h] for h in range(H)], W)
        for h in range(H):
            s = scores[h]
            order = np.lexsort((np.arange(len(s)), -s))
            drop = order[-1]
            gap = abs(s[order[-2]] - s[drop])   # 0: max pooling copied one value (ties -> lower position kept)
            assert gap == 0 or gap > 1e-6 * np.max(s), "near-tie in the reference; pick other tokens"
            del lists[h][drop]
    for h in range(H):
        assert llm.kv_positions(0, h) == lists[h]


def test_cake_decode_does_not_depend_on_threads(tiny4):
    # decode eviction runs per list on the pool's threads, as each list finishes attending
    new = [int(t) for t in np.random.default_rng(2).integers(3, 300, 8)]
    runs = []
    for n_threads in (1, 2):
        llm = _run(tiny4, _prompt(), "cake", 64, n_threads=n_threads)
        logits = []
        for tok in new:
            llm.eval([tok])
            logits.append(llm.logits().copy())
        runs.append((logits, _positions(llm), llm.kv_stats()["evicted"]))
    (l1, p1, e1), (l2, p2, e2) = runs
    assert p1 == p2 and e1 == e2
    for a, b in zip(l1, l2):
        np.testing.assert_array_equal(a, b)


def test_cake_decode_evict_none_grows(tiny4):
    llm = _run(tiny4, _prompt(), "cake", 64, decode_evict="none")
    before = llm.kv_stats()["entries"]
    for tok in (5, 6, 7):
        llm.eval([tok])
    assert llm.kv_stats()["entries"] == before + 3 * 4 * 2


def test_lava_decode_grows(tiny4):
    llm = _run(tiny4, _prompt(), "lava", 64)
    per_head = np.array(llm.kv_stats()["entries_per_head"])
    for tok in (5, 6, 7):
        llm.eval([tok])
    np.testing.assert_array_equal(np.array(llm.kv_stats()["entries_per_head"]), per_head + 3)


# ---- (5) bad arguments -------------------------------------------------------------


@pytest.mark.parametrize("policy,budget,kwargs,match", [
    ("cake", 64, {"tau1": 0}, "tau1"),
    ("cake", 64, {"tau2": "x"}, "tau2"),
    ("cake", 64, {"gamma": -1}, "gamma"),
    ("cake", 64, {"cascade": 2}, "cascade"),
    ("cake", 64, {"decode_evict": "sometimes"}, "decode_evict"),
    ("cake", 64, {"kernel": 4}, "odd"),
    ("cake", 64, {"bogus": 1}, "bogus"),
    ("cake", 32, {}, "larger than the window"),
    ("lava", 64, {"alpha": 1.5}, "alpha"),
    ("lava", 64, {"cascade": "yes"}, "cascade"),
    ("lava", 64, {"gqa": "min"}, "gqa"),
    ("lava", 64, {"gamma": 1}, "gamma"),
    ("lava", 20, {"window": 20}, "larger than the window"),
])
def test_bad_arguments(tiny4, policy, budget, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Llama(str(tiny4), **EXACT, n_ctx=256, policy=policy, budget=budget, policy_kwargs=kwargs or None)


@pytest.mark.parametrize("policy", ["cake", "lava"])
def test_fraction_budget_below_the_floor_is_raised_to_it(tiny4, policy):
    llm = Llama(str(tiny4), **EXACT, n_ctx=256, policy=policy, budget="5%")   # 8 entries, below W = 32
    with pytest.warns(RuntimeWarning, match="raised to 64"):
        llm.eval(_prompt())
    st = llm.kv_stats()
    assert st["entries"] == 64 * len(st["entries_per_head"]) * len(st["entries_per_head"][0])
