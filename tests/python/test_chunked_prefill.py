"""Chunked prefill (n_batch = 1, 7, 64) gives the same logits as a one-shot prefill.

Each chunk size is checked two ways:
  * against the independent reference (NumPy float64 for the tiny model, torch for
    SmolLM2) with the same tolerance as the forward tests, and
  * against pykv's own one-shot prefill: with the `full` policy chunking only changes
    how many rows one matmul call sees, not the math, so the only allowed difference is
    float32 summation order (docs/architecture.md); the tolerance is a few times the
    measured difference.
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _compare import assert_logits_close, EXACT
from _prompts import hf_prompt_ids
from _tiny_models import N_VOCAB
from _torch_reference import reference_logits
from pykv import Llama

CHUNKS = (1, 7, 64)
ONE_SHOT = 512

# Measured: tiny chunked vs one-shot <= 4.5e-7 * max|logit| (not bit-identical: the
# matmul kernels block over rows); SmolLM2 chunked vs one-shot <= 1.5e-5 abs, vs torch
# <= 3.3e-5 abs (150-token prompt).
TINY_ATOL, TINY_RTOL = 1e-6, 2e-6      # vs float64 reference (see test_forward_tiny)
SELF_RTOL = 2e-6                       # chunked vs one-shot, relative to max|logit|
SMOL_ATOL = 2e-4                       # vs transformers (see test_forward_smollm2)
SMOL_SELF_ATOL = 6e-5                  # chunked vs one-shot, SmolLM2 (logits up to ~35)


def _prefill_logits(path, tokens, n_batch, n_ctx):
    with Llama(str(path), n_ctx=n_ctx, n_batch=n_batch, verbose=False, **EXACT) as llm:
        llm.eval(tokens)
        assert llm.n_past == len(tokens)
        return llm.logits().copy()


@pytest.mark.parametrize("name", ["llama_f32_h4kv4", "llama_q4_1_h4kv2_tied", "mistral_q4_0_h8kv2"])
def test_tiny_chunked_equals_one_shot(tiny_model, name):
    path = tiny_model(name)
    tokens = np.random.default_rng(21).integers(0, N_VOCAB, 100).tolist()
    ref = _reference.forward(path, tokens)[-1]
    one_shot = _prefill_logits(path, tokens, ONE_SHOT, n_ctx=128)
    assert_logits_close(one_shot, ref, atol=TINY_ATOL, rtol_scale=TINY_RTOL,
                        what=f"{name} one-shot vs reference")
    for nb in CHUNKS:
        got = _prefill_logits(path, tokens, nb, n_ctx=128)
        assert_logits_close(got, ref, atol=TINY_ATOL, rtol_scale=TINY_RTOL,
                            what=f"{name} n_batch={nb} vs reference")
        assert_logits_close(got, one_shot, atol=0.0, rtol_scale=SELF_RTOL,
                            what=f"{name} n_batch={nb} vs one-shot")


@pytest.mark.model
def test_smollm2_chunked_equals_one_shot(smollm2_path):
    ids = hf_prompt_ids(smollm2_path, 150, seed=3)
    ref = reference_logits(smollm2_path, ids, [-1])[0]
    one_shot = _prefill_logits(smollm2_path, ids, ONE_SHOT, n_ctx=256)
    assert_logits_close(one_shot, ref, atol=SMOL_ATOL, what="SmolLM2 one-shot vs torch")
    for nb in CHUNKS:
        got = _prefill_logits(smollm2_path, ids, nb, n_ctx=256)
        assert_logits_close(got, ref, atol=SMOL_ATOL, what=f"SmolLM2 n_batch={nb} vs torch")
        assert_logits_close(got, one_shot, atol=SMOL_SELF_ATOL,
                            what=f"SmolLM2 n_batch={nb} vs one-shot")
