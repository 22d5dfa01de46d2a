"""The q8_0 KV cache (kv_type="q8_0", --cache-type q8_0): keys (after RoPE) and values stored as
Q8_0 blocks, 34 bytes per 32 values, as llama.cpp's -ctk q8_0 -ctv q8_0.

- Tiny random GGUFs whose head size is a multiple of 32, exact matrix products, against the
  NumPy reference with K and V sent through Q8_0 blocks the same way (scale max|x| / 127 as
  a half, values rounded to nearest even). Only float rounding separates them (measured
  over 3 prompts x 3 variants: 5e-8..4e-7 x max|logit|; tolerance Q8_REL), except where
  a value sits within ~1e-5 of a step's rounding boundary, which float32 here and float64
  there can break differently: one step (1/127 of its block's largest value) on one
  element, 1.5e-3 x max|logit| in the one prompt of the nine where it happens (margin
  7.6e-6 of a step). A prompt whose reference finds a value that close (margin below
  NEAR_EDGE, which leaves room for float32's error in the keys) is held to ONE_STEP_REL;
  most rows must still agree to Q8_REL. Against the f16-rounded reference the difference is ~1e4 times
  larger, so the check sees the quantization.
- SmolLM2 against transformers: the next-token distribution stays within SMOLLM2_KL_MAX
  nats of KL (measured 9e-5..8.2e-4), as small as llama.cpp's own distance from transformers
  (0.001 to 0.007 nats, speed issue).
- Memory: 34 / 32 bytes per element, checked exactly on the allocation, next to f16.
- Every policy runs on it, and a saved state loads back bit for bit.
- A head size that is not whole blocks is a clear error.
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _compare import kl_from_transformers, prompt_then_steps_logits
from _tiny_models import N_VOCAB, VARIANTS, random_tokens
from pykv import InvalidArgumentError, Llama, list_policies

Q8_VARIANTS = sorted(n for n, spec in VARIANTS.items() if spec.head_dim % 32 == 0)
Q8_REL = 2e-6
NEAR_EDGE, ONE_STEP_REL = 2e-4, 5e-3
SMOLLM2_KL_MAX = 3e-3


def test_some_variants_have_whole_blocks():
    assert len(Q8_VARIANTS) >= 2, Q8_VARIANTS


@pytest.mark.parametrize("name", Q8_VARIANTS)
def test_tiny_q8_cache_matches_quantized_reference(tiny_model, name):
    path = tiny_model(name)
    rel, rel_f16 = [], []
    for seed in (41, 42, 43):
        tokens, start = np.random.default_rng(seed).integers(0, N_VOCAB, 20).tolist(), 10
        got = prompt_then_steps_logits(path, tokens, start, kv_type="q8_0")
        margins = []
        ref = _reference.forward(path, tokens, kv_q8_0=True, q8_margins=margins)[start - 1:]
        f16 = _reference.forward(path, tokens, kv_f16=True)[start - 1:]
        scale = np.max(np.abs(ref), axis=1)
        r = np.max(np.abs(got - ref), axis=1) / scale
        near_edge = min(margins) < NEAR_EDGE
        assert np.max(r) <= (ONE_STEP_REL if near_edge else Q8_REL), (seed, min(margins), r)
        rel += list(r)
        rel_f16 += list(np.max(np.abs(got - f16), axis=1) / scale)
    assert np.median(rel) <= Q8_REL, rel
    assert np.median(rel_f16) > 1000 * np.median(rel), (rel, rel_f16)


def test_head_size_not_whole_blocks_is_a_clear_error(tiny_model):
    name = next(n for n, spec in sorted(VARIANTS.items()) if spec.head_dim % 32)
    with pytest.raises(InvalidArgumentError, match="q8_0 KV cache needs a head size that is a multiple of 32"):
        Llama(str(tiny_model(name)), n_ctx=32, kv_type="q8_0")


@pytest.mark.model
def test_smollm2_q8_cache_close_to_transformers(smollm2_path):
    kls = kl_from_transformers(smollm2_path, "q8_0")
    assert max(kls) <= SMOLLM2_KL_MAX, kls


def test_bytes_per_entry(tiny_model):
    path = str(tiny_model(Q8_VARIANTS[0]))
    tokens = random_tokens(40, 9)
    stats = {}
    for kv_type in ("f16", "q8_0"):
        with Llama(path, n_ctx=64, kv_type=kv_type) as llm:
            info = llm.model_info
            llm.eval(tokens)
            stats[kv_type] = llm.kv_stats()
    q8 = stats["q8_0"]
    assert q8["kv_type"] == "q8_0" and q8["bytes_per_element"] == 34 / 32
    per_entry = {"f16": 2 * info["head_dim"] * 2 + 4, "q8_0": 2 * info["head_dim"] // 32 * 34 + 4}
    lists = info["n_layer"] * info["n_head_kv"]
    for kv_type, s in stats.items():   # the same room per list, so the bytes are in the entries' ratio
        assert s["entries"] == 40 * lists
        assert s["bytes"] % per_entry[kv_type] == 0
    assert stats["q8_0"]["bytes"] * per_entry["f16"] == stats["f16"]["bytes"] * per_entry["q8_0"]


@pytest.mark.parametrize("policy", list_policies())
def test_every_policy_runs_on_q8_cache(tiny_model, policy):
    """Each policy evicts (and EMS merges) on Q8_0 entries: a prompt past the budget, then
    decode steps. A sanity check, not the reference (that is the full-cache test above):
    the logits stay finite and near the same policy's on an f16 cache, which differ by the
    8-bit rounding and what it changes in the choice of entries (measured 7e-4..2.6e-2 x
    max|logit|; a policy reading garbage keys lands at O(1))."""
    path = str(tiny_model(Q8_VARIANTS[0]))
    tokens = random_tokens(160, 10)
    out = {}
    for kv_type in ("f16", "q8_0"):
        budget = None if policy == "full" else 48
        with Llama(path, n_ctx=192, kv_type=kv_type, policy=policy, budget=budget) as llm:
            llm.eval(tokens[:150])
            for t in tokens[150:]:
                llm.eval([t])
            out[kv_type] = llm.logits().copy()
            stats = llm.kv_stats()
            if policy != "full":
                assert stats["entries"] < 160 * llm.model_info["n_layer"] * llm.model_info["n_head_kv"] // 2
    assert np.all(np.isfinite(out["q8_0"]))
    assert np.max(np.abs(out["q8_0"] - out["f16"])) <= 0.1 * np.max(np.abs(out["f16"]))


def state_round_trip(path, a, b, **opts):
    """Save a context after tokens a, load the state into a second one, then evaluate b in
    both: their logits agree bit for bit after the load and after b. Returns the state and
    the last logits."""
    with Llama(path, **opts) as saved, Llama(path, **opts) as restored:
        saved.eval(a)
        state = saved.save_state()
        restored.load_state(state)
        np.testing.assert_array_equal(restored.logits(), saved.logits())
        restored.eval(b)
        saved.eval(b)
        np.testing.assert_array_equal(restored.logits(), saved.logits())
        return state, restored.logits().copy()


def test_state_round_trip(tiny_model):
    path = str(tiny_model(Q8_VARIANTS[0]))
    a, b = random_tokens(30, 11), random_tokens(10, 12)
    state, logits = state_round_trip(path, a, b, n_ctx=64, exact_matmul=True, kv_type="q8_0")
    ref = _reference.forward(path, a + b, kv_q8_0=True)[-1]
    assert np.max(np.abs(logits - ref)) <= Q8_REL * np.max(np.abs(ref))
    with Llama(path, n_ctx=64, exact_matmul=True, kv_type="f16") as other:
        with pytest.raises(InvalidArgumentError, match="KV cache of q8_0; this context has .* f16"):
            other.load_state(state)


def test_command_line_flags(tiny_model):
    """-ctk q8_0 -ctv q8_0, or --cache-type q8_0, give what kv_type="q8_0" gives (one side
    alone: test_kv_mixed)."""
    import json
    from test_cli import run_cli
    path = tiny_model(Q8_VARIANTS[0])
    with Llama(str(path), n_ctx=4096, exact_matmul=True, kv_type="q8_0") as llm:
        want = llm.generate("a", max_tokens=12, temperature=0).tokens
    for flags in (("-ctk", "q8_0", "-ctv", "q8_0"), ("--cache-type", "q8_0")):
        r = run_cli("generate", path, "-p", "a", "-n", 12, "--temp", 0, "--json", "--exact-matmul", "--kv-stats", *flags)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tokens"] == want
        assert "MiB now (q8_0)" in r.stderr
