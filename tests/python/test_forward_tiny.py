"""pykv logits on tiny random GGUFs vs the NumPy float64 reference (_reference.py).

Tolerance: pykv dequantizes the stored weights to float32 and computes in float32; the
reference dequantizes the same stored weights (gguf.quants) and computes in float64.
Quantization error is therefore NOT part of the difference: only float32 rounding and
summation order are.  Measured over all variants (prefixes 1..100): max|diff| <= 3.7e-7
* max|logit| (7.3e-6 absolute with logits up to ~110).  We allow 2e-6 * max|logit| + 1e-6,
about 5x the measured worst case, leaving room for other SIMD paths and thread counts.
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _compare import assert_logits_close, EXACT
from _tiny_models import N_VOCAB, VARIANTS
from pykv import Llama

ATOL = 1e-6
RTOL_SCALE = 2e-6
N_TOKENS = 24
PREFIXES = (1, 2, 5, 16, 24)


def _tokens(seed: int, n: int = N_TOKENS):
    return np.random.default_rng(seed).integers(0, N_VOCAB, n).tolist()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefill_logits_match_reference(tiny_model, name):
    path = tiny_model(name)
    tokens = _tokens(seed=11)
    ref = _reference.forward(path, tokens)
    with Llama(str(path), n_ctx=64, verbose=False, **EXACT) as llm:
        for n in PREFIXES:
            llm.reset()
            llm.eval(tokens[:n])
            assert llm.n_past == n
            got = llm.logits()
            assert got.dtype == np.float32 and got.shape == (N_VOCAB,)
            assert_logits_close(got, ref[n - 1], atol=ATOL, rtol_scale=RTOL_SCALE,
                                what=f"{name} prefill of {n} tokens")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_decode_one_token_at_a_time_matches_reference(tiny_model, name):
    path = tiny_model(name)
    tokens = _tokens(seed=12)
    ref = _reference.forward(path, tokens)
    start = 6
    with Llama(str(path), n_ctx=64, verbose=False, **EXACT) as llm:
        llm.eval(tokens[:start])
        for i in range(start, len(tokens)):
            llm.eval([tokens[i]])
            assert llm.n_past == i + 1
            assert_logits_close(llm.logits(), ref[i], atol=ATOL, rtol_scale=RTOL_SCALE,
                                what=f"{name} decode at position {i}")


def test_reset_gives_fresh_context(tiny_model):
    path = tiny_model()
    a, b = _tokens(seed=13, n=10), _tokens(seed=14, n=7)
    ref_b = _reference.forward(path, b)
    with Llama(str(path), n_ctx=64, verbose=False, **EXACT) as llm:
        llm.eval(a)
        llm.reset()
        assert llm.n_past == 0
        llm.eval(b)
        assert_logits_close(llm.logits(), ref_b[-1], atol=ATOL, rtol_scale=RTOL_SCALE,
                            what="after reset")
