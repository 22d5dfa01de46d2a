"""Independent NumPy (float64) reimplementation of the window eviction policies.

Wraps ``_reference`` (never edits it): ``capture_qk`` runs the same textbook forward pass
and returns every layer's post-RoPE queries and keys of the prompt. The selection
functions restate the rules of docs/policies.md (the observation window, streamingllm,
snapkv, pyramidkv, adakv) and the choices documented in the headers of
native/src/kv/policies/:

* window attention: the last W queries over all N keys, causal inside the window, softmax;
  candidate score = column mean over the W rows (j < N - W);
* GQA reduce (mean | max) over the query heads of a KV head, then 1-D pooling (PyTorch
  semantics: avg counts the out-of-range zeros, max ignores them);
* top-k with ties to the lower index; kept set = chosen candidates + the W window entries.

Kept sets are returned as sorted arrays of positions (one-shot prefill from position 0,
so list index == position).
"""

from __future__ import annotations

import math

import numpy as np

import _reference as ref


def capture_qkv(model_path, tokens):
    """Return (hp, qs, ks, vs): per layer q (N, Hq, D), k and v (N, Hkv, D), post-RoPE, float64."""
    model = ref.load(model_path)
    hp = model.hp
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos = np.arange(T)
    n_rep = hp.n_head // hp.n_head_kv
    qs, ks, vs = [], [], []
    x = model.w("token_embd.weight")[tokens]
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = ref.rms_norm(x, model.w(p + "attn_norm.weight"), hp.rms_eps)
        q = (h @ model.w(p + "attn_q.weight").T).reshape(T, hp.n_head, hp.head_dim)
        k = (h @ model.w(p + "attn_k.weight").T).reshape(T, hp.n_head_kv, hp.head_dim)
        v = (h @ model.w(p + "attn_v.weight").T).reshape(T, hp.n_head_kv, hp.head_dim)
        q = ref.rope_adjacent(q, pos, hp.n_rot, hp.rope_base)
        k = ref.rope_adjacent(k, pos, hp.n_rot, hp.rope_base)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        a = ref.attention(q, k, v, n_rep).reshape(T, hp.n_head * hp.head_dim)
        x = x + a @ model.w(p + "attn_output.weight").T
        h = ref.rms_norm(x, model.w(p + "ffn_norm.weight"), hp.rms_eps)
        g = h @ model.w(p + "ffn_gate.weight").T
        u = h @ model.w(p + "ffn_up.weight").T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ model.w(p + "ffn_down.weight").T
    return hp, qs, ks, vs


def capture_qk(model_path, tokens):
    """Return (hp, qs, ks): per layer q (N, Hq, D) and k (N, Hkv, D), post-RoPE, float64."""
    hp, qs, ks, _ = capture_qkv(model_path, tokens)
    return hp, qs, ks


# ---- scoring ---------------------------------------------------------------------

def window_mean(q, k, W):
    """Column means (Hq, N - W) of the window's attention over the candidates."""
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    n = N - W
    rows = np.arange(N - W, N)
    mask = np.arange(N)[None, :] > rows[:, None]          # key after the query: masked
    out = np.empty((Hq, n))
    for hq in range(Hq):
        z = q[N - W:, hq, :] @ k[:, hq // G, :].T / math.sqrt(D)
        z = np.where(mask, -np.inf, z)
        z = z - z.max(axis=1, keepdims=True)
        a = np.exp(z)
        a /= a.sum(axis=1, keepdims=True)
        out[hq] = a[:, :n].mean(axis=0)
    return out


def gqa_reduce(mu, n_head_kv, mode="mean"):
    Hq, n = mu.shape
    g = mu.reshape(n_head_kv, Hq // n_head_kv, n)
    return g.mean(axis=1) if mode == "mean" else g.max(axis=1)


def pool1d(x, kernel, kind="max"):
    r = kernel // 2
    n = len(x)
    out = np.empty(n)
    for j in range(n):
        a, b = max(0, j - r), min(n - 1, j + r)
        out[j] = x[a:b + 1].max() if kind == "max" else x[a:b + 1].sum() / kernel
    return out


def layer_scores(q, k, W, kernel=7, pool="max", gqa="mean"):
    """(Hkv, n) SnapKV scores: window mean -> GQA reduce -> pool."""
    red = gqa_reduce(window_mean(q, k, W), k.shape[1], gqa)
    return np.stack([pool1d(row, kernel, pool) for row in red])


def select_top(s, k):
    """Indices of the k largest (ties -> lower index), ascending."""
    s = np.asarray(s)
    order = np.lexsort((np.arange(len(s)), -s))
    return np.sort(order[:max(0, min(k, len(s)))])


# ---- policies -----------------------------------------------------------------------

def keep_set(chosen, n, N):
    return np.concatenate([np.asarray(chosen, dtype=np.int64), np.arange(n, N)])


def snapkv(qs, ks, B, W=32, **opts):
    """Per layer, per KV head: (kept positions, scores, chosen count)."""
    out = []
    for q, k in zip(qs, ks):
        N = q.shape[0]
        s = layer_scores(q, k, W, **opts)
        out.append([(keep_set(select_top(s[h], B - W), N - W, N), s[h], B - W) for h in range(k.shape[1])])
    return out


def pyramid_budgets(L, Bs, cap, beta=20.0):
    """Selectable per-layer budgets (window excluded), total exactly L * Bs."""
    if L < 2:
        return [Bs]
    bmin = math.floor(Bs / beta)
    bmax = 2 * Bs - bmin
    if bmax >= cap:
        bmax = cap
        bmin = 2 * Bs - bmax
    step = (bmax - bmin) // (L - 1)
    b = [bmax - l * step for l in range(L)]
    rem = L * Bs - sum(b)
    while rem != 0:
        moved = False
        for l in range(L):
            if rem == 0:
                break
            if rem < 0 and b[l] > 0:
                b[l] -= 1
                rem += 1
                moved = True
            elif rem > 0 and b[l] < cap:
                b[l] += 1
                rem -= 1
                moved = True
        if not moved:
            break
    return b


def pyramidkv(qs, ks, B, W=32, beta=20.0, **opts):
    N = qs[0].shape[0]
    budgets = pyramid_budgets(len(qs), B - W, N - W, beta)
    out = []
    for l, (q, k) in enumerate(zip(qs, ks)):
        s = layer_scores(q, k, W, **opts)
        out.append([(keep_set(select_top(s[h], budgets[l]), N - W, N), s[h], budgets[l])
                    for h in range(k.shape[1])])
    return out


def adakv_head_budgets(c, Bs, alpha):
    x = [(1.0 - alpha) * float(ch) + alpha * float(Bs) for ch in c]
    b = [math.floor(v) for v in x]
    left = len(c) * Bs - sum(b)
    given = [False] * len(c)
    while left > 0:
        cand = [(x[h] - math.floor(x[h]), -h) for h in range(len(c)) if not given[h]]
        if not cand:
            break
        _, neg_h = max(cand)
        b[-neg_h] += 1
        given[-neg_h] = True
        left -= 1
    return b


def adakv(qs, ks, B, W=32, alpha=0.2, **opts):
    """Per layer: (list of (kept, scores, b_h) per head, flat scores, joint K)."""
    out = []
    for q, k in zip(qs, ks):
        N, Hkv = q.shape[0], k.shape[1]
        n, Bs = N - W, B - W
        s = layer_scores(q, k, W, **opts)
        flat = s.reshape(-1)
        joint = select_top(flat, Hkv * Bs)
        c = np.bincount(joint // n, minlength=Hkv)
        b = adakv_head_budgets(c, Bs, alpha)
        out.append([(keep_set(select_top(s[h], b[h]), n, N), s[h], b[h]) for h in range(Hkv)])
    return out


def streamingllm(N, B, sink=4):
    if N <= B:
        return np.arange(N)
    return np.concatenate([np.arange(sink), np.arange(N - (B - sink), N)])


# ---- comparison tolerant to genuine near-ties ------------------------------------------

def ambiguous(scores, k, rtol):
    """Candidates whose order against the k-th best is not decided in float32: those within
    rtol (relative) of the boundary score, when that band holds two distinct values (a band
    of exactly equal values, e.g. a max-pool plateau, is decided by the index tie-break)."""
    s = np.asarray(scores)
    if k <= 0 or k >= len(s):
        return set()
    t = np.sort(s)[::-1][k - 1]
    band = np.abs(s - t) <= rtol * max(abs(t), 1e-300)
    if len(np.unique(s[band])) < 2:
        return set()
    return set(np.nonzero(band)[0].tolist())


def same_selection(got, want, scores, k, rtol):
    """True when the kept sets agree except on ambiguous candidates (positions < len(scores))."""
    diff = set(np.asarray(got).tolist()) ^ set(np.asarray(want).tolist())
    return len(got) == len(want) and diff <= ambiguous(scores, k, rtol)


# ---- memory accounting ----------------------------------------------------------------

def kv_bytes_range(stats, head_dim):
    """(lo, hi) bytes a compacted cache may hold: each entry's K, V and position exactly;
    with EMS merges, 8 bytes of member bookkeeping per entry of a merged list plus
    4 bytes per member key norm (kv-cache.h)."""
    per = 2 * head_dim * stats["bytes_per_element"] + 4
    exact = stats["entries"] * per
    if not stats["merged"]:
        return exact, exact
    return exact + 1, exact + 8 * stats["entries"] + 4 * (stats["entries"] + stats["merged"])
