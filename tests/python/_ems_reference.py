"""Independent NumPy (float64) reimplementation of EMS (docs/policies.md#ems) for the tests.

Restates the choices documented in native/src/kv/policies/ems/:

* s_Glo: full causal softmax column sums over every prompt query; s_Loc: column sums over
  the last W queries (causal); both GQA means over the query heads of a KV head.
* a = sum(s_Loc) / sum(s_Glo) over the whole list; s_GL = max(a s_Glo, s_Loc) on the
  candidates (positions < N - W); mean pooling, PyTorch avg_pool1d (zeros counted).
* rank: score descending, ties -> lower index; centres = first B - W, TBM = next
  (gamma - 1) B, rest evicted.
* R = cos(k_i, k_c) cos(v_i, v_c) on post-RoPE keys, -|R| if either cosine is negative;
  TBM i merges into argmax_c R (first max) when tau < 1 and R >= tau.
* merge: w = max(s_Loc, 1e-30), k_e = normalize(sum w k/|k|), v_e = sum w v / sum w,
  member norms |k_i|.
The decode-step forward uses the merged cache EXPANDED: one key norm_i * k_e and value v_e
per member.
"""
from __future__ import annotations

import numpy as np

import _policy_reference as pref
import _reference as ref


def capture_qkv(model_path, tokens):
    """Per layer q (N, Hq, D), k and v (N, Hkv, D), post-RoPE, float64 (textbook forward)."""
    return pref.capture_qkv(model_path, tokens)


def colsums(q, k, rows):
    """(Hkv, N) attention column sums of query rows `rows` (causal), GQA mean."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = np.zeros((Hq, N))
    mask = np.arange(N)[None, :] > rows[:, None]
    for h in range(Hq):
        z = q[rows, h, :] @ k[:, h // G, :].T / np.sqrt(D)
        z[mask] = -np.inf
        a = np.exp(z - z.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        out[h] = a.sum(axis=0)
    return out.reshape(Hkv, G, N).mean(axis=1)


def avg_pool(x, kernel):
    return np.convolve(x, np.ones(kernel) / kernel, mode="same") if kernel > 1 else x.copy()


def _cos(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def redundancy(ki, vi, kc, vc):
    ck, cv = _cos(ki, kc), _cos(vi, vc)
    return -abs(ck * cv) if (ck < 0 or cv < 0) else ck * cv


def ems_head(k, v, glo, loc, B, W, kernel, tau, gamma, eps=1e-4):
    """One list. Returns (entries, n_merged, ambiguous): entries = sorted list of
    (pos, key, value, norms or None, member positions); ambiguous = a near-tie decided the
    outcome."""
    N = k.shape[0]
    if N <= B:
        return [(j, k[j], v[j], None) for j in range(N)], 0, False
    nc = N - W
    a = loc.sum() / glo.sum()
    gl = np.maximum(a * glo[:nc], loc[:nc])
    s = avg_pool(gl, kernel)
    order = np.lexsort((np.arange(nc), -s))
    n_imp = B - W
    n_tbm = min((gamma - 1) * B, nc - n_imp)
    amb = False
    for cut in (n_imp, n_imp + n_tbm):   # near-ties across the partition boundaries
        if 0 < cut < nc and abs(s[order[cut - 1]] - s[order[cut]]) <= eps * abs(s[order[cut - 1]]):
            amb = True
    cent = np.sort(order[:n_imp])
    members = {int(c): [] for c in cent}
    if tau < 1:
        for i in order[n_imp:n_imp + n_tbm]:
            r = np.array([redundancy(k[i], v[i], k[c], v[c]) for c in cent])
            b = int(np.argmax(r))
            if abs(r[b] - tau) <= 1e-4 or np.sum(r >= r[b] - 1e-5) > 1:
                amb = True
            if r[b] >= tau:
                members[int(cent[b])].append(int(i))
    entries, n_merged = [], 0
    for c in cent:
        m = [int(c)] + sorted(members[int(c)])
        if len(m) == 1:
            entries.append((int(c), k[c], v[c], None, m))
            continue
        w = np.maximum(loc[m], 1e-30)
        nk = np.linalg.norm(k[m], axis=1)
        ks = (w[:, None] * k[m] / nk[:, None]).sum(axis=0)
        entries.append((int(c), ks / np.linalg.norm(ks), (w[:, None] * v[m]).sum(axis=0) / w.sum(), nk, m))
        n_merged += len(m) - 1
    entries += [(j, k[j], v[j], None, [j]) for j in range(nc, N)]
    return entries, n_merged, amb


def ems_prefill(qs, ks, vs, B, W=32, kernel=7, tau=0.6, gamma=4, scores=None):
    """Per layer, per KV head: (entries, n_merged, ambiguous). With scores=[], also appends
    per layer and KV head the (s_Glo, s_Loc) of every prompt token, for ems_decode_step."""
    out = []
    for q, k, v in zip(qs, ks, vs):
        N = q.shape[0]
        glo = colsums(q, k, np.arange(N))
        loc = colsums(q, k, np.arange(max(0, N - W), N))
        out.append([ems_head(k[:, g], v[:, g], glo[g], loc[g], B, W, kernel, tau, gamma)
                    for g in range(k.shape[1])])
        if scores is not None:
            scores.append([(glo[g], loc[g]) for g in range(k.shape[1])])
    return out


def ems_decode_step(lists, scores, new, B, W=32, tau=0.6, gamma=4, eps=1e-4):
    """The first decode step after ems_prefill, per layer and KV head: (removed position,
    members merged into another entry (0 when evicted), ambiguous). new: per layer the
    decode token's (q (Hq, D), k (Hkv, D), v (Hkv, D), position).

    The token is appended; s_Glo += its attention and s_Loc = s_Loc_past + s_Loc_cur, where a
    merged entry's attention is its members' total and its s_Glo and s_Loc_past the sums of
    its members' prompt scores. The weakest candidate (not among the last W) by
    max(a s_Glo, s_Loc), a = sum s_Loc / sum s_Glo, merges into the candidate of largest R
    (stored key: a merged entry's unit direction) when R >= tau, else is evicted."""
    out = []
    for il, (q, k_new, v_new, pos) in enumerate(new):
        G = q.shape[0] // k_new.shape[0]
        row = []
        for g in range(k_new.shape[0]):
            entries = lists[il][g][0]
            glo_p, loc_p = scores[il][g]
            keys, vals, owner = [], [], []
            for j, (_, ke, ve, norms, _) in enumerate(entries):
                for nm in (norms if norms is not None else [1.0]):
                    keys.append(nm * ke), vals.append(ve), owner.append(j)
            keys.append(k_new[g]), owner.append(len(entries))
            K, owner = np.array(keys), np.array(owner)
            att = np.zeros(len(entries) + 1)
            for r in range(G):
                z = K @ q[g * G + r] / np.sqrt(q.shape[1])
                p = np.exp(z - z.max())
                att += np.bincount(owner, weights=p / p.sum(), minlength=len(entries) + 1) / G
            glo = np.array([glo_p[e[4]].sum() for e in entries] + [0.0]) + att
            loc = np.array([loc_p[e[4]].sum() for e in entries] + [0.0]) + att
            n = len(entries) + 1
            if n <= B:
                row.append((None, 0, False))
                continue
            nc = n - min(W, n)
            a = loc.sum() / glo.sum()
            gl = np.maximum(a * glo[:nc], loc[:nc])
            weak = int(np.argmin(gl))
            amb = bool(np.sum(gl <= gl[weak] * (1 + eps) + 1e-12) > 1)
            members = sum(len(e[4]) for e in entries) + 1
            merged = 0
            if tau < 1 and members <= gamma * B and nc > 1:
                kw, vw = entries[weak][1], entries[weak][2]
                r = np.array([redundancy(kw, vw, entries[c][1], entries[c][2]) if c != weak else -np.inf
                              for c in range(nc)])
                b = int(np.argmax(r))
                amb |= bool(abs(r[b] - tau) <= 1e-4 or np.sum(r >= r[b] - 1e-5) > 1)
                if r[b] >= tau:
                    merged = len(entries[weak][4])
            row.append((entries[weak][0], merged, amb))
        out.append(row)
    return out


def decode_logits(model_path, prompt, token, lists, new=None):
    """Logits (n_vocab,) of `token` at position len(prompt) over the compressed prompt cache
    `lists` (ems_prefill's output), every merged entry expanded into its members. With
    new=[], also appends per layer the token's (q, k, v, position) for ems_decode_step."""
    model = ref.load(model_path)
    hp = model.hp
    N = len(prompt)
    G = hp.n_head // hp.n_head_kv
    x = model.w("token_embd.weight")[np.array([token])]
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = ref.rms_norm(x, model.w(p + "attn_norm.weight"), hp.rms_eps)
        q = (h @ model.w(p + "attn_q.weight").T).reshape(1, hp.n_head, hp.head_dim)
        k = (h @ model.w(p + "attn_k.weight").T).reshape(1, hp.n_head_kv, hp.head_dim)
        v = (h @ model.w(p + "attn_v.weight").T).reshape(1, hp.n_head_kv, hp.head_dim)
        q = ref.rope_adjacent(q, np.array([N]), hp.n_rot, hp.rope_base)
        k = ref.rope_adjacent(k, np.array([N]), hp.n_rot, hp.rope_base)
        if new is not None:
            new.append((q[0], k[0], v[0], N))
        att = np.empty((hp.n_head, hp.head_dim))
        for g in range(hp.n_head_kv):
            keys, vals = [], []
            for _, ke, ve, norms, _ in lists[il][g][0]:
                if norms is None:
                    keys.append(ke), vals.append(ve)
                else:
                    for nm in norms:
                        keys.append(nm * ke), vals.append(ve)
            keys.append(k[0, g]), vals.append(v[0, g])
            K, V = np.array(keys), np.array(vals)
            for r in range(G):
                z = K @ q[0, g * G + r] / np.sqrt(hp.head_dim)
                pz = np.exp(z - z.max())
                att[g * G + r] = (pz / pz.sum()) @ V
        x = x + att.reshape(1, -1) @ model.w(p + "attn_output.weight").T
        h = ref.rms_norm(x, model.w(p + "ffn_norm.weight"), hp.rms_eps)
        gg = h @ model.w(p + "ffn_gate.weight").T
        u = h @ model.w(p + "ffn_up.weight").T
        x = x + (gg / (1.0 + np.exp(-gg)) * u) @ model.w(p + "ffn_down.weight").T
    x = ref.rms_norm(x, model.w("output_norm.weight"), hp.rms_eps)
    w_out = model.w("output.weight") if model.has("output.weight") else model.w("token_embd.weight")
    return (x @ w_out.T)[0]
