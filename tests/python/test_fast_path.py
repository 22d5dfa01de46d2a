"""The default (fast) decode path: 8-bit activations and integer dot products.

Prefill chunks (several tokens) take 8-bit activations too, for the weight types and widths
of the integer GEMM (gemm-q8.h), and are checked the same way.

Two independent checks:
- Tiny random GGUFs against the NumPy reference with the same activation quantisation
  emulated (_reference.forward(..., int8_rows_from=...)): only float rounding separates
  them (2e-7..4e-7 x max|logit|), except after the odd activation that lands on a
  rounding tie, which float32 here and float64 there break differently. Without the
  emulation every step differs by ~1e-2 x max|logit|, so the check does see the
  quantisation.
- SmolLM2 against transformers (float32) on the same positions: mean KL of the next-token
  distribution and the largest top-10 logit difference. Measured on the same 24 decode
  positions: pykv KL mean 0.0014-0.0021 (max 0.0055), top-10 up to 0.50; llama.cpp
  (llama-cpp-python 0.3.36, same GGUF) KL mean 0.0027-0.0034 (max 0.011), top-10 up to
  0.50. The tolerances are llama.cpp's figures with a little room.
Weight types without an integer kernel (F32, F16) must give exactly the exact path's logits.
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _prompts import hf_prompt_ids
from _tiny_models import N_VOCAB, VARIANTS
from _torch_reference import reference_logits
import pykv
from pykv import Llama

EXACT_REL = 2e-6   # measured 2e-7..4e-7 x max|logit| where no rounding tie is hit; up to 1.5e-6
                   # on the K-quant model after a prefill on the integer GEMM
TIE_REL = 0.05     # measured up to 1.3e-2 after a tie; float activations differ by 1-2e-2
KL_MEAN_MAX = 0.004
KL_MAX = 0.012
TOP10_MAX = 0.6


# Whether this CPU's prefill packs the 8-bit types too (the VNNI kernel, gemm-q8.h).
PREFILL_8BIT = " vnni" in pykv.system_info().split("kernels = ")[1].split("|")[0]


def _tokens(seed: int, n: int = 20):
    return np.random.default_rng(seed).integers(0, N_VOCAB, n).tolist()


def _decode_logits(path, tokens, start, **kw):
    kw.setdefault("kv_type", "f32")   # the matrix products alone (the f16 cache: test_kv_f16)
    with Llama(str(path), n_ctx=64, verbose=False, **kw) as llm:
        llm.eval(tokens[:start])
        out = []
        for t in tokens[start:]:
            llm.eval([t])
            out.append(llm.logits().copy())
    return np.array(out)


@pytest.mark.parametrize("name", sorted(n for n, s in VARIANTS.items() if s.wtype in _reference.INT8_ACT_TYPES))
def test_tiny_fast_decode_matches_int8_reference(tiny_model, name):
    path = tiny_model(name)
    start, rel, rel_float = 8, [], []
    for seed in (21, 23, 24, 25, 26, 27):
        tokens = _tokens(seed)
        got = _decode_logits(path, tokens, start)
        ref = _reference.forward(path, tokens, int8_rows_from=start, int8_prefill=True,
                                 int8_prefill_8bit=PREFILL_8BIT)[start:]
        float_ref = _reference.forward(path, tokens)[start:]
        scale = np.max(np.abs(ref), axis=1)
        rel += list(np.max(np.abs(got - ref), axis=1) / scale)
        rel_float += list(np.max(np.abs(got - float_ref), axis=1) / scale)
    rel, rel_float = np.array(rel), np.array(rel_float)
    # Most steps agree to float rounding; a step where one activation sits on a rounding tie
    # (float32 here, float64 there) differs by about one quantisation step, which then
    # carries into later steps through the cache (a tie in the prefill, into all of its
    # seed's steps: seed 23 has one on both 32-element models, within 2e-5 of a half).
    assert np.mean(rel <= EXACT_REL) >= 0.75, rel
    assert np.all(rel <= TIE_REL), rel
    # Against float activations every step is off by the quantisation noise itself.
    assert np.median(rel_float) > 100 * EXACT_REL, rel_float


# The K-quant variant as written (Q2_K, Q3_K, Q5_K on the integer prefill; IQ4 there too on
# a CPU with VNNI, else on the float one), with every other type the integer prefill takes,
# and with Q8_0 (VNNI only, like IQ4).
PREFILL_TYPE_SETS = {
    "kquants": (),
    "q4k_q6k_and_32_blocks": (("attn_q", "Q4_K"), ("attn_k", "Q6_K"), ("attn_v", "Q4_0"), ("attn_output", "Q4_1"),
                              ("ffn_gate", "Q5_0"), ("ffn_up", "Q5_1"), ("ffn_down", "Q4_K"),
                              ("output.weight", "Q8_0")),
    "q8_0": (("attn_q", "Q8_0"), ("attn_output", "Q8_0"), ("ffn_up", "Q8_0"), ("ffn_down", "IQ4_NL")),
}
# The types each set puts on the integer prefill: everywhere, and on a CPU with VNNI besides.
PREFILL_PACKED = {
    "kquants": ({"Q2_K", "Q3_K", "Q5_K"}, {"IQ4_NL", "IQ4_XS"}),
    "q4k_q6k_and_32_blocks": ({"Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}, {"Q8_0"}),
    "q8_0": ({"Q4_K", "Q6_K"}, {"Q8_0", "IQ4_NL"}),
}


@pytest.mark.parametrize("types", sorted(PREFILL_TYPE_SETS))
def test_tiny_fast_prefill_matches_int8_reference(tiny_model, types):
    """A prefill chunk takes the integer GEMM for the packed types: its logits are the NumPy
    reference's with those products' inputs quantised, to float rounding."""
    changes = {"tensor_types": PREFILL_TYPE_SETS[types]} if PREFILL_TYPE_SETS[types] else {}
    path = tiny_model("llama_kquants_h4kv2", **changes)
    model = _reference.load(path)
    packed = {model.types[n] for n in model.types
              if _reference.int8_prefill_takes(n, model.types[n], 256, PREFILL_8BIT)}
    everywhere, with_vnni = PREFILL_PACKED[types]
    assert packed >= everywhere | (with_vnni if PREFILL_8BIT else set()), packed
    rel, rel_float = [], []
    with Llama(str(path), n_ctx=64, verbose=False, kv_type="f32") as llm:
        for seed in (31, 32):
            tokens = _tokens(seed, 24)
            ref = _reference.forward(model, tokens, int8_prefill=True, int8_prefill_8bit=PREFILL_8BIT)
            float_ref = _reference.forward(model, tokens)
            for n in (2, 9, 24):
                llm.reset()
                llm.eval(tokens[:n])
                got = llm.logits().astype(np.float64)
                scale = np.max(np.abs(ref[n - 1]))
                rel.append(np.max(np.abs(got - ref[n - 1])) / scale)
                rel_float.append(np.max(np.abs(got - float_ref[n - 1])) / scale)
    rel, rel_float = np.array(rel), np.array(rel_float)
    assert np.mean(rel <= EXACT_REL) >= 0.75, rel
    assert np.all(rel <= TIE_REL), rel
    assert np.median(rel_float) > 100 * EXACT_REL, rel_float


@pytest.mark.parametrize("name", sorted(n for n, s in VARIANTS.items() if s.wtype in ("F32", "F16")))
def test_float_weights_have_no_fast_path(tiny_model, name):
    path = tiny_model(name)
    tokens = _tokens(seed=22)
    fast = _decode_logits(path, tokens, 8)
    exact = _decode_logits(path, tokens, 8, exact_matmul=True)
    types = _reference.load(path).types
    assert types.get("output.weight", types["token_embd.weight"]) not in _reference.INT8_ACT_TYPES
    np.testing.assert_array_equal(fast, exact)


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.model
@pytest.mark.parametrize("n, seed", [(40, 3), (300, 4)])
def test_smollm2_fast_decode_close_to_transformers(smollm2_path, n, seed):
    ids = hf_prompt_ids(smollm2_path, n, seed=seed)
    start = n - 12
    ref = reference_logits(smollm2_path, ids, list(range(start, n)))
    with Llama(str(smollm2_path), n_ctx=512, verbose=False) as llm:
        llm.eval(ids[:start])
        kls, top10 = [], []
        for i in range(start, n):
            llm.eval([ids[i]])
            g, r = llm.logits().astype(np.float64), ref[i - start].astype(np.float64)
            lr, lg = _log_softmax(r), _log_softmax(g)
            kls.append(float(np.sum(np.exp(lr) * (lr - lg))))
            best = np.argsort(-r)[:10]
            top10.append(float(np.max(np.abs(g[best] - r[best]))))
    assert np.mean(kls) <= KL_MEAN_MAX, kls
    assert max(kls) <= KL_MAX, kls
    assert max(top10) <= TOP10_MAX, top10
    assert max(kls) > 0   # it is the fast path: the exact one is ~1e-9 from transformers
