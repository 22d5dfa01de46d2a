"""The two independent references agree with each other (no pykv involved).

The NumPy float64 forward (_reference.py, adjacent-pair RoPE on the GGUF tensors) and
transformers (which un-permutes Q/K and uses rotate_half) must give the same logits on
the same GGUF.  This validates the RoPE convention, the GQA head mapping and the
dequantization that the pykv tests rely on.  Measured: tiny variants <= 4.3e-5 abs
(logits up to ~110; the K-quant variant, logits up to ~5, 1.1e-5..3.3e-5 from run to run:
transformers' float32), SmolLM2 4.3e-5 abs (logits up to ~35).
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _compare import assert_logits_close
from _prompts import SHORT
from _tiny_models import N_VOCAB, VARIANTS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _hf_logits(path, tokens):
    from _torch_reference import _model

    with torch.no_grad():
        out = _model(str(path))(torch.tensor([list(tokens)], dtype=torch.long))
    return out.logits[0].double().numpy()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiny_numpy_reference_matches_transformers(tiny_model, name):
    path = tiny_model(name)
    tokens = np.random.default_rng(5).integers(0, N_VOCAB, 40).tolist()
    ref = _reference.forward(path, tokens)
    hf = _hf_logits(path, tokens)
    for i in (0, 7, 39):
        assert_logits_close(hf[i], ref[i], atol=1e-4, rtol_scale=2e-6,
                            what=f"{name} position {i}")


@pytest.mark.model
@pytest.mark.slow  # ~20-60 s (dequantizes SmolLM2 to float64); the tiny checks above run in CI
def test_smollm2_numpy_reference_matches_transformers(smollm2_path):
    from _torch_reference import hf_tokenize, reference_logits

    ids = hf_tokenize(smollm2_path, SHORT)
    hf = reference_logits(smollm2_path, ids, range(len(ids)))
    ref = _reference.forward(smollm2_path, ids)
    for i in range(len(ids)):
        assert_logits_close(hf[i], ref[i], atol=2e-4, what=f"SmolLM2 position {i}")
