"""Eviction really frees memory: after an 8K-token prompt with budget 256, the KV bytes
pykv reports (its real allocation) are within a few percent of the budget's size,
256 x layers x KV heads x head_dim x 2 (K and V) x bytes per element (2 for the default f16
cache, 4 for f32), for every policy in the registry. The only overhead allowed is the 4-byte
original position kept per entry (4 / (2 * 32 * 2) = 3.1% at this model's head_dim 32 in
f16; 1.6% at SmolLM2's 64), checked exactly, and for EMS the member key norms of merged
entries.

A tiny random-weight model keeps the 8K prefill to seconds; the bookkeeping is the same as
for a real model (the SmolLM2 totals are checked in test_policies.py)."""
import numpy as np
import pytest

from pykv import Llama, list_policies

from _policy_reference import kv_bytes_range

N_PROMPT, BUDGET = 8192, 256
VARIANT = "mistral_f16_h4kv1"   # 3 layers, 1 KV head, head_dim 32


@pytest.fixture(scope="module")
def long_model(tiny_model):
    return str(tiny_model(VARIANT))


@pytest.fixture(scope="module")
def prompt():
    return [int(t) for t in np.random.default_rng(5).integers(3, 250, size=N_PROMPT)]


@pytest.mark.parametrize("policy", [p for p in list_policies() if p != "full"])
def test_budget_256_after_8k_prompt(long_model, prompt, policy):
    with Llama(long_model, n_ctx=N_PROMPT + 64, n_batch=512, policy=policy, budget=BUDGET) as llm:
        info = llm.model_info
        llm.eval(prompt)
        stats = llm.kv_stats()
    lists = info["n_layer"] * info["n_head_kv"]
    bpe = stats["bytes_per_element"]
    assert stats["kv_type"] == "f16" and bpe == 2   # the default
    budget_bytes = BUDGET * lists * info["head_dim"] * 2 * bpe
    position_overhead = 4 / (2 * info["head_dim"] * bpe)
    assert stats["entries"] <= BUDGET * lists
    assert stats["entries"] >= 0.9 * BUDGET * lists, "a policy should use most of its budget"
    lo, hi = kv_bytes_range(stats, info["head_dim"])   # the real allocation
    assert lo <= stats["bytes"] <= hi
    merge_bookkeeping = hi - stats["entries"] * (2 * info["head_dim"] * bpe + 4)   # EMS only
    assert stats["bytes"] <= (1 + position_overhead) * budget_bytes + merge_bookkeeping
    assert stats["evicted"] == N_PROMPT * lists - stats["entries"]


@pytest.mark.parametrize("kv_type, bpe", [("f16", 2), ("f32", 4), ("q8_0", 34 / 32)])
def test_full_cache_holds_every_entry(long_model, prompt, kv_type, bpe):
    with Llama(long_model, n_ctx=N_PROMPT + 64, n_batch=512, policy="full", kv_type=kv_type) as llm:
        info = llm.model_info
        llm.eval(prompt)
        stats = llm.kv_stats()
    assert stats["kv_type"] == kv_type and stats["bytes_per_element"] == bpe
    per_entry = 2 * info["head_dim"] * bpe + 4
    lists = info["n_layer"] * info["n_head_kv"]
    assert stats["entries"] == N_PROMPT * lists and stats["evicted"] == 0
    # lists grow by an eighth at a time: the slack stays below 1/8 of the entries
    assert N_PROMPT * lists * per_entry <= stats["bytes"] <= 1.125 * N_PROMPT * lists * per_entry
