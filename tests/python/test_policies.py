"""KV eviction policies: invariants for every registered policy, selections against an
independent NumPy reimplementation (_policy_reference.py), chunked prefill, bad input,
question-agnostic (multi-call) prefill and decode-time behaviour.

Tiny random-weight models, one-chunk prefill unless said otherwise. Selection checks
compare float32 C against float64 NumPy: a kept set may differ from the reference only on
candidates that are genuinely near-tied at the selection boundary (scores within REF_RTOL
relative of the k-th best, and not all exactly equal); see _policy_reference.ambiguous.
"""

from __future__ import annotations

import numpy as np
import pytest

import _policy_reference as pr
from _compare import EXACT
from pykv import InvalidArgumentError, Llama, list_policies

POLICIES = list_policies()
EVICTING = [p for p in POLICIES if p != "full"]
WINDOW_POLICIES = [p for p in ("snapkv", "pyramidkv", "adakv") if p in POLICIES]
N_CTX = 512
W = 32          # default observation window (docs/policies.md)
SINK = 4        # streamingllm default sinks
REF_RTOL = 1e-5


def protected(policy: str, n: int, budget: int) -> set:
    """Positions a policy must keep after a one-shot prompt of n tokens (defaults)."""
    if policy == "streamingllm":
        return set(range(SINK)) | set(range(n - (budget - SINK), n))
    if policy == "h2o":
        return set(range(n - budget // 2, n))   # the recent half of the budget
    if policy == "take":
        return set()                            # TAKE protects no window (docs/policies.md#take)
    if policy in ("knorm", "keydiff", "random"):
        return set()                            # scored entry by entry, no window
    if policy == "kvzip":
        return set(range(SINK))                 # its sinks; no window (docs/policies.md#kvzip)
    if policy == "tova":
        return {n - 1}                          # the newest entry
    if policy == "expected_attention":
        return set(range(SINK))                 # its sinks (default 4), no window
    if policy == "lagkv":                       # n < sink + 2 lag: the sinks and the newest
        return set(range(SINK)) | set(range(n - (budget - SINK), n))
    return set(range(n - W, n))   # window policies (default W = 32)


def prompt(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 300, n - 1).tolist()


def run(path, policy, tokens, *, n_threads=2, n_batch=512, **kw) -> Llama:
    llm = Llama(path, n_ctx=N_CTX, n_threads=n_threads, n_batch=n_batch, policy=policy, **kw)
    llm.eval(tokens)
    return llm


def positions(llm) -> list:
    per_head = llm.kv_stats()["entries_per_head"]
    return [[llm.kv_positions(l, h) for h in range(len(per_head[l]))] for l in range(len(per_head))]


@pytest.fixture(scope="module")
def gqa_model(tiny_model):
    """F32, 4 layers, 8 query heads on 2 KV heads (G = 4), head_dim 8."""
    return tiny_model("llama_f32_h4kv4", n_head=8, n_head_kv=2, n_layer=4)


# ---- 1. invariants, every policy -----------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_invariants(gqa_model, policy):
    n, budget = 200, 64
    toks = prompt(n)
    kw = {} if policy == "full" else {"budget": budget}
    one = run(gqa_model, policy, toks, n_threads=1, **kw)
    two = run(gqa_model, policy, toks, n_threads=2, **kw)
    assert np.array_equal(one.logits(), two.logits()), "logits depend on the thread count"
    pos = positions(two)
    assert positions(one) == pos, "kept positions depend on the thread count"

    info = two.model_info
    L, Hkv, hd = info["n_layer"], info["n_head_kv"], info["head_dim"]
    st = two.kv_stats()
    assert st["policy"] == policy
    assert st["entries"] == sum(len(p) for layer in pos for p in layer)
    assert st["evicted"] == n * L * Hkv - st["entries"]
    assert st["peak_bytes"] >= st["bytes"] >= st["entries"] * (2 * hd * st["bytes_per_element"] + 4)
    for layer in pos:
        for p in layer:
            assert p == sorted(set(p)) and 0 <= p[0] and p[-1] < n
    if policy == "full":
        assert st["entries"] == n * L * Hkv
        return
    assert st["entries"] <= budget * L * Hkv
    assert st["evicted"] > 0
    # lists shrink exactly: the bytes held are the entries' bytes (and EMS's member norms)
    lo, hi = pr.kv_bytes_range(st, hd)
    assert lo <= st["bytes"] <= hi
    keep = protected(policy, n, budget)
    for l, layer in enumerate(pos):
        for h, p in enumerate(layer):
            missing = keep - set(p)
            assert not missing, f"{policy}: layer {l} head {h} lost protected positions {sorted(missing)[:8]}"


@pytest.mark.parametrize("policy", [p for p in ("full", "ems", "cake") if p in POLICIES])
def test_decode_steps_same_for_any_thread_count(gqa_model, policy):
    """Decode steps over lists longer than one attention segment (256 entries): each thread
    attends the lists it owns, then any left (with 3 threads and 2 KV heads one thread owns
    none); the logits and kept positions must not depend on who attended what."""
    kw = {} if policy == "full" else {"budget": 300}
    toks, steps = prompt(400), prompt(24, seed=1)
    runs = []
    for n_threads in (1, 2, 3):
        llm = run(gqa_model, policy, toks, n_threads=n_threads, **kw)
        rows = []
        for t in steps:
            llm.eval([t])
            rows.append(llm.logits())
        assert max(len(p) for layer in positions(llm) for p in layer) > 256, "lists fit one segment"
        runs.append((np.stack(rows), positions(llm)))
        llm.close()
    for logits, pos in runs[1:]:
        assert np.array_equal(runs[0][0], logits), "decode logits depend on the thread count"
        assert runs[0][1] == pos, "kept positions depend on the thread count"


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize("budget", ["n", "100%", "n+5"])
def test_budget_at_least_prompt_is_full(gqa_model, policy, budget):
    n = 150
    toks = prompt(n, seed=1)
    b = {"n": n, "100%": "100%", "n+5": n + 5}[budget]
    full = run(gqa_model, "full", toks)
    got = run(gqa_model, policy, toks, budget=b)
    assert np.array_equal(got.logits(), full.logits())
    assert positions(got) == positions(full)
    assert got.kv_stats()["evicted"] == 0


# ---- 2. selections against NumPy -------------------------------------------------------

def _check_layers(llm, want, rtol=REF_RTOL, check_counts=False):
    for l, heads in enumerate(want):
        _check_layer(llm, l, heads, rtol, check_counts)


def _check_layer(llm, l, heads, rtol=REF_RTOL, check_counts=False):
    for h, (kept, scores, k) in enumerate(heads):
        got = np.asarray(llm.kv_positions(l, h))
        if check_counts:
            assert len(got) == len(kept), f"layer {l} head {h}: {len(got)} entries, reference {len(kept)}"
        assert pr.same_selection(got, kept, scores, k, rtol), (
            f"layer {l} head {h}: kept set differs from the reference beyond near-ties: "
            f"C-only {sorted(set(got.tolist()) - set(kept.tolist()))[:10]}, "
            f"ref-only {sorted(set(kept.tolist()) - set(got.tolist()))[:10]}")


REF_CASES = [
    ("llama_f32_h4kv4", {}),                                               # G = 1, 2 layers
    ("llama_f32_h4kv4", dict(n_head=8, n_head_kv=2, n_layer=4)),           # G = 4, 4 layers
    ("llama_f16_h4kv2_tied", dict(n_layer=3)),                             # G = 2, F16
]


@pytest.fixture(scope="module", params=range(len(REF_CASES)), ids=["g1", "g4", "g2f16"])
def ref_case(request, tiny_model):
    name, changes = REF_CASES[request.param]
    path = tiny_model(name, **changes)
    toks = prompt(240, seed=2 + request.param)
    hp, qs, ks = pr.capture_qk(path, toks)
    return path, toks, hp, qs, ks


@pytest.mark.parametrize("opts", [{}, {"pool": "avg", "kernel": 5, "gqa": "max"}, {"window": 16, "kernel": 1}],
                         ids=["default", "avg5-gqamax", "w16-nopool"])
def test_snapkv_matches_reference(ref_case, opts):
    path, toks, hp, qs, ks = ref_case
    B = 80
    kw = dict(opts)
    Wn = kw.pop("window", W)
    llm = run(path, "snapkv", toks, **EXACT, budget=B, window=Wn, policy_kwargs=kw or None)
    want = pr.snapkv(qs, ks, B, W=Wn, **kw)
    _check_layers(llm, want, check_counts=True)


def test_pyramidkv_matches_reference(ref_case):
    path, toks, hp, qs, ks = ref_case
    for B, beta in ((80, 20.0), (100, 5.0)):
        llm = run(path, "pyramidkv", toks, **EXACT, budget=B, policy_kwargs={"beta": beta})
        want = pr.pyramidkv(qs, ks, B, beta=beta)
        _check_layers(llm, want, check_counts=True)
        # per-layer budgets: total exact, decreasing with depth
        per_layer = [len(heads[0][0]) for heads in want]
        assert sum(per_layer) == B * hp.n_layer
        assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]
        assert llm.kv_stats()["entries"] == B * hp.n_layer * hp.n_head_kv


def test_pyramid_budget_formula():
    # remainder of the floored step is taken back round robin from layer 0: exact total
    for L, Bs, cap, beta in [(4, 32, 168, 20.0), (30, 224, 4000, 20.0), (7, 50, 60, 20.0), (2, 10, 11, 3.0)]:
        b = pr.pyramid_budgets(L, Bs, cap, beta)
        assert sum(b) == L * Bs and all(0 <= x <= cap for x in b)
    assert pr.pyramid_budgets(4, 32, 168) == [62, 42, 22, 2]


def test_adakv_matches_reference(ref_case):
    path, toks, hp, qs, ks = ref_case
    for B, alpha in ((80, 0.2), (64, 0.5), (80, 1.0)):
        llm = run(path, "adakv", toks, **EXACT, budget=B, policy_kwargs={"alpha": alpha})
        want = pr.adakv(qs, ks, B, alpha=alpha)
        for l, heads in enumerate(want):
            flat = np.concatenate([s for _, s, _ in heads])
            joint_ambiguous = pr.ambiguous(flat, hp.n_head_kv * (B - W), REF_RTOL)
            counts = [len(llm.kv_positions(l, h)) for h in range(hp.n_head_kv)]
            assert sum(counts) == B * hp.n_head_kv, f"layer {l}: total {sum(counts)} != {B * hp.n_head_kv}"
            if not joint_ambiguous:
                assert counts == [len(k) for k, _, _ in heads], f"layer {l}: per-head budgets differ"
                _check_layer(llm, l, heads, check_counts=True)
        if alpha == 1.0:   # uniform share: Ada-KV reduces to SnapKV
            snap = run(path, "snapkv", toks, **EXACT, budget=B)
            assert positions(llm) == positions(snap)


def test_adakv_head_budgets_rounding():
    # largest remainder keeps the layer total exact (counts c sum to Hkv * Bs)
    for c, Bs, alpha in [([10, 20, 30, 4], 16, 0.2), ([21, 0, 0], 7, 0.3), ([3, 3, 3], 3, 0.5), ([1, 2, 30], 11, 0.15)]:
        b = pr.adakv_head_budgets(c, Bs, alpha)
        assert sum(b) == len(c) * Bs and all(x >= 0 for x in b)
    assert pr.adakv_head_budgets([21, 0, 0], 7, 0.3) == [17, 2, 2]


def test_streamingllm_positions(gqa_model):
    n, B = 200, 40
    llm = run(gqa_model, "streamingllm", prompt(n), budget=B)
    want = pr.streamingllm(n, B).tolist()
    assert all(p == want for layer in positions(llm) for p in layer)
    llm = run(gqa_model, "streamingllm", prompt(n), budget=B, sink=2, window=20)
    want = list(range(2)) + list(range(n - 20, n))
    assert all(p == want for layer in positions(llm) for p in layer)


# ---- 3. chunked prefill ----------------------------------------------------------------

@pytest.mark.parametrize("policy", WINDOW_POLICIES + ["streamingllm"])
def test_chunked_prefill_same_as_one_shot(gqa_model, policy):
    toks = prompt(300, seed=3)
    one = run(gqa_model, policy, toks, budget=72, n_batch=512)
    for nb in (64, 100):
        ch = run(gqa_model, policy, toks, budget=72, n_batch=nb)
        assert positions(ch) == positions(one), f"n_batch={nb}: kept sets differ"
        np.testing.assert_allclose(ch.logits(), one.logits(), rtol=0, atol=1e-4)


# ---- 4. bad values ---------------------------------------------------------------------

def test_bad_values(tiny_model):
    path = tiny_model()
    with pytest.raises(InvalidArgumentError, match="unknown KV policy 'nope'.*snapkv") as err:
        Llama(path, n_ctx=N_CTX, policy="nope", budget=64)
    assert str(err.value).endswith(f"(available: {', '.join(list_policies())})")   # every name, none cut
    for bad in (0, -3, "abc", "150%", "0%"):
        with pytest.raises(InvalidArgumentError, match="budget"):
            Llama(path, n_ctx=N_CTX, policy="snapkv", budget=bad)
    for policy in WINDOW_POLICIES:
        with pytest.raises(InvalidArgumentError, match=r"budget.*window W=32"):
            Llama(path, n_ctx=N_CTX, policy=policy, budget=32)
        with pytest.raises(InvalidArgumentError, match=r"window W=50"):
            Llama(path, n_ctx=N_CTX, policy=policy, budget=40, window=50)
        with pytest.raises(InvalidArgumentError, match=r"no argument 'bogus'.*window.*pool"):
            Llama(path, n_ctx=N_CTX, policy=policy, budget=64, policy_kwargs={"bogus": 1})
        for kw, msg in (({"pool": "median"}, "pool must be one of max|avg"), ({"kernel": 4}, "odd"),
                        ({"kernel": "x"}, "kernel must be an integer"), ({"window": 0}, "window")):
            with pytest.raises(InvalidArgumentError, match=msg):
                Llama(path, n_ctx=N_CTX, policy=policy, budget=64, policy_kwargs=kw)
    with pytest.raises(InvalidArgumentError, match="alpha"):
        Llama(path, n_ctx=N_CTX, policy="adakv", budget=64, policy_kwargs={"alpha": 1.5})
    with pytest.raises(InvalidArgumentError, match="beta"):
        Llama(path, n_ctx=N_CTX, policy="pyramidkv", budget=64, policy_kwargs={"beta": 0})
    with pytest.raises(InvalidArgumentError, match="no argument 'beta'"):
        Llama(path, n_ctx=N_CTX, policy="snapkv", budget=64, policy_kwargs={"beta": 5})
    with pytest.raises(InvalidArgumentError, match="4 sink tokens"):
        Llama(path, n_ctx=N_CTX, policy="streamingllm", budget=4)
    with pytest.raises(InvalidArgumentError, match="exceed the budget"):
        Llama(path, n_ctx=N_CTX, policy="streamingllm", budget=20, window=30)
    with pytest.raises(InvalidArgumentError, match="no argument 'pool'"):
        Llama(path, n_ctx=N_CTX, policy="streamingllm", budget=20, policy_kwargs={"pool": "max"})
    # a fractional budget is resolved once the prompt is known: 10% of 200 is 20 entries,
    # below the policy's floor (64, more than W=32), so it is raised to it with a warning
    llm = Llama(path, n_ctx=N_CTX, policy="snapkv", budget="10%")
    with pytest.warns(RuntimeWarning, match="raised to 64"):
        llm.eval(prompt(200))
    assert {n for layer in llm.kv_stats()["entries_per_head"] for n in layer} == {64}


# ---- 5. question-agnostic: one compression per prefill call ----------------------------

@pytest.mark.parametrize("policy", WINDOW_POLICIES + ["streamingllm"])
def test_context_then_question(gqa_model, policy):
    B, n_ctx_tokens, n_q = 64, 200, 20
    toks = prompt(n_ctx_tokens + n_q, seed=4)
    llm = Llama(gqa_model, n_ctx=N_CTX, n_threads=2, policy=policy, budget=B)
    L, Hkv = llm.model_info["n_layer"], llm.model_info["n_head_kv"]
    llm.eval(toks[:n_ctx_tokens])
    first = positions(llm)
    assert llm.kv_stats()["entries"] <= B * L * Hkv
    # the same as compressing the context alone
    alone = run(gqa_model, policy, toks[:n_ctx_tokens], budget=B)
    assert positions(alone) == first
    evicted = llm.kv_stats()["evicted"]
    llm.eval(toks[n_ctx_tokens:])
    second = positions(llm)
    st = llm.kv_stats()
    assert st["entries"] <= B * L * Hkv and st["evicted"] > evicted
    question = set(range(n_ctx_tokens, n_ctx_tokens + n_q))   # window = min(W, 20): all kept
    for l in range(L):
        for h in range(Hkv):
            got = set(second[l][h])
            assert got <= set(first[l][h]) | question
            if policy == "streamingllm":
                assert got == set(range(SINK)) | set(range(n_ctx_tokens + n_q - (B - SINK), n_ctx_tokens + n_q))
            else:
                assert question <= got
                if policy == "snapkv":
                    assert len(got) == B


# ---- decode ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", WINDOW_POLICIES + ["streamingllm"])
def test_decode_steps(gqa_model, policy):
    B, n, steps = 48, 120, 5
    llm = run(gqa_model, policy, prompt(n, seed=5), budget=B)
    before = llm.kv_stats()["entries_per_head"]
    for t in range(steps):
        llm.eval([5 + t])
    after = llm.kv_stats()["entries_per_head"]
    last = n + steps - 1
    for l, layer in enumerate(after):
        for h, cnt in enumerate(layer):
            p = llm.kv_positions(l, h)
            assert p[-1] == last
            if policy == "streamingllm":   # stays at B: sinks + the most recent
                assert p == list(range(SINK)) + list(range(last + 1 - (B - SINK), last + 1))
            else:                          # grows by one per step, nothing evicted
                assert cnt == before[l][h] + steps
                assert p[-steps:] == list(range(n, n + steps))


# ---- real model ------------------------------------------------------------------------

def test_smollm2_window_policies(smollm2_path):
    """SmolLM2 (30 layers, 9 query heads on 3 KV heads): budget totals, windows, and
    chunked prefill (n_batch 64) keeping the same entries as one shot."""
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 30
    for policy in ("snapkv", "adakv"):
        B = 96
        one = Llama(smollm2_path, **EXACT, n_ctx=1024, n_threads=2, n_batch=512, policy=policy, budget=B)
        toks = one.tokenize(text)[:300]
        one.eval(toks)
        L, Hkv = one.model_info["n_layer"], one.model_info["n_head_kv"]
        st = one.kv_stats()
        assert st["entries"] == B * L * Hkv
        pos = positions(one)
        assert all(set(range(len(toks) - W, len(toks))) <= set(p) for layer in pos for p in layer)
        ch = run(smollm2_path, policy, toks, **EXACT, budget=B, n_batch=64)
        assert positions(ch) == pos
        np.testing.assert_allclose(ch.logits(), one.logits(), rtol=0, atol=1e-3)
