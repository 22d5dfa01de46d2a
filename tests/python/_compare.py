"""Logit comparison helpers with informative failure messages."""

from __future__ import annotations

import numpy as np


def top2_gap(logits) -> float:
    top = np.sort(np.asarray(logits, dtype=np.float64))[-2:]
    return float(top[1] - top[0])


def assert_logits_close(got, ref, *, atol: float, rtol_scale: float = 0.0, what: str = ""):
    """Assert max|got - ref| <= atol + rtol_scale * max|ref| and equal argmax
    (argmax only where the reference's top-2 gap exceeds twice the tolerance).

    Returns the max abs difference (handy for measuring tolerances)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite logits"
    diff = float(np.max(np.abs(got - ref)))
    scale = float(np.max(np.abs(ref)))
    tol = atol + rtol_scale * scale
    assert diff <= tol, (
        f"{what}: max|logit diff| = {diff:.3e} > tol {tol:.3e} "
        f"(max|ref| = {scale:.3g}, worst index {int(np.argmax(np.abs(got - ref)))})"
    )
    if top2_gap(ref) > 2 * tol:
        assert int(np.argmax(got)) == int(np.argmax(ref)), (
            f"{what}: argmax {int(np.argmax(got))} != reference {int(np.argmax(ref))}"
        )
    return diff


# The exact path: float activations in every product and a float32 KV cache. Tests that
# compare against an independent float reference at float32 tolerances run on it; the fast
# defaults (8-bit decode activations, f16 cache) have their own tests (test_fast_path.py).
EXACT = {"exact_matmul": True, "kv_type": "f32"}
