"""The C sampler (pykv_sampler_*) against a NumPy implementation of the same chain.

Each filter is checked by drawing many tokens with a fixed seed and comparing the empirical
frequencies to the probabilities NumPy computes. The seeds are fixed, so the test is
deterministic; the tolerance is five standard deviations of a binomial frequency.
"""

from __future__ import annotations

import numpy as np
import pytest

from pykv._ffi import ffi, lib

N_DRAWS = 20000


# ---------------------------------------------------------------- NumPy reference chain

def ref_logits(logits, *, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
               logit_bias=None, history=()):
    """llama.cpp's logit bias, then its penalties over history (each distinct token once)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for t, b in (logit_bias or {}).items():
        x[t] += b
    tokens, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
    for t, n in zip(tokens, counts):
        if 0 <= t < len(x):
            x[t] = x[t] * repeat_penalty if x[t] <= 0 else x[t] / repeat_penalty
            x[t] -= n * frequency_penalty + presence_penalty
    return x


def ref_typical(x, kept, typical_p):
    """Locally typical sampling (Meister et al.) over the tokens kept, in rank order: those
    whose surprise is nearest the entropy, until their mass exceeds typical_p."""
    with np.errstate(divide="ignore"):
        logp = x[kept] - x[kept].max()
        logp = logp - np.log(np.exp(logp).sum())
        p = np.exp(logp)
        entropy = -np.sum(p[p > 0] * logp[p > 0])
        shift = np.where(p > 0, np.abs(-logp - entropy), np.inf)
    nearest = np.argsort(shift, kind="stable")
    n = int(np.searchsorted(np.cumsum(p[nearest]), typical_p, side="right") + 1)
    chosen = kept[np.sort(nearest[:n])]
    return chosen[np.lexsort((chosen, -x[chosen]))]


def ref_probs(logits, *, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, **penalties):
    """Probabilities of every token after llama.cpp's default chain (temperature > 0)."""
    x = ref_logits(logits, **penalties)
    # rank order: higher logit first, lower id on ties
    order = np.lexsort((np.arange(len(x)), -x))
    keep = np.zeros(len(x), dtype=bool)
    kept = order if top_k <= 0 else order[:top_k]
    if typical_p < 1.0:
        kept = ref_typical(x, kept, typical_p)
    if top_p < 1.0:
        p = np.exp(x[kept] - x[kept].max())
        p /= p.sum()
        n = int(np.searchsorted(np.cumsum(p), top_p - 1e-12) + 1)
        kept = kept[:n]
    if min_p > 0.0:
        kept = kept[x[kept] >= x[kept].max() + np.log(min_p)]
    keep[kept] = True
    z = np.where(keep, (x - x[keep].max()) / temperature, -np.inf)
    probs = np.exp(z)
    return probs / probs.sum()


# ---------------------------------------------------------------- helpers over the C API

def check(status):
    if status != lib.PYKV_OK:
        raise AssertionError(ffi.string(lib.pykv_last_error()).decode())


def make_sampler(**kw):
    params = ffi.new("struct pykv_sampler_params *")
    lib.pykv_sampler_default_params(params)
    for key, value in kw.items():
        setattr(params, key, value)
    out = ffi.new("pykv_sampler **")
    check(lib.pykv_sampler_init(params, out))
    return ffi.gc(out[0], lib.pykv_sampler_free)


def init_status(**kw):
    params = ffi.new("struct pykv_sampler_params *")
    lib.pykv_sampler_default_params(params)
    for key, value in kw.items():
        setattr(params, key, value)
    out = ffi.new("pykv_sampler **")
    status = lib.pykv_sampler_init(params, out)
    if status == lib.PYKV_OK:
        lib.pykv_sampler_free(out[0])
    return status, ffi.string(lib.pykv_last_error()).decode()


def set_bias(smpl, bias):
    tokens = list(bias)
    check(lib.pykv_sampler_set_logit_bias(smpl, len(tokens), ffi.new("pykv_token[]", tokens),
                                          ffi.new("float[]", [bias[t] for t in tokens])))


def sample(smpl, logits):
    arr = np.ascontiguousarray(logits, dtype=np.float32)
    tok = ffi.new("pykv_token *")
    check(lib.pykv_sampler_sample(smpl, ffi.from_buffer("float[]", arr), len(arr), tok))
    return tok[0]


def empirical(smpl, logits, n=N_DRAWS):
    arr = np.ascontiguousarray(logits, dtype=np.float32)
    buf = ffi.from_buffer("float[]", arr)
    tok = ffi.new("pykv_token *")
    counts = np.zeros(len(arr), dtype=np.int64)
    for _ in range(n):
        check(lib.pykv_sampler_sample(smpl, buf, len(arr), tok))
        counts[tok[0]] += 1
    return counts / n


def assert_matches(freq, probs, n=N_DRAWS):
    never = probs == 0
    assert not freq[never].any(), f"filtered-out tokens drawn: {np.nonzero(freq * never)[0]}"
    tol = 5 * np.sqrt(probs * (1 - probs) / n) + 1e-3
    bad = np.abs(freq - probs) > tol
    assert not bad.any(), f"freq {freq[bad]} vs probs {probs[bad]} at {np.nonzero(bad)[0]}"


# ---------------------------------------------------------------- tests

LOGITS = np.array([2.0, 1.7, 1.1, 0.9, 0.5, 0.3, -0.2, -0.6, -1.0, -2.5, 1.5, 0.0],
                  dtype=np.float32)

CONFIGS = {
    "temperature only": dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "hot temperature": dict(temperature=2.5, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0),
    "min_p": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3),
    "defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "all filters": dict(temperature=1.3, top_k=6, top_p=0.85, min_p=0.2),
    "typical": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.6),
    "typical after top_k, before top_p": dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.0, typical_p=0.8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_distribution_matches_numpy(name):
    cfg = CONFIGS[name]
    probs = ref_probs(LOGITS, **cfg)
    if name != "temperature only" and name != "hot temperature":
        assert (probs == 0).any(), "the filter should remove something in this case"
    freq = empirical(make_sampler(seed=1234, **cfg), LOGITS)
    assert_matches(freq, probs)


def test_repeat_penalty_distribution():
    cfg = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.8,
               repeat_last_n=4)
    history = [3, 0, 7, 0, 11, 9]  # only the last 4 count: 7, 0, 11, 9
    smpl = make_sampler(seed=99, **cfg)
    for t in history:
        lib.pykv_sampler_accept(smpl, t)
    ref_cfg = {k: v for k, v in cfg.items() if k != "repeat_last_n"}
    probs = ref_probs(LOGITS, history=history[-4:], **ref_cfg)
    assert not np.allclose(probs, ref_probs(LOGITS, **{**ref_cfg, "repeat_penalty": 1.0}))
    assert_matches(empirical(smpl, LOGITS), probs)


def test_frequency_presence_and_bias_distribution():
    cfg = dict(temperature=1.1, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.2,
               frequency_penalty=0.35, presence_penalty=0.6)
    bias = {4: 1.5, 1: -0.8, 9: -np.inf}
    history = [5, 0, 0, 4, 1, 0, 7, 4]   # the last 6 count: 0 and 4 twice, 1 and 7 once
    smpl = make_sampler(seed=321, repeat_last_n=6, **cfg)
    set_bias(smpl, bias)
    for t in history:
        lib.pykv_sampler_accept(smpl, t)
    probs = ref_probs(LOGITS, history=history[-6:], logit_bias=bias, **cfg)
    assert probs[9] == 0
    plain = ref_probs(LOGITS, **{k: v for k, v in cfg.items() if "penalty" not in k})
    assert np.abs(probs - plain).max() > 0.05
    assert_matches(empirical(smpl, LOGITS), probs)


def test_greedy_penalties_on_large_vocab_match_numpy():
    # Many steps with a long history (repeat_last_n=-1): every pick is NumPy's argmax.
    rng = np.random.default_rng(12)
    cfg = dict(repeat_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    bias = {int(t): float(b) for t, b in zip(rng.integers(0, 4096, 50), rng.normal(0, 2, 50))}
    smpl = make_sampler(temperature=0.0, repeat_last_n=-1, **cfg)
    set_bias(smpl, bias)
    history = []
    for _ in range(60):
        logits = rng.normal(0, 1.0, 4096).astype(np.float32)
        logits[:8] += 3.0   # a few favourites, so the penalties decide between them
        t = sample(smpl, logits)
        assert t == int(np.argmax(ref_logits(logits, logit_bias=bias, history=history, **cfg)))
        lib.pykv_sampler_accept(smpl, t)
        history.append(t)
    assert len(set(history[:20])) > 3, "the penalties should rotate the favourites"


def test_large_vocab_top_k_distribution():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2.0, 49152).astype(np.float32)
    cfg = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02)
    probs = ref_probs(logits, **cfg)
    freq = empirical(make_sampler(seed=7, **cfg), logits, n=5000)
    assert_matches(freq, probs, n=5000)


def test_top_p_without_top_k_on_large_vocab():
    # top_p alone must look past the first sorted block (the sampler grows it as needed).
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 0.3, 49152).astype(np.float32)
    cfg = dict(temperature=1.0, top_k=0, top_p=0.05, min_p=0.0)
    probs = ref_probs(logits, **cfg)
    n_kept = int((probs > 0).sum())
    assert n_kept > 256
    smpl = make_sampler(seed=8, **cfg)
    allowed = set(np.nonzero(probs)[0].tolist())
    drawn = [sample(smpl, logits) for _ in range(500)]
    assert set(drawn) <= allowed


def test_typical_with_banned_tokens():
    """typical_p over every token, some of them banned (-inf: no probability, no entropy term):
    the draw follows the reference on 600 tokens; on SmolLM2's vocabulary size it stays in the
    reference's set."""
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 2.0, 600).astype(np.float32)
    logits[5::11] = -np.inf
    cfg = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.5)
    probs = ref_probs(logits, **cfg)
    assert 10 < (probs > 0).sum() < 300
    assert_matches(empirical(make_sampler(seed=10, **cfg), logits), probs)
    logits = rng.normal(0, 1.0, 49152).astype(np.float32)
    logits[::7] = -np.inf
    cfg = dict(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, typical_p=0.2)
    allowed = set(np.nonzero(ref_probs(logits, **cfg))[0].tolist())
    smpl = make_sampler(seed=11, **cfg)
    assert {sample(smpl, logits) for _ in range(300)} <= allowed


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_is_argmax(temperature):
    rng = np.random.default_rng(0)
    smpl = make_sampler(temperature=temperature, seed=1)
    for _ in range(20):
        logits = rng.normal(0, 3, 49152).astype(np.float32)
        assert sample(smpl, logits) == int(np.argmax(logits))
    ties = np.zeros(100, dtype=np.float32)
    ties[[17, 42, 80]] = 5.0
    assert sample(smpl, ties) == 17


def test_greedy_with_repeat_penalty():
    smpl = make_sampler(temperature=0.0, repeat_penalty=1.5, repeat_last_n=8)
    logits = np.array([1.4, 2.0, -1.0, 1.2], dtype=np.float32)
    assert sample(smpl, logits) == 1
    lib.pykv_sampler_accept(smpl, 1)  # 2.0 / 1.5 = 1.33 < 1.4
    assert sample(smpl, logits) == 0
    lib.pykv_sampler_reset(smpl)
    assert sample(smpl, logits) == 1


def test_same_seed_same_sequence():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, 49152).astype(np.float32)

    def run(seed):
        smpl = make_sampler(seed=seed, repeat_penalty=1.1)
        out = []
        for _ in range(50):
            t = sample(smpl, logits)
            lib.pykv_sampler_accept(smpl, t)
            out.append(t)
        return out

    assert run(42) == run(42)
    assert run(42) != run(43)
    # the random seed (PYKV_DEFAULT_SEED) still samples valid tokens
    smpl = make_sampler(seed=lib.PYKV_DEFAULT_SEED)
    assert 0 <= sample(smpl, logits) < len(logits)


def test_logits_not_modified():
    logits = LOGITS.copy()
    smpl = make_sampler(seed=3, repeat_penalty=2.0)
    lib.pykv_sampler_accept(smpl, 0)
    sample(smpl, logits)
    np.testing.assert_array_equal(logits, LOGITS)


@pytest.mark.parametrize("field,value,needle", [
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.01, "top_p"),
    ("top_p", float("nan"), "top_p"),
    ("min_p", -0.01, "min_p"),
    ("min_p", 1.5, "min_p"),
    ("min_p", float("nan"), "min_p"),
    ("temperature", float("nan"), "temperature"),
    ("top_k", -3, "top_k"),
    ("repeat_penalty", 0.0, "repeat_penalty"),
    ("repeat_last_n", -2, "repeat_last_n"),
    ("frequency_penalty", float("inf"), "frequency_penalty"),
    ("presence_penalty", float("nan"), "presence_penalty"),
    ("typical_p", 0.0, "typical_p"),
    ("typical_p", 1.5, "typical_p"),
    ("typical_p", float("nan"), "typical_p"),
    ("mirostat", 3, "mirostat"),
    ("mirostat", -1, "mirostat"),
    ("mirostat_tau", 0.0, "mirostat_tau"),
    ("mirostat_eta", float("nan"), "mirostat_eta"),
])
def test_invalid_params(field, value, needle):
    status, message = init_status(**{field: value})
    assert status == lib.PYKV_ERR_INVALID_ARG
    assert needle in message


def test_invalid_sample_arguments():
    smpl = make_sampler(seed=1)
    tok = ffi.new("pykv_token *")
    arr = np.zeros(4, dtype=np.float32)
    assert lib.pykv_sampler_sample(smpl, ffi.NULL, 4, tok) == lib.PYKV_ERR_INVALID_ARG
    assert "logits" in ffi.string(lib.pykv_last_error()).decode()
    assert lib.pykv_sampler_sample(smpl, ffi.from_buffer("float[]", arr), 0, tok) == \
        lib.PYKV_ERR_INVALID_ARG
    assert "n_vocab" in ffi.string(lib.pykv_last_error()).decode()
    arr[2] = np.nan
    assert lib.pykv_sampler_sample(smpl, ffi.from_buffer("float[]", arr), 4, tok) == \
        lib.PYKV_ERR_INVALID_ARG
    assert "token 2" in ffi.string(lib.pykv_last_error()).decode()


# ---------------------------------------------------------------- Mirostat

def ref_mirostat_keep(logits, version, temperature, mu):
    """The tokens Mirostat keeps at threshold mu and their renormalised probabilities
    (NumPy, float64): version 2 keeps -log2 p <= mu; version 1 the top k, k from the Zipf
    exponent fitted to the 100 most likely (Basu et al. 2021, as llama.cpp computes it)."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.lexsort((np.arange(len(p)), -p))
    if version == 2:
        keep = order[-np.log2(p[order]) <= mu]
        keep = keep if len(keep) else order[:1]
    else:
        m = min(100, len(p))
        i = np.arange(m - 1)
        t = np.log((i + 2) / (i + 1))
        b = np.log(p[order[:m - 1]] / p[order[1:m]])
        s_hat = (t * b).sum() / (t * t).sum()
        eps = s_hat - 1
        k = (eps * 2.0 ** mu / (1 - len(p) ** -eps)) ** (1 / s_hat)
        keep = order[:int(min(max(k, 1), len(p)))]
    q = np.zeros(len(p))
    q[keep] = p[keep] / p[keep].sum()
    return q


MIROSTAT_LOGITS = np.random.default_rng(11).standard_normal(600).astype(np.float32) * 2.5


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_first_draw_distribution(version):
    """The first draw (mu = 2 tau) of fresh samplers follows the reference's truncation."""
    tau, temp, n = 3.0, 0.9, 4000
    counts = np.zeros(len(MIROSTAT_LOGITS))
    for seed in range(n):
        counts[sample(make_sampler(mirostat=version, mirostat_tau=tau, temperature=temp, seed=seed),
                      MIROSTAT_LOGITS)] += 1
    assert_matches(counts / n, ref_mirostat_keep(MIROSTAT_LOGITS, version, temp, 2 * tau), n=n)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_threshold_follows_the_surprise(version):
    """Over 300 draws from one sampler, each token is one the reference keeps at the mu that
    the reference updates from the tokens drawn so far (mu -= eta * (surprise - tau), the
    surprise under the renormalised probabilities); mu does move across the run."""
    tau, eta, temp = 4.0, 0.5, 1.0
    smpl = make_sampler(mirostat=version, mirostat_tau=tau, mirostat_eta=eta, temperature=temp, seed=99,
                        top_k=1)   # ignored under Mirostat
    mu = np.float32(2 * tau)
    sizes = set()
    for _ in range(300):
        q = ref_mirostat_keep(MIROSTAT_LOGITS, version, temp, float(mu))
        token = sample(smpl, MIROSTAT_LOGITS)
        assert q[token] > 0, (token, float(mu))
        sizes.add(int((q > 0).sum()))
        mu = np.float32(mu - np.float32(eta) * np.float32(-np.log2(q[token]) - tau))
    assert len(sizes) > 3


def test_mirostat_greedy_and_logits_untouched():
    """Temperature 0 is greedy with Mirostat on too; the logits are not modified."""
    arr = MIROSTAT_LOGITS.copy()
    assert sample(make_sampler(mirostat=2, temperature=0.0, seed=1), arr) == int(np.argmax(arr))
    assert np.array_equal(arr, MIROSTAT_LOGITS)
