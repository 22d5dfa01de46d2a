"""TAKE (docs/policies.md#take) against an independent NumPy reimplementation.

The reference below (float64) re-runs the chunked prefill itself, since TAKE evicts
between chunks and later chunks attend over the pruned cache: the same chunk schedule as
pykv's context (n_ubatch less the probe, the last chunk holding at least probe_len tokens),
the probe appended at the positions right after each chunk but the last, one ragged list
per (layer, KV head) with causal-by-position attention. Its policy step restates the choices
in the header of native/src/kv/policies/take/take.c: EMA of the un-rotated probe queries (rows
aligned at the end), re-rotation to the current probe positions, softmax over the entries
without the probe (causal by position in the last chunk, whose real tail is the probe),
mean over the probe rows, GQA mean, avg pooling (zeros counted), top-k with ties to the
lower position; budget B_warmup on layers <= W_L - 1 in every chunk but the last, B
elsewhere; layers below the key layer W_L - 1 follow its selection.

pykv computes in float32, so kept sets must agree except on genuine near-ties: candidates
whose float64 scores at the final selection boundary lie within RTOL_TIE relative
(``_policy_reference.same_selection``).
"""
import math

import numpy as np
import pytest

from _compare import EXACT
from pykv import Llama
from pykv.errors import InvalidArgumentError

import _policy_reference as pref
import _reference as ref

RTOL_TIE = 1e-4
LOGITS_ATOL = 1e-5       # chunked vs one-shot prefill (logits ~1-10; bit-identical today)
PROMPT = [int(t) for t in np.random.default_rng(21).integers(3, 250, size=200)]


# ---- the NumPy reference ------------------------------------------------------------

def chunk_schedule(N, n_ubatch, n_probe, last_min):
    """(start, T) per chunk, as pykv_decode cuts them (context.c next_chunk_size)."""
    if N <= n_ubatch:
        return [(0, N)]
    out, done = [], 0
    while done < N:
        rem = N - done
        T = min(rem, n_ubatch)
        if T < rem and T > n_ubatch - n_probe:
            T = n_ubatch - n_probe
        if T < rem and rem - T < min(last_min, n_ubatch):
            T = rem - min(last_min, n_ubatch)
        out.append((done, T))
        done += T
    return out


def rope(x, pos, hp, sign=1):
    return ref.rope_adjacent(x, sign * np.asarray(pos), hp.n_rot, hp.rope_base)


def softmax(z):
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


class TakeRef:
    def __init__(self, path, B, probe_len=32, alpha=0.2, kernel=7, warmup_layers=None, warmup_budget=None):
        self.model = ref.load(path)
        self.hp = hp = self.model.hp
        self.B, self.probe_len, self.alpha, self.kernel = B, probe_len, alpha, kernel
        self.WL = hp.n_layer // 2 if warmup_layers is None else warmup_layers
        self.warmup_budget = warmup_budget
        # per (layer, KV head): keys (n, D), values (n, D), positions (n,)
        self.K = [[np.zeros((0, hp.head_dim)) for _ in range(hp.n_head_kv)] for _ in range(hp.n_layer)]
        self.V = [[np.zeros((0, hp.head_dim)) for _ in range(hp.n_head_kv)] for _ in range(hp.n_layer)]
        self.P = [[np.zeros(0, dtype=np.int64) for _ in range(hp.n_head_kv)] for _ in range(hp.n_layer)]
        self.last_scores = {}   # (layer, g) -> (scores, k) of the latest selection

    def prefill(self, tokens, n_ubatch, probe=None):
        N = len(tokens)
        probe_toks = list(probe) if probe else list(tokens[N - min(self.probe_len, N):])
        n_probe = len(probe_toks) if N > n_ubatch else 0
        self.ema = [None] * self.hp.n_layer
        self.Bw = max(self.B, self.warmup_budget or min(N, 20 * self.B))
        for start, T in chunk_schedule(N, n_ubatch, n_probe, self.probe_len):
            last = start + T == N
            extra = [] if last else probe_toks[:n_probe]
            self._chunk(list(tokens[start:start + T]) + extra, start, T, len(extra), last)

    def _chunk(self, toks, start, T, p, last):
        hp, m = self.hp, self.model
        G = hp.n_head // hp.n_head_kv
        n = len(toks)
        pos = np.arange(start, start + n)
        x = m.w("token_embd.weight")[np.asarray(toks)]
        for il in range(hp.n_layer):
            w = lambda s: m.w(f"blk.{il}.{s}")
            h = ref.rms_norm(x, w("attn_norm.weight"), hp.rms_eps)
            q = rope((h @ w("attn_q.weight").T).reshape(n, hp.n_head, hp.head_dim), pos, hp)
            k = rope((h @ w("attn_k.weight").T).reshape(n, hp.n_head_kv, hp.head_dim), pos, hp)
            v = (h @ w("attn_v.weight").T).reshape(n, hp.n_head_kv, hp.head_dim)
            for g in range(hp.n_head_kv):
                self.K[il][g] = np.concatenate([self.K[il][g], k[:, g]])
                self.V[il][g] = np.concatenate([self.V[il][g], v[:, g]])
                self.P[il][g] = np.concatenate([self.P[il][g], pos])
            att = np.empty((n, hp.n_head, hp.head_dim))
            for hq in range(hp.n_head):
                g = hq // G
                z = q[:, hq] @ self.K[il][g].T / math.sqrt(hp.head_dim)
                z[self.P[il][g][None, :] > pos[:, None]] = -np.inf
                a = np.exp(z - z.max(axis=1, keepdims=True))
                att[:, hq] = (a / a.sum(axis=1, keepdims=True)) @ self.V[il][g]
            x = x + att.reshape(n, -1) @ w("attn_output.weight").T
            h = ref.rms_norm(x, w("ffn_norm.weight"), hp.rms_eps)
            gg, u = h @ w("ffn_gate.weight").T, h @ w("ffn_up.weight").T
            x = x + (gg / (1.0 + np.exp(-gg)) * u) @ w("ffn_down.weight").T
            self._policy(il, q, T, p, last, start)
            for g in range(hp.n_head_kv):   # drop the probe
                keep = len(self.P[il][g]) - p
                self.K[il][g], self.V[il][g], self.P[il][g] = (self.K[il][g][:keep], self.V[il][g][:keep],
                                                               self.P[il][g][:keep])

    def _policy(self, il, q, T, p, last, start):
        hp = self.hp
        key = self.WL - 1
        if il < max(key, 0):
            return
        end = start + T
        if p:
            rows, pos0 = p, end
        else:
            rows = min(len(self.ema[il]) if self.ema[il] is not None else self.probe_len, T)
            pos0 = end - rows
        rpos = np.arange(pos0, pos0 + rows)
        now = rope(q[T + p - rows:], rpos, hp, sign=-1)
        old = self.ema[il]
        if old is not None:
            shift = len(old) - rows
            for r in range(rows):
                if 0 <= r + shift < len(old):
                    now[r] = self.alpha * old[r + shift] + (1 - self.alpha) * now[r]
        self.ema[il] = now
        qa = rope(now, rpos, hp)
        k = self.Bw if (il <= key and not last) else self.B
        G = hp.n_head // hp.n_head_kv
        for g in range(hp.n_head_kv):
            n_cols = len(self.P[il][g]) - p
            Kc, Pc = self.K[il][g][:n_cols], self.P[il][g][:n_cols]
            mean = np.zeros((G, n_cols))
            for j in range(G):
                for r in range(rows):
                    vis = Pc <= pos0 + r
                    z = qa[r, g * G + j] @ Kc[vis].T / math.sqrt(hp.head_dim)
                    mean[j, :vis.sum()] += softmax(z)
            s = pref.pool1d(mean.mean(axis=0) / rows, self.kernel, "avg")
            chosen = pref.select_top(s, k) if n_cols > k else np.arange(n_cols)
            self.last_scores[(il, g)] = (s, k)
            keep = np.concatenate([chosen, np.arange(n_cols, len(self.P[il][g]))]).astype(np.int64)
            want = self.P[il][g][chosen]
            self._retain(il, g, keep)
            for low in range(key if il == key else 0):
                self._retain(low, g, np.nonzero(np.isin(self.P[low][g], want))[0])

    def _retain(self, il, g, keep):
        self.K[il][g], self.V[il][g], self.P[il][g] = self.K[il][g][keep], self.V[il][g][keep], self.P[il][g][keep]


# ---- helpers ---------------------------------------------------------------------------

def kept(llm, hp_layers, n_kv):
    return [[llm.kv_positions(l, g) for g in range(n_kv)] for l in range(hp_layers)]


def run_take(path, tokens, *, n_batch, budget, n_threads=1, **kwargs):
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=n_batch, n_threads=n_threads, policy="take", budget=budget,
               policy_kwargs=kwargs or None) as llm:
        llm.eval(tokens)
        info = llm.kv_stats()
        return kept(llm, len(info["entries_per_head"]), len(info["entries_per_head"][0])), info, llm.logits()


# ---- 1. no eviction: the probe does not leak ------------------------------------------

@pytest.mark.parametrize("n_batch,probe_len", [(32, 8), (64, 16), (64, 31)])
def test_no_eviction_chunked_equals_one_shot(tiny_model, n_batch, probe_len):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=512, n_threads=1) as full:
        full.eval(PROMPT)
        want = full.logits()
    got_kept, info, logits = run_take(path, PROMPT, n_batch=n_batch, budget=len(PROMPT), probe_len=probe_len)
    assert info["evicted"] == 0
    assert all(p == list(range(len(PROMPT))) for layer in got_kept for p in layer)
    np.testing.assert_allclose(logits, want, rtol=0, atol=LOGITS_ATOL)


# ---- 2. the kept sets match the NumPy reference ----------------------------------------

CASES = [
    # variant, n_batch, budget, policy kwargs, explicit probe (token ids)
    ("llama_f32_h4kv4", 64, 24, {"probe_len": 8, "warmup_budget": 48}, None),
    ("llama_q8_0_h8kv2", 48, 20, {"probe_len": 6, "alpha": 0.32}, None),
    ("llama_q8_0_h8kv2", 40, 16, {"probe_len": 5, "warmup_layers": 1, "warmup_budget": 40, "kernel": 5}, None),
    ("mistral_f16_h4kv1", 64, 24, {"probe_len": 8, "warmup_layers": 3, "warmup_budget": 60},
     [7, 19, 33, 101, 5, 77, 12, 240, 9, 64]),
    ("llama_f32_h4kv4", 64, 24, {"probe_len": 8, "warmup_layers": 0}, None),
]


@pytest.mark.parametrize("variant,n_batch,budget,kwargs,probe", CASES)
def test_selection_matches_numpy(tiny_model, variant, n_batch, budget, kwargs, probe):
    path = tiny_model(variant, n_layer=4)
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=n_batch, n_threads=2, policy="take", budget=budget,
               policy_kwargs=kwargs) as llm:
        if probe is not None:
            llm.set_probe(probe)
        llm.eval(PROMPT)
        r = TakeRef(path, budget, **kwargs)
        r.prefill(PROMPT, n_batch, probe)
        hp = r.hp
        key = r.WL - 1
        for layer in range(hp.n_layer):
            for g in range(hp.n_head_kv):
                got = llm.kv_positions(layer, g)
                want = r.P[layer][g]
                assert len(got) == budget, (layer, g)
                s, k = r.last_scores[(max(layer, key), g)]
                assert pref.same_selection(got, want, s, k, RTOL_TIE), (layer, g, sorted(set(got) ^ set(want)))


def test_single_chunk_matches_numpy(tiny_model):
    """One chunk: no appended probe; the prompt's last probe_len tokens score everything."""
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    got, _, _ = run_take(path, PROMPT, n_batch=256, budget=30, probe_len=12)
    r = TakeRef(path, 30, probe_len=12)
    r.prefill(PROMPT, 256)
    for layer in range(4):
        for g in range(2):
            s, k = r.last_scores[(max(layer, r.WL - 1), g)]
            assert pref.same_selection(got[layer][g], r.P[layer][g], s, k, RTOL_TIE), (layer, g)


# ---- 3. invariants ---------------------------------------------------------------------

def test_budget_and_threads(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    B = 20
    k1, info1, l1 = run_take(path, PROMPT, n_batch=48, budget=B, n_threads=1, probe_len=8, warmup_budget=50)
    k2, info2, l2 = run_take(path, PROMPT, n_batch=48, budget=B, n_threads=2, probe_len=8, warmup_budget=50)
    assert k1 == k2
    np.testing.assert_array_equal(l1, l2)
    assert info1["entries"] <= B * 4 * 2
    assert all(n <= B for layer in info1["entries_per_head"] for n in layer)
    for layer in k1:
        for p in layer:
            assert p == sorted(p) and len(set(p)) == len(p) and max(p) < len(PROMPT)
    # the shallow layers (below the key layer 4/2 - 1 = 1) hold the key layer's positions
    assert k1[0] == k1[1]


def test_fractional_budget(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    got, info, _ = run_take(path, PROMPT, n_batch=48, budget="40%", probe_len=8)
    assert all(n == 80 for layer in info["entries_per_head"] for n in layer)   # ceil(0.4 * 200), not 81


def test_peak_memory_far_below_full(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 250, size=480)]
    n_batch, B, Bw, n_lists, hd = 64, 16, 32, 4 * 2, 128 // 8
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=n_batch, policy="full") as full:
        full.eval(prompt)
        full_peak = full.kv_stats()["peak_bytes"]
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=n_batch, policy="take", budget=B,
               policy_kwargs={"probe_len": 8, "warmup_budget": Bw}) as llm:
        llm.eval(prompt)
        stats = llm.kv_stats()
    # every list holds at most B_warmup + one chunk (probe included) at any time; the list
    # allocation grows by an eighth at a time
    bound = n_lists * 2 * hd * 4 * math.ceil((Bw + n_batch) * 9 / 8)
    assert stats["peak_bytes"] <= bound
    assert stats["peak_bytes"] * 3 < full_peak
    assert stats["entries"] == B * n_lists


def test_explicit_probe_changes_selection(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    default, _, _ = run_take(path, PROMPT, n_batch=48, budget=20, probe_len=8)
    text = "what is the answer to the question"
    probed, _, _ = run_take(path, PROMPT, n_batch=48, budget=20, probe_len=8, probe=text)
    assert probed != default
    # the same probe as token ids gives the same result; set_probe(None) restores the default
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=48, n_threads=1, policy="take", budget=20,
               policy_kwargs={"probe_len": 8}) as llm:
        ids = llm.tokenize(text, add_bos=False, special=True)
        llm.set_probe(ids)
        llm.eval(PROMPT)
        assert kept(llm, 4, 2) == probed
        llm.reset()
        llm.set_probe(None)
        llm.eval(PROMPT)
        assert kept(llm, 4, 2) == default


def test_decode_grows(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    B = 20
    with Llama(str(path), **EXACT, n_ctx=512, n_batch=48, policy="take", budget=B, policy_kwargs={"probe_len": 8}) as llm:
        llm.eval(PROMPT)
        assert llm.kv_stats()["entries"] == B * 8
        for step in range(5):
            llm.eval([7 + step])
            assert llm.kv_stats()["entries"] == (B + step + 1) * 8
            assert llm.kv_positions(2, 1)[-1] == len(PROMPT) + step
        assert np.all(np.isfinite(llm.logits()))


def test_prompt_within_budget_not_evicted(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2", n_layer=4)
    got, info, _ = run_take(path, PROMPT[:60], n_batch=32, budget=64, probe_len=8)
    assert info["evicted"] == 0 and all(p == list(range(60)) for layer in got for p in layer)


# ---- 4. bad arguments -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,budget,match", [
    ({"bogus": 1}, 16, "bogus"),
    ({"alpha": 1.0}, 16, "alpha"),
    ({"alpha": -0.1}, 16, "alpha"),
    ({"alpha": "x"}, 16, "alpha"),
    ({"kernel": 4}, 16, "kernel"),
    ({"probe_len": 0}, 16, "probe_len"),
    ({"warmup_budget": 0}, 16, "warmup_budget"),
    ({"warmup_layers": -1}, 16, "warmup_layers"),
])
def test_bad_args(tiny_model, kwargs, budget, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Llama(str(tiny_model("llama_q8_0_h8kv2", n_layer=4)), **EXACT, n_ctx=256, policy="take", budget=budget,
              policy_kwargs=kwargs)


def test_bad_runtime_values(tiny_model):
    path = str(tiny_model("llama_q8_0_h8kv2", n_layer=4))
    with Llama(path, **EXACT, n_ctx=512, n_batch=48, policy="take", budget=16, policy_kwargs={"warmup_layers": 5, "probe_len": 8}) as llm:
        with pytest.raises(InvalidArgumentError, match="warmup_layers"):
            llm.eval(PROMPT)
    with Llama(path, **EXACT, n_ctx=512, n_batch=32, policy="take", budget=16) as llm:
        llm.set_probe(list(range(3, 19)))   # an explicit probe of 16 >= 32 / 2 does not fit
        with pytest.raises(InvalidArgumentError, match="probe"):
            llm.eval(PROMPT)
        with pytest.raises(InvalidArgumentError):
            llm.set_probe([10 ** 6])
        llm.set_probe(None)   # the default probe (probe_len 32) shrinks to fit the chunk
        llm.eval(PROMPT)
        assert llm.kv_stats()["entries"] <= 16 * 4 * 2
