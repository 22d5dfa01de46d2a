"""kvpress (NVIDIA's KV-cache compression library, 0.5.5) as the outside reference for pykv's
KV policies: which positions each (layer, KV head) keeps after one prompt, in both.

kvpress side: the GGUF's weights in transformers (float32, CPU, loaded by transformers' own
GGUF reader, as in _torch_reference.py), the prompt run once through the model under the
press (``with press(model): model.model(ids, past_key_values=DynamicCache())``, as kvpress's
pipeline prefills a context). The kept positions are then read from the compressed cache:
each kept key row is matched against the rows of the same prompt run without a press, per
(layer, KV head). That recovers positions whatever order a press gathers its entries in
(score order for ScorerPress, position order for others). A press that rotates its kept keys
to new positions (KeyRerotationPress, FinchPress) has its indices taken where it hands them
to ``KeyRerotationPress.rerotate_keys`` (the values at those positions are checked against
the cache); failing both, rows are matched on their values, which must then be unique.
Presses that mask rather than remove (AdaKVPress and the other head-wise presses:
``module.masked_key_indices``) leave every row in the cache; the masked rows are taken out.

pykv side: ``Llama(..., exact_matmul=True, kv_type="f32", policy=..., budget=...)``, the
prompt evaluated, then ``Llama.kv_positions(layer, head)`` (``pykv_kv_head_positions``).

Counts: a pykv budget B is entries per (layer, KV head) list (the window included); kvpress's
``compression_ratio`` r keeps ``max(1, int(n * (1 - r)))`` of n entries per list
(``kvpress.utils.compute_n_kept``; StreamingLLMPress keeps ``int(n * (1 - r))``).
``compression_ratio(B, n)`` gives the r for which kvpress keeps exactly B of n.

Question: with ``question`` (token ids) both sides see prompt + question in one pass (the
question-aware setting of kvpress's benchmarks, where the question is compressed with the
context): pykv evaluates them in one eval, kvpress prefills them in one forward. FinchPress
learns its window from a delimiter token in the input; here its window is set to the
question's length directly (the same split, without adding a token to the vocabulary).
Positions then count over prompt + question.

Nothing here imports kvpress or torch at import time: tests that do not compare against
kvpress pay nothing for this module.
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

KVPRESS_VERSION = "0.5.5"

Kept = Dict[Tuple[int, int], np.ndarray]


# kvpress's SnapKVPress defaults, as pykv policy arguments
SNAPKV_ARGS = {"window": 64, "pool": "avg", "kernel": 5, "gqa": "mean"}


def report(what: str, found: Dict[Tuple[int, int], float]):
    """Print a comparison's least and mean IoU (shown with pytest -s) and return found."""
    print(f"{what}: min IoU {min(found.values()):.4f}, mean {np.mean(list(found.values())):.4f}")
    return found


# ---- availability -------------------------------------------------------------------

@lru_cache(maxsize=1)
def _kvpress_problem() -> Optional[str]:
    """None when kvpress 0.5.5 imports, else why not."""
    try:
        from importlib.metadata import version

        import kvpress  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"kvpress does not import ({type(exc).__name__}: {exc}); pip install 'kvpress=={KVPRESS_VERSION}'"
    found = version("kvpress")
    if found != KVPRESS_VERSION:
        return f"kvpress {found} is installed; these comparisons are written against kvpress {KVPRESS_VERSION}"
    return None


def skip_without_kvpress() -> None:
    """pytest.skip (with the reason) unless kvpress 0.5.5 imports."""
    import pytest

    problem = _kvpress_problem()
    if problem is not None:
        pytest.skip(problem)


# ---- the transformers model ---------------------------------------------------------

@lru_cache(maxsize=4)
def _hf_model(path: str, _mtime: int):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.eval()
    return model


def hf_model(gguf_path):
    """The GGUF's weights in transformers (float32, CPU), loaded once per path. Its own copy,
    not _torch_reference's: presses set attributes on its attention modules."""
    path = os.fspath(gguf_path)
    return _hf_model(path, os.stat(path).st_mtime_ns)


def _set_attention(model, attn: str) -> None:
    if getattr(model.config, "_attn_implementation", None) == attn:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
    else:
        model.config._attn_implementation = attn


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def _clear_masks(model) -> None:
    for module in _attention_modules(model):
        module.masked_key_indices = None


@contextlib.contextmanager
def _rerotated_indices(found: dict):
    """Record, per layer, the kept indices a press hands to KeyRerotationPress.rerotate_keys
    (KeyRerotationPress and FinchPress call it through the class)."""
    from kvpress.presses.key_rerotation_press import KeyRerotationPress

    original = KeyRerotationPress.__dict__["rerotate_keys"]

    def recording(module, indices, keys):
        found[module.layer_idx] = indices[0].detach().cpu().numpy().astype(np.int64)
        return original.__func__(module, indices, keys)

    KeyRerotationPress.rerotate_keys = staticmethod(recording)
    try:
        yield found
    finally:
        KeyRerotationPress.rerotate_keys = original


def _prefill(model, ids, press=None):
    """The cache after one forward of ``ids`` (under ``press`` when given) and the attention
    modules' masked_key_indices then."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    _clear_masks(model)
    with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
        model.model(input_ids=torch.tensor([ids], dtype=torch.long), past_key_values=cache)
    masks = [getattr(m, "masked_key_indices", None) for m in _attention_modules(model)]
    _clear_masks(model)
    layers = [(layer.keys[0].to(torch.float64).numpy(), layer.values[0].to(torch.float64).numpy())
              for layer in cache.layers]
    return layers, masks


@lru_cache(maxsize=8)
def _full_cache(path: str, _mtime: int, ids: tuple, attn: str):
    model = hf_model(path)
    _set_attention(model, attn)
    layers, _ = _prefill(model, list(ids))
    return layers


# ---- matching kept rows to positions -------------------------------------------------

def _nearest(rows: np.ndarray, table: np.ndarray):
    """For each row, the index of the nearest row of table and the relative distance."""
    d2 = (np.sum(rows * rows, axis=1)[:, None] - 2.0 * rows @ table.T
          + np.sum(table * table, axis=1)[None, :])
    best = np.argmin(d2, axis=1)
    dist = np.sqrt(np.maximum(d2[np.arange(len(rows)), best], 0.0))
    scale = np.sqrt(np.sum(table[best] ** 2, axis=1)) + 1e-30
    return best, dist / scale


def _relative_gap(rows: np.ndarray, table: np.ndarray) -> np.ndarray:
    return np.sqrt(np.sum((rows - table) ** 2, axis=1)) / (np.sqrt(np.sum(table * table, axis=1)) + 1e-30)


def _match_positions(kept_k, kept_v, full_k, full_v, indices=None, tol=1e-4, what="") -> np.ndarray:
    """Positions (in the full cache) of the kept rows, in the kept rows' order; ``indices``:
    the positions a re-rotating press reported, checked here against the values."""
    if indices is not None:
        gap = _relative_gap(kept_v, full_v[indices]) if len(indices) == len(kept_v) else None
        if gap is None or np.any(gap > tol):
            raise AssertionError(f"the re-rotated entries' values are not those of their reported positions {what}")
        return indices
    pos, rel = _nearest(kept_k, full_k)
    if np.all(rel <= tol) and len(np.unique(pos)) == len(pos):
        return pos
    # keys moved: match the values, which must then name one position each
    out = np.empty(len(kept_v), dtype=np.int64)
    for j, row in enumerate(kept_v):
        cands = np.flatnonzero(_relative_gap(full_v, row[None, :]) <= tol)
        if len(cands) != 1:
            raise AssertionError(f"a kept entry matches {len(cands)} positions of the prompt {what}"
                                 f"(nearest key {rel[j]:.2e} relative); a press that moves keys must go "
                                 "through KeyRerotationPress.rerotate_keys to be read back")
        out[j] = cands[0]
    return out


# ---- counts ---------------------------------------------------------------------------

def compression_ratio(budget: int, n_tokens: int) -> float:
    """kvpress's compression_ratio for which it keeps exactly ``budget`` of ``n_tokens``
    entries per list: 1 - (B + 1e-6) / n, so that n * (1 - r) lies a hair above B and both
    ``int()`` (compute_n_kept, StreamingLLMPress) and ``round()`` (PyramidKVPress's
    fallback) give B."""
    budget, n_tokens = int(budget), int(n_tokens)
    if not 0 < budget <= n_tokens:
        raise ValueError(f"budget {budget} must be in [1, {n_tokens}]")
    if budget == n_tokens:
        return 0.0
    ratio = 1.0 - (budget + 1e-6) / n_tokens
    kept = n_tokens * (1.0 - ratio)
    assert int(kept) == budget and round(kept) == budget, (budget, n_tokens, ratio)
    return ratio


# ---- the two sides ----------------------------------------------------------------------

def kvpress_kept(gguf_path, tokens, press, *, attn: str = "sdpa", question=None) -> Kept:
    """{(layer, kv_head): sorted positions} kvpress's ``press`` keeps after prefilling
    ``tokens`` (+ ``question``) with attention implementation ``attn`` ("sdpa"; "eager"
    for presses that read the attention weights, e.g. ObservedAttentionPress)."""
    path = os.fspath(gguf_path)
    ids = [int(t) for t in tokens] + [int(t) for t in (question or [])]
    if question and hasattr(press, "delimiter_token_id") and hasattr(press, "window_size"):
        # FinchPress: the window is the question; no delimiter token in the input
        if press.delimiter_token_id is None:
            press.delimiter_token_id = -1
        press.window_size = len(question)
    model = hf_model(path)
    _set_attention(model, attn)
    full = _full_cache(path, os.stat(path).st_mtime_ns, tuple(ids), attn)
    with _rerotated_indices({}) as rerotated:
        layers, masks = _prefill(model, ids, press)
    out = {}
    for layer, ((keys, values), (full_k, full_v), mask) in enumerate(zip(layers, full, masks)):
        for head in range(keys.shape[0]):
            what = f"(layer {layer}, KV head {head}) "
            indices = rerotated[layer][head] if layer in rerotated else None
            pos = _match_positions(keys[head], values[head], full_k[head], full_v[head], indices, what=what)
            if mask is not None:
                _, heads, seq = (np.asarray(t) for t in mask)
                masked = set(seq[heads == head].tolist())
                pos = np.asarray([p for i, p in enumerate(pos) if i not in masked], dtype=np.int64)
            out[(layer, head)] = np.sort(pos)
    return out


def pykv_kept(gguf_path, tokens, policy, budget, *, policy_kwargs=None, question=None, **llama_kwargs) -> Kept:
    """{(layer, kv_head): sorted positions} pykv's ``policy`` keeps with ``budget`` after
    evaluating ``tokens`` (+ ``question``, in the same eval), float activations in every
    product (exact_matmul) and an f32 cache; ``llama_kwargs`` go to Llama (n_batch, ...)."""
    from pykv import Llama

    ids = [int(t) for t in tokens] + [int(t) for t in (question or [])]
    kwargs = {"n_ctx": max(256, len(ids) + 16), "n_batch": max(len(ids), 1), "n_threads": 2,
              "exact_matmul": True, "kv_type": "f32", **llama_kwargs}
    with Llama(os.fspath(gguf_path), policy=policy, budget=budget, policy_kwargs=policy_kwargs, **kwargs) as llm:
        llm.eval(ids)
        per_head = llm.kv_stats()["entries_per_head"]
        return {(layer, head): np.sort(np.asarray(llm.kv_positions(layer, head), dtype=np.int64))
                for layer in range(len(per_head)) for head in range(len(per_head[layer]))}


# ---- comparing ------------------------------------------------------------------------------

def iou(a, b) -> float:
    """|a & b| / |a | b| of two position sets (1.0 for two empty sets)."""
    a, b = set(np.asarray(a).tolist()), set(np.asarray(b).tolist())
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def ious(pykv_sets: Kept, kvpress_sets: Kept) -> Dict[Tuple[int, int], float]:
    """The IoU of every (layer, kv_head) both sides have (the keys must agree)."""
    assert set(pykv_sets) == set(kvpress_sets), \
        f"(layer, head) lists differ: pykv {sorted(pykv_sets)} vs kvpress {sorted(kvpress_sets)}"
    return {key: iou(pykv_sets[key], kvpress_sets[key]) for key in sorted(pykv_sets)}


def assert_overlap(pykv_sets: Kept, kvpress_sets: Kept, min_iou: float = 0.95, what: str = "") -> Dict:
    """Assert IoU >= min_iou for every (layer, kv_head); returns the IoUs."""
    found = ious(pykv_sets, kvpress_sets)
    low = {key: round(v, 4) for key, v in found.items() if v < min_iou}
    assert not low, (f"{what}: IoU below {min_iou} for (layer, head): {low}; kept counts "
                     + ", ".join(f"{key}: pykv {len(pykv_sets[key])} kvpress {len(kvpress_sets[key])}"
                                 for key in low))
    return found
