"""Independent NumPy reimplementation of CAKE and LAVa prompt selection (docs/policies.md#cake, #lava).

Never imports pykv.  ``capture_qkv(path, tokens)`` runs the float64 reference forward pass
(``_policy_reference.capture_qkv``, over tests/python/_reference.py) and returns the
post-RoPE q (T, Hq, D), k and v (T, Hkv, D) of every layer.  Because CAKE and LAVa evict
after a layer's prompt attention, the prompt's hidden states (and so q/k/v) are those of
the full model.  ``cake_select`` / ``lava_select`` then apply the spec formulas and return
per-layer budgets and the kept positions of every (layer, KV head), plus the scores so
that a test can tell a genuine near-tie from a real disagreement.
"""

from __future__ import annotations

import math

import numpy as np

import _policy_reference as pref

# ---- float64 forward -------------------------------------------------------------


def _softmax(s):
    s = s - np.max(s, axis=-1, keepdims=True)
    e = np.exp(s)
    return e / np.sum(e, axis=-1, keepdims=True)


def capture_qkv(path, tokens):
    """[(q, k, v)] per layer for the prompt ``tokens`` (float64, post-RoPE q and k)."""
    _, qs, ks, vs = pref.capture_qkv(path, tokens)
    return list(zip(qs, ks, vs))


# ---- shared pieces ------------------------------------------------------------------


def window_attention(q, k, W):
    """A[hq, i, j]: softmax of the last W queries over keys 0..N-W+i (causal), float64."""
    N, H, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    A = np.zeros((H, W, N))
    for hq in range(H):
        z = q[N - W:, hq] @ k[:, hq // rep].T / np.sqrt(D)
        for i in range(W):
            z[i, N - W + i + 1:] = -np.inf
        A[hq] = _softmax(z)
    return A


def pool1d(x, kernel, kind):
    """PyTorch 1-D pooling, stride 1, padding kernel//2 (avg counts the zero padding)."""
    r = kernel // 2
    n = x.shape[-1]
    if kind == "avg":
        pad = np.concatenate([np.zeros(x.shape[:-1] + (r,)), x, np.zeros(x.shape[:-1] + (r,))], axis=-1)
        return np.stack([pad[..., j:j + kernel].sum(-1) for j in range(n)], axis=-1) / kernel
    pad = np.concatenate([np.full(x.shape[:-1] + (r,), -np.inf), x, np.full(x.shape[:-1] + (r,), -np.inf)], axis=-1)
    return np.stack([pad[..., j:j + kernel].max(-1) for j in range(n)], axis=-1)


def top_indices(s, b):
    """Ascending indices of the b largest values of s (ties -> lower index)."""
    b = max(0, min(int(b), len(s)))
    order = np.lexsort((np.arange(len(s)), -s))   # by score desc, then index asc
    return np.sort(order[:b])


def water_fill(weights, caps, total):
    """x_l = min(cap_l, lam * w_l) with sum x = min(total, sum caps); all-zero weights -> equal."""
    w = np.asarray(weights, dtype=np.float64)
    caps = np.asarray(caps, dtype=np.float64)
    n = len(w)
    capped = np.zeros(n, bool)
    x = np.zeros(n)
    while True:
        active = ~capped
        if not active.any():
            return x
        rem = total - caps[capped].sum()
        ws = w[active].sum()
        eff = w if ws > 0 else np.ones(n)
        lam = rem / (ws if ws > 0 else active.sum())
        new = active & (lam * eff >= caps)
        if new.any():
            capped |= new
            x[new] = caps[new]
            continue
        x[active] = lam * eff[active]
        return x


def largest_remainder(x, b, left, room):
    """Give ``left`` units one each to the largest fractional parts of x among entries still
    at floor(x) with room (fractions within 1e-9 tie -> lower index), like the C code."""
    while left > 0:
        best, best_f = -1, -1.0
        for i in range(len(x)):
            f = x[i] - math.floor(x[i])
            if b[i] == math.floor(x[i]) and room(i) and f > best_f + 1e-9:
                best, best_f = i, f
        if best < 0:
            break
        b[best] += 1
        left -= 1
    return b


def final_ints(x, caps, total):
    """floor + largest remainder: integers summing to min(total, sum caps)."""
    caps = np.asarray(caps, dtype=np.int64)
    b = np.minimum(np.floor(x).astype(np.int64), caps)
    left = min(int(total), int(caps.sum())) - int(b.sum())
    return largest_remainder(x, b, left, lambda i: b[i] < caps[i])


# ---- CAKE ---------------------------------------------------------------------------


def cake_layer(q, k, W, gamma=200.0, tau1=1.0, tau2=1.0, kernel=7, pool="max"):
    """(log P_l, indicator (Hkv, n)) of one layer (CAKE's layer preference and indicator)."""
    N, H, _ = q.shape
    Hkv = k.shape[1]
    n = N - W
    A = window_attention(q, k, W)[:, :, :n]          # candidate columns, rows not renormalized
    Hent = -np.sum(A * np.log(A + 1e-10))
    var = A.var(axis=1, ddof=1)                       # (H, n)
    V = var.sum()
    logp = math.log(Hent) / tau1 + math.log(V) / tau2 if Hent > 0 and V > 0 else -math.inf
    ind = pool1d(A.mean(axis=1) + gamma * var, kernel, pool)    # per query head
    ind = ind.reshape(Hkv, H // Hkv, n).mean(axis=1)            # GQA mean
    return logp, ind


def cake_select(qkv, B, W=32, **kw):
    """One-shot CAKE allocation over all layers. Returns dict with budgets (per layer,
    window excluded), real shares, indicators and kept positions keep[l][h]."""
    L = len(qkv)
    N = qkv[0][0].shape[0]
    n = N - W
    logp, inds = zip(*(cake_layer(q, k, W, **kw) for q, k, _ in qkv))
    logp = np.array(logp)
    w = np.exp(logp - logp.max()) if np.isfinite(logp.max()) else np.zeros(L)
    total = (B - W) * L
    x = water_fill(w, [n] * L, total)
    b = final_ints(x, [n] * L, total)
    keep = [[np.concatenate([top_indices(ind[h], b[l]), np.arange(n, N)]) for h in range(ind.shape[0])]
            for l, ind in enumerate(inds)]
    return dict(budgets=b, shares=x, logp=logp, scores=inds, keep=keep, n_cand=n)


# ---- LAVa ---------------------------------------------------------------------------


def lava_layer(q, k, v, W, kernel=7):
    """(normalized entropy e_l, scores s (Hkv, n)) of one layer, the LAVa reference code's form."""
    N, H, _ = q.shape
    Hkv = k.shape[1]
    n = N - W
    A = window_attention(q, k, W)[:, :, :n]
    a = pool1d(A.mean(axis=1), kernel, "max")                      # (H, n)
    vbar = np.abs(v[:n]).sum(-1).max(axis=0)                       # (Hkv,) candidates only
    s = (a.reshape(Hkv, H // Hkv, n) * vbar[:, None, None]).max(axis=1)   # x vbar, GQA max
    p = s / s.sum()
    e = -np.sum(p * np.log(p + 1e-16)) / math.log(Hkv * n)
    return e, s


def lava_head_budgets(labels_prefix, Hkv, K, n_orig, alpha):
    c = np.bincount(labels_prefix, minlength=Hkv)
    share = alpha * K / Hkv
    x = (1 - alpha) * c + share
    b = np.floor(x).astype(np.int64)
    b = largest_remainder(x, b, K - int(b.sum()), lambda i: True)
    excess = 0
    for h in range(Hkv):
        if b[h] > n_orig:
            excess += b[h] - n_orig
            b[h] = n_orig
    for h in range(Hkv):
        add = min(n_orig - b[h], excess)
        b[h] += add
        excess -= add
    return b


def lava_select(qkv, B, W=32, alpha=0.2, cascade=True, kernel=7):
    """LAVa prompt selection, simulating the cascade (each step re-splits by entropy over
    the layers seen so far; a head never re-grows). Returns layer entry budgets K (final
    step), per-head kept counts, scores and kept positions keep[l][h]."""
    L = len(qkv)
    N = qkv[0][0].shape[0]
    Hkv = qkv[0][1].shape[1]
    n = N - W
    total = (B - W) * L * Hkv
    es, scores, labels = [], [], []
    kept = np.full((L, Hkv), n, dtype=np.int64)
    for m, (q, k, v) in enumerate(qkv):
        e, s = lava_layer(q, k, v, W, kernel)
        es.append(e)
        scores.append(s)
        flat = s.reshape(-1)
        order = np.lexsort((np.arange(flat.size), -flat))
        labels.append(order // n)
        if not cascade and m < L - 1:
            continue
        le = np.log(np.array(es))
        w = np.exp(le - le.max())
        K = final_ints(water_fill(w, [Hkv * n] * (m + 1), total), [Hkv * n] * (m + 1), total)
        for l in range(m + 1):
            b = lava_head_budgets(labels[l][:K[l]], Hkv, int(K[l]), n, alpha)
            kept[l] = np.minimum(kept[l], b)
    keep = [[np.concatenate([top_indices(scores[l][h], kept[l][h]), np.arange(n, N)]) for h in range(Hkv)]
            for l in range(L)]
    return dict(layer_K=K, kept=kept, entropy=np.array(es), scores=scores, keep=keep, n_cand=n)


def cake_decode_scores(q, keys, W, kernel=7, pool="max"):
    """CAKE decode rule (position order): q (Hq, D) of the new token,
    keys[h] (n_h, D) = KV head h's list (new token last). Returns per KV head the scores of
    its first n_h - W entries: attention row of each query head -> GQA mean -> pool."""
    Hq, D = q.shape
    Hkv = len(keys)
    rep = Hq // Hkv
    out = []
    for h in range(Hkv):
        n = keys[h].shape[0] - W
        rows = [_softmax(keys[h] @ q[hq] / np.sqrt(D))[:n] for hq in range(h * rep, (h + 1) * rep)]
        out.append(pool1d(np.mean(rows, axis=0), kernel, pool))
    return out
