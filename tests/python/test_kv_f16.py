"""The default f16 KV cache: keys (after RoPE) and values stored as IEEE halves.

- Tiny random GGUFs, exact matrix products, against the NumPy reference with K and V
  rounded to halves the same way: only float rounding separates them, except where a value
  sits on a half's rounding boundary, which float32 here and float64 there can break
  differently (one half ulp, ~5e-4 relative, on one element). Measured over 3 prompts x 8
  variants: medians 7e-8..2e-5 x max|logit|, worst 6e-5; tolerance 2e-4. Against the unrounded reference the difference is
  far larger, so the check does see the rounding.
- SmolLM2 against transformers: storing the cache in halves moves the next-token
  distribution by a KL far below what 8-bit activations do (measured 1e-5-ish).
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _compare import kl_from_transformers, prompt_then_steps_logits
from _tiny_models import N_VOCAB, VARIANTS
from pykv import Llama

F16_REL = 2e-4
SMOLLM2_KL_MAX = 5e-4


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiny_f16_cache_matches_rounded_reference(tiny_model, name):
    path = tiny_model(name)
    rel, rel_plain = [], []
    for seed in (31, 32, 33):
        tokens, start = np.random.default_rng(seed).integers(0, N_VOCAB, 20).tolist(), 10
        got = prompt_then_steps_logits(path, tokens, start)
        ref = _reference.forward(path, tokens, kv_f16=True)[start - 1:]
        plain = _reference.forward(path, tokens)[start - 1:]
        scale = np.max(np.abs(ref), axis=1)
        rel += list(np.max(np.abs(got - ref), axis=1) / scale)
        rel_plain += list(np.max(np.abs(got - plain), axis=1) / scale)
    assert max(rel) <= F16_REL, rel
    assert np.median(rel_plain) > 5 * np.median(rel), (rel, rel_plain)


@pytest.mark.model
def test_smollm2_f16_cache_close_to_transformers(smollm2_path):
    kls = kl_from_transformers(smollm2_path, "f16")
    assert max(kls) <= SMOLLM2_KL_MAX, kls


def test_bad_kv_type_is_a_clear_error(tiny_model):
    from pykv import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="kv_type"):
        Llama(str(tiny_model()), n_ctx=32, kv_type="q4_0")
    with Llama(str(tiny_model()), n_ctx=32, kv_type="F32") as llm:   # case does not matter
        assert llm.kv_stats()["kv_type"] == "f32"
