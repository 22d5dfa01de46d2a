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


def prompt_then_steps_logits(path, tokens, start, **llama_kw):
    """Logits after tokens[:start] as one call, then after each later token alone (exact
    products; llama_kw picks the cache), one row per call."""
    from pykv import Llama
    with Llama(str(path), n_ctx=64, verbose=False, exact_matmul=True, **llama_kw) as llm:
        llm.eval(tokens[:start])
        out = [llm.logits().copy()]
        for t in tokens[start:]:
            llm.eval([t])
            out.append(llm.logits().copy())
    return np.array(out)


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def kl_from_transformers(smollm2_path, kv_type: str, kv_type_v=None) -> list:
    """KL(transformers || pykv) of SmolLM2's next-token distribution at three positions of
    a 300-token prompt, exact products, the given cache types (the cache check is in here)."""
    from pykv import Llama
    from _prompts import hf_prompt_ids
    from _torch_reference import reference_logits
    ids = hf_prompt_ids(smollm2_path, 300, seed=4)
    positions = [199, 260, 299]
    ref = reference_logits(smollm2_path, ids, positions)
    with Llama(str(smollm2_path), n_ctx=512, verbose=False, exact_matmul=True, kv_type=kv_type,
               kv_type_v=kv_type_v) as llm:
        assert (llm.kv_stats()["kv_type"], llm.kv_stats()["kv_type_v"]) == (kv_type, kv_type_v or kv_type)
        done, kls = 0, []
        for p, r in zip(positions, ref):
            llm.eval(ids[done:p + 1])
            done = p + 1
            lr, lg = _log_softmax(r.astype(np.float64)), _log_softmax(llm.logits().astype(np.float64))
            kls.append(float(np.sum(np.exp(lr) * (lr - lg))))
    return kls
